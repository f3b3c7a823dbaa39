"""What a registered version carries as code (chunkgrpo.registry.payload.served_code_files): the modules the
served model can import, found from its imports, and nothing of the training side."""

import os
import subprocess
import sys

from chunkgrpo.registry.payload import SERVED_MODULE, served_code, served_code_files


def test_the_served_code_is_the_served_models_imports_and_nothing_of_training():
    files = served_code_files()
    for needed in ("chunkgrpo/__init__.py", "chunkgrpo/served_model.py", "chunkgrpo/registry/__init__.py",
                   "chunkgrpo/registry/payload.py", "chunkgrpo/eval/hybrid.py", "chunkgrpo/store/client.py",
                   "chunkgrpo/presets/tiny_cpu.yaml"):
        assert needed in files, needed
    for left_out in ("chunkgrpo/cli.py", "chunkgrpo/train/trainer.py", "chunkgrpo/objectives.py",
                     "chunkgrpo/registry/registration.py", "chunkgrpo/toy/pretrained.py"):
        assert left_out not in files, left_out
    assert not any(rel.startswith("chunkgrpo/toy/pretrained/") for rel in files)  # the shipped toy model
    assert all(f.is_file() and f.as_posix().endswith(rel) for rel, f in files.items())


def test_only_chunkgrpo_modules_are_read_when_the_package_sits_among_others(tmp_path):
    """Installed in an image, the package's folder is site-packages: the modules it imports from other
    packages there are not carried, and their sources are never read (a syntax error in one would raise)."""
    (tmp_path / "chunkgrpo" / "registry").mkdir(parents=True)
    (tmp_path / "chunkgrpo" / "__init__.py").write_text("")
    (tmp_path / "chunkgrpo" / "served_model.py").write_text(
        "import numpy\nfrom chunkgrpo.registry import payload\n\n\ndef f():\n    from torch import nn\n")
    (tmp_path / "chunkgrpo" / "registry" / "__init__.py").write_text("")
    (tmp_path / "chunkgrpo" / "registry" / "payload.py").write_text("from . import __name__ as _n\n")
    (tmp_path / "chunkgrpo" / "presets").mkdir()
    (tmp_path / "chunkgrpo" / "presets" / "a.yaml").write_text("x: 1\n")
    for other in ("numpy", "torch"):
        (tmp_path / other).mkdir()
        (tmp_path / other / "__init__.py").write_text("this is not python (\n")
    assert sorted(served_code_files(tmp_path)) == [
        "chunkgrpo/__init__.py", "chunkgrpo/presets/a.yaml", "chunkgrpo/registry/__init__.py",
        "chunkgrpo/registry/payload.py", "chunkgrpo/served_model.py"]


def test_every_carried_module_imports_from_the_carried_folder_alone(tmp_path):
    """In a fresh interpreter whose path starts at the copied folder (as MLflow puts a version's `code/`
    first), every carried module imports, and from there, not from this checkout."""
    code = served_code(tmp_path / "code")
    modules = [rel[:-3].replace("/", ".").removesuffix(".__init__") for rel in served_code_files()
               if rel.endswith(".py")]
    assert SERVED_MODULE in modules
    script = ("import importlib, sys\n"
              f"sys.path.insert(0, {str(code.parent)!r})\n"
              f"for m in {modules!r}:\n"
              "    mod = importlib.import_module(m)\n"
              f"    assert mod.__file__.startswith({str(code)!r}), (m, mod.__file__)\n"
              "print('ok', len(sys.modules))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=300)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stderr[-3000:]

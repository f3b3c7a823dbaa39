"""scripts/env_check.py, the check `scripts/setup.sh` runs before it skips installing: a missing requirement,
a version the specifier refuses and a missing requirement reached only through an extra's self-reference
(`chunkgrpo[core]`) each make it report; the real `.venv` passes, with its exit code."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

from scripts import env_check

REPO = Path(__file__).resolve().parents[2]


class _Dist:
    def __init__(self, version: str, requires: list[str] | None = None):
        self.version, self.requires = version, requires


def _world(**dists):
    def get(name):
        try:
            return dists[name.replace("-", "_")]
        except KeyError:
            raise metadata.PackageNotFoundError(name) from None
    return get


REQUIRES = [
    "numpy>=1.26",
    'torch>=2.4; extra == "core"',
    'diffusers>=0.35; extra == "core"',
    'chunkgrpo[core]; extra == "train"',
    'peft>=0.15; extra == "train"',
    'chunkgrpo[train]; extra == "all"',
    'pytest>=8; extra == "dev"',
]


def test_a_complete_environment_has_nothing_unmet():
    get = _world(chunkgrpo=_Dist("0.1.0", REQUIRES), numpy=_Dist("2.1.0"), torch=_Dist("2.13.0+cpu"),
                 diffusers=_Dist("0.36.0"), peft=_Dist("0.17.0"), pytest=_Dist("8.4.0"))
    assert env_check.unmet(get=get) == []


def test_missing_old_and_self_referenced_requirements_are_reported():
    # diffusers is required only through all -> chunkgrpo[train] -> chunkgrpo[core]
    get = _world(chunkgrpo=_Dist("0.1.0", REQUIRES), numpy=_Dist("1.20.0"), torch=_Dist("2.13.0"),
                 peft=_Dist("0.17.0"), pytest=_Dist("8.4.0"))
    assert sorted(env_check.unmet(get=get)) == [
        "diffusers>=0.35: not installed", "numpy>=1.26: installed 1.20.0"]


def test_an_extra_not_asked_for_is_not_required():
    get = _world(chunkgrpo=_Dist("0.1.0", REQUIRES), numpy=_Dist("2.1.0"), pytest=_Dist("8.4.0"))
    assert env_check.unmet(extras=("dev",), get=get) == []
    assert env_check.unmet(get=_world()) == ["chunkgrpo: not installed"]


def test_this_environment_passes_and_a_broken_one_exits_1(tmp_path):
    script = str(REPO / "scripts" / "env_check.py")
    r = subprocess.run([sys.executable, script], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    # the same interpreter, without its site-packages: nothing of chunkgrpo[all,dev] is there
    r = subprocess.run([sys.executable, "-S", "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                        "import runpy; runpy.run_path(sys.argv[2], run_name='__main__')",
                        str(tmp_path), script], capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.strip().startswith("env_check: "), r.stderr
    assert "not installed" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_locked_packages_must_be_at_their_pinned_versions():
    get = _world(peft=_Dist("0.21.2"), torch=_Dist("2.13.0+cpu"), ruff=_Dist("0.17.5"))
    want = {"peft": "0.21.2", "torch": "2.13.0", "ruff": "0.17.6", "pytest": "9.2.0"}
    assert env_check.unpinned(want, get=get) == [
        "pytest==9.2.0: not installed", "ruff==0.17.6: installed 0.17.5"]
    assert env_check.unpinned({"peft": "0.21.2", "torch": "2.13.0"}, get=get) == []  # +cpu: same release


def test_the_dev_lock_adds_test_tools_to_the_runtime_lock_without_repeating_it():
    runtime = env_check.pins(env_check.LOCKS[:1])
    dev = env_check.pins(env_check.LOCKS[1:])
    assert {"diffusers", "transformers", "peft", "kfp", "mlflow", "minio"} <= set(runtime)
    assert {"pytest", "pytest-xdist", "pytest-timeout", "ruff", "kubernetes-validate"} <= set(dev)
    assert not set(runtime) & set(dev)
    # setup.sh installs exactly these two locks and hashes them into its stamp
    setup = (REPO / "scripts" / "setup.sh").read_text()
    assert "LOCKS=(images/runtime/requirements.lock requirements-dev.lock)" in setup
    assert 'cat pyproject.toml "${LOCKS[@]}" | sha256sum' in setup


def test_this_environment_is_the_locked_one():
    """The .venv the tests run in holds the runtime image's packages at their locked versions."""
    assert env_check.unpinned(env_check.pins()) == []

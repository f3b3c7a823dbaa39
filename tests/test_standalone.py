"""The repository stands on its own: no references to folders outside it, the maths document points at
functions that exist, the images install the package with its data, and the wheel carries the data
and licence files."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.repo_copy import export_repo

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ["chunkgrpo", "components", "pipeline", "images", "docs", "tests", "benchmarks", "scripts", ".ci",
           "README.md", "pyproject.toml"]
# written in two pieces so that this file does not match itself
WORKSPACE_SHARED = re.compile(
    r"(\.\./|/wo" + r"rk/|\b)" + "shared" + r"/(data|docs|papers)\b|" + r"\.\./" + "shared" + r"\b"
)


def _text_files():
    for entry in SCANNED:
        p = ROOT / entry
        files = [p] if p.is_file() else [f for f in p.rglob("*") if f.is_file()]
        for f in files:
            if "__pycache__" in f.parts or f.suffix in {".pyc", ".png", ".safetensors"}:
                continue
            try:
                yield f, f.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue


def test_nothing_refers_to_the_workspace_shared_folder():
    hits = [f"{f.relative_to(ROOT)}:{n}: {line.strip()}"
            for f, text in _text_files() for n, line in enumerate(text.splitlines(), 1)
            if WORKSPACE_SHARED.search(line)]
    assert not hits, "references outside the repository:\n" + "\n".join(hits)


def test_the_scan_would_catch_a_reference():
    for bad in (
        "see ../" + "shared" + "/docs/method.md",
        "data in /wo" + "rk/" + "shared" + "/data",
        "shared" + "/data/hpdv2",
        "_REPO_ROOT.parent / 'x'  # ../" + "shared",
    ):
        assert WORKSPACE_SHARED.search(bad), bad
    assert not WORKSPACE_SHARED.search("components._shared import stage_env; zz-shared-torch.pth")


# ---- docs/method.md ------------------------------------------------------------------------------

METHOD = ROOT / "docs" / "method.md"


def _resolve(dotted: str):
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def test_method_doc_points_at_functions_that_exist():
    names = sorted(set(re.findall(r"`(chunkgrpo(?:\.\w+)+)`", METHOD.read_text())))
    assert len(names) >= 30  # every equation names its implementation
    missing = []
    for name in names:
        try:
            obj = _resolve(name)
        except (ImportError, AttributeError):
            missing.append(name)
            continue
        assert callable(obj), f"{name} is not a function or class"
    assert not missing, f"docs/method.md names functions that do not exist: {missing}"


def test_method_sections_cited_in_code_exist():
    headings = set(re.findall(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", METHOD.read_text(), flags=re.M))
    cited = set()
    for f in [*(ROOT / "chunkgrpo").rglob("*.py"), *(ROOT / "chunkgrpo").rglob("*.yaml")]:
        cited |= {
            (str(f.relative_to(ROOT)), s) for s in re.findall(r"method\.md §(\d+(?:\.\d+)?)", f.read_text())
        }
    assert cited, "the modules cite method.md sections"
    dangling = sorted((f, s) for f, s in cited if s not in headings)
    assert not dangling, f"method.md has no such section: {dangling}"
    for eq in ("Eq. 14", "Eq. 15", "Eq. 16"):
        assert eq in METHOD.read_text()


def test_architecture_links_the_method_doc():
    text = (ROOT / "docs" / "architecture.md").read_text()
    assert "](method.md)" in text


# ---- images and the wheel ------------------------------------------------------------------------


def test_images_install_the_package_with_its_data():
    """Every image that installs chunkgrpo copies the whole package folder (data included) from the
    repository and installs it non-editable; nothing is copied from outside the build context."""
    dockerfiles = sorted((ROOT / "images").glob("*/Dockerfile"))
    installing = [d for d in dockerfiles if re.search(r"pip install[^\n]*\s\.(\s|\[|$)", d.read_text(), re.M)]
    assert installing, "no image installs chunkgrpo"
    for d in installing:
        text = d.read_text()
        assert re.search(r"^COPY chunkgrpo \./chunkgrpo\s*$", text, re.M), (
            f"{d}: must COPY the whole chunkgrpo/"
        )
        for src in re.findall(r"^COPY (?!--from)(.+) \S+$", text, re.M):
            assert ".." not in src and "shared" not in src, f"{d}: COPY {src}"


@pytest.mark.integration
def test_wheel_contains_the_data_and_licences(tmp_path):
    src = export_repo(tmp_path)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("chunkgrpo-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in ("chunkgrpo/data/README.md", "chunkgrpo/data/hpdv2/hpdv2_test_prompts_400.txt",
              "chunkgrpo/data/hpdv2/LICENSE", "chunkgrpo/data/geneval/evaluation_metadata.jsonl",
              "chunkgrpo/data/geneval/object_names.txt", "chunkgrpo/data/geneval/LICENSE",
              "chunkgrpo/presets/tiny_cpu.yaml"):
        assert f in names, f"{f} missing from {wheel.name}"
    with zipfile.ZipFile(wheel) as z:
        assert len(z.read("chunkgrpo/data/hpdv2/hpdv2_test_prompts_400.txt").decode().splitlines()) == 400
        assert b"MIT License" in z.read("chunkgrpo/data/geneval/LICENSE")
        assert b"Apache License" in z.read("chunkgrpo/data/hpdv2/LICENSE")


def test_ci_runs_the_readme_test_command_and_the_exactness_tests_per_capability():
    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index("**Set up and run the tests**"):]
    command = re.search(r"```bash\n(.+?)\n```", block, re.S).group(1).strip()
    ci = (ROOT / ".ci" / "run").read_text()
    assert command in ci.splitlines()
    for cap in ("default", "avx2", "avx512"):
        assert cap in ci
    assert "ATEN_CPU_CAPABILITY=$cap .venv/bin/python -m pytest -q -rs -m exactness" in ci
    marked = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "exactness", "tests"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert marked.returncode == 0, marked.stdout[-2000:]
    collected = [ln for ln in marked.stdout.splitlines() if "::" in ln]
    # the known kernel-sensitive tests are marked
    for needle in ("test_hybrid.py::test_same_seed_same_noise_and_batch_invariance",
                   "test_train_torchrun.py::test_sigkill_mid_training_then_resume_matches_uninterrupted",
                   "test_policy_window.py::test_window_strategies_give_equal_gradients"):
        assert any(needle in ln for ln in collected), needle

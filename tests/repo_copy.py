"""A copy of the repository as a user's clone has it, and a virtual environment for it that reuses this
environment's third-party packages (so a test need not download and install torch again)."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def export_repo(dest: Path) -> Path:
    """`git archive` of the repository (HEAD plus uncommitted changes to tracked files) into `dest/repo`;
    nothing else beside it. Skips when this is not a git checkout."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: cannot export the repository")
    rev = (
        subprocess.run(["git", "stash", "create"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        or "HEAD"
    )
    tar = subprocess.run(
        ["git", "archive", "--format=tar", rev], cwd=ROOT, capture_output=True, check=True
    ).stdout
    out = dest / "repo"
    out.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(out)], input=tar, check=True)
    return out


def _head(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(2)


def overlay_venv(clone: Path) -> Path:
    """`clone/.venv` as `scripts/setup.sh` leaves it, built cheaply: a fresh venv that sees this
    environment's site-packages (torch, diffusers, kfp, ...) and has the CLONE's chunkgrpo installed into
    its own site-packages (a regular install: the package and its data files are copied). The setup
    stamp is written, so `bash scripts/setup.sh` in the clone finds the environment complete."""
    venv = clone / ".venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    # appended after the clone venv's own site-packages: its chunkgrpo wins; this env's .pth files (our own
    # editable chunkgrpo) are not processed
    (site / "zz-host-packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # native executables that pip wheels put next to the interpreter (SeaweedFS `weed`, ...); Python console
    # scripts are not linked, they would run this environment's interpreter
    for exe in Path(sys.executable).parent.iterdir():
        target = venv / "bin" / exe.name
        if exe.is_file() and not target.exists() and _head(exe) != b"#!":
            target.symlink_to(exe.resolve())
    r = subprocess.run(
        [
            str(py),
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--ignore-installed",
            "--disable-pip-version-check",
            str(clone),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    stamped = [clone / "pyproject.toml", clone / "images" / "runtime" / "requirements.lock",
               clone / "requirements-dev.lock"]  # what scripts/setup.sh's stamp hashes, in its order
    (venv / ".chunkgrpo-setup").write_text(
        hashlib.sha256(b"".join(p.read_bytes() for p in stamped)).hexdigest()[:16] + "\n"
    )
    return venv

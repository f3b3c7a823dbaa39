"""The reward-venv lock files (images/eval/*.lock): complete, hashed, consistent with the top-level specs,
and what the built venvs actually contain."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EVAL = REPO / "images" / "eval"
NAMES = ("hpsv2", "imagereward", "hpsv3")
HEAVY = re.compile(r"^(torch|torchvision|triton|nvidia-.*|cuda-.*)$")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_lock(path: Path) -> dict[str, tuple[str, list[str]]]:
    """{name: (version, [sha256, ...])} from a `--generate-hashes` requirements file."""
    out: dict[str, tuple[str, list[str]]] = {}
    current = None
    for line in path.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s\\;]+)", line)
        if m:
            current = _norm(m.group(1))
            out[current] = (m.group(2), [])
        for h in re.findall(r"--hash=sha256:([0-9a-f]{64})", line):
            out[current][1].append(h)
    return out


def parse_spec(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-]+)==(\S+)", line.split("#")[0].strip())
        if m:
            pins[_norm(m.group(1))] = m.group(2)
    return pins


@pytest.mark.parametrize("name", NAMES)
def test_lock_pins_everything_with_hashes_and_honours_the_spec(name):
    lock = parse_lock(EVAL / f"requirements-{name}.lock")
    torch_lock = parse_lock(EVAL / "requirements-torch.lock")
    assert len(lock) > 30 and all(hashes for _, hashes in lock.values())
    for pkg, version in parse_spec(EVAL / f"requirements-{name}.txt").items():
        assert lock[pkg][0] == version, f"{pkg}: spec {version}, lock {lock[pkg][0]}"
    # torch's build comes from the shared torch venv only, installed by version (constraints-torch.txt) from
    # the images' wheel index; its lock holds the rest of torch's and torchvision's dependencies
    assert not [p for p in lock if HEAVY.match(p)]
    assert not [p for p in torch_lock if HEAVY.match(p)]
    assert {"numpy", "pillow", "sympy", "networkx", "jinja2", "filelock", "fsspec"} <= set(torch_lock)
    assert all(hashes for _, hashes in torch_lock.values())


def test_known_drifting_packages_are_pinned():
    """What used to float with only top-level pins (hpsv3: trl/peft/deepspeed/diffusers; imagereward:
    numpy/datasets)."""
    h3, ir = parse_lock(EVAL / "requirements-hpsv3.lock"), parse_lock(EVAL / "requirements-imagereward.lock")
    assert {"trl", "peft", "deepspeed", "diffusers", "datasets", "numpy"} <= set(h3)
    assert {"numpy", "datasets", "diffusers", "timm"} <= set(ir)


@pytest.mark.reward_envs
@pytest.mark.parametrize("name", ("torch",) + NAMES)
def test_built_venv_is_exactly_its_lock(name):
    root = Path(os.environ.get("CHUNKGRPO_REWARD_ENVS") or REPO / ".reward-envs")
    venv = root / f"venv-{name}"
    if not (venv / ".chunkgrpo-stamp").is_file():
        msg = f"reward venv {venv} is not built: run `bash scripts/reward-envs.sh`"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    # the distribution each name resolves to, in sys.path order (the venv's own, then the shared torch venv)
    probe = ("import importlib.metadata as m, json; d = {}\n"
             "for x in m.distributions(): d.setdefault(x.metadata['Name'], x.version)\nprint(json.dumps(d))")
    res = subprocess.run(
        [str(venv / "bin" / "python"), "-c", probe], capture_output=True, text=True, check=True, cwd="/",
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )  # not the repo root nor a PYTHONPATH entry, whose chunkgrpo.egg-info would show up
    import json

    visible = {_norm(k): v for k, v in json.loads(res.stdout).items()}
    locked = {p: v for p, (v, _) in parse_lock(EVAL / f"requirements-{name}.lock").items()}
    shared = {p: v for p, (v, _) in parse_lock(EVAL / "requirements-torch.lock").items()}
    wrong = {p: (v, visible.get(p)) for p, v in locked.items() if visible.get(p) != v}
    # torch and torchvision: by version, any build (2.13.0+cu126 in the images); CUDA packages come along
    for p, v in parse_spec(EVAL / "constraints-torch.txt").items():
        if (visible.get(p) or "").split("+")[0] != v:
            wrong[p] = (v, visible.get(p))
    extra = {
        p: v
        for p, v in visible.items()
        if p not in locked and shared.get(p) != v and p not in ("pip", "setuptools") and not HEAVY.match(p)
    }
    assert not wrong and not extra, f"venv-{name}: (locked, found) {wrong}; not in the locks {extra}"

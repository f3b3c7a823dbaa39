"""The images' main-environment locks (images/<image>/requirements.lock) and their one install script
(scripts/image-env.sh), which every Dockerfile runs: complete for what the image's code imports, hashed,
torch left to the script, and the same files in the Dockerfile and on a plain machine."""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

import pytest

from tests.images.test_eval_locks import HEAVY, _norm, parse_lock

REPO = Path(__file__).resolve().parents[2]
IMAGES = REPO / "images"


def _extra(name: str, seen=None) -> set[str]:
    """The requirement names of chunkgrpo[name], self-references followed."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    seen = set() if seen is None else seen
    out = set()
    for req in project["optional-dependencies"][name]:
        m = re.match(r"chunkgrpo\[([a-z,]+)\]", req)
        if m:
            for sub in m.group(1).split(","):
                if sub not in seen:
                    seen.add(sub)
                    out |= _extra(sub, seen)
        else:
            out.add(_norm(re.split(r"[<>=!~\[;\s]", req, maxsplit=1)[0]))
    return out


def _base() -> set[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return {_norm(re.split(r"[<>=!~\[;\s]", r, maxsplit=1)[0]) for r in project["dependencies"]}


@pytest.mark.parametrize("image, extras", [("runtime", ("all",)), ("eval", ("train", "store"))])
def test_torch_images_lock_every_dependency_of_their_extras(image, extras):
    """Every requirement of the image's extras (peft, pyarrow, diffusers, transformers among them) is pinned
    with hashes; torch and its CUDA packages are not (the script installs torch by version)."""
    lock = parse_lock(IMAGES / image / "requirements.lock")
    want = _base().union(*(_extra(e) for e in extras)) - {"torch"}
    assert want - set(lock) == set(), f"{image}: not locked: {sorted(want - set(lock))}"
    assert {"peft", "pyarrow", "diffusers", "transformers"} <= set(lock)
    assert all(len(hashes) >= 1 for _, hashes in lock.values()), image
    assert not [n for n in lock if HEAVY.match(n)], f"{image}: torch/CUDA packages belong to the script"


def test_runtime_and_eval_share_the_versions_of_the_model_stack():
    """A LoRA trained in the runtime image is loaded by the eval image: the same diffusers, transformers,
    peft and safetensors on both sides."""
    runtime, ev = (parse_lock(IMAGES / i / "requirements.lock") for i in ("runtime", "eval"))
    for name in ("diffusers", "transformers", "peft", "safetensors", "accelerate", "pyarrow", "mlflow"):
        assert runtime[name][0] == ev[name][0], name


def test_launcher_lock_pins_its_requirements():
    lock = parse_lock(IMAGES / "launcher" / "requirements.lock")
    spec = {}
    for line in (IMAGES / "launcher" / "requirements.txt").read_text().splitlines():
        if m := re.match(r"^([A-Za-z0-9_.\-]+)==(\S+)", line.split("#")[0].strip()):
            spec[_norm(m.group(1))] = m.group(2)
    assert {n: lock[n][0] for n in spec if n in lock} == spec
    assert not [n for n in lock if HEAVY.match(n)]


@pytest.mark.parametrize("image", ["runtime", "eval", "launcher"])
def test_each_dockerfile_installs_its_env_with_the_script(image):
    """The Dockerfile runs scripts/image-env.sh on its own lock (copied into the build); torch images build
    the reward venvs with scripts/reward-envs.sh and export CHUNKGRPO_VENV_* for the scorer workers."""
    text = (IMAGES / image / "Dockerfile").read_text()
    assert re.search(rf"bash /build/scripts/image-env\.sh {image} /opt/venv", text), image
    assert f"COPY images/{image}/requirements.lock /build/images/{image}/" in text
    ignore = (IMAGES / image / "Dockerfile.dockerignore").read_text()
    assert "!scripts/image-env.sh" in ignore
    if image in ("runtime", "eval"):
        assert "bash /build/scripts/reward-envs.sh" in text and "!scripts/reward-envs.sh" in ignore
        for var, venv in (("HPSV2", "hpsv2"), ("IMAGEREWARD", "imagereward"), ("HPSV3", "hpsv3")):
            assert re.search(rf"CHUNKGRPO_VENV_{var}=/opt/venv-{venv}\b", text), (image, var)
    if image == "runtime":
        assert 'TORCH_INDEX_URL="${TORCH_INDEX_URL}"' in text


def test_script_pins_the_torch_the_runtime_lock_was_resolved_with():
    script = (REPO / "scripts" / "image-env.sh").read_text()
    locker = (REPO / "scripts" / "lock-image-envs.sh").read_text()
    (pinned,) = re.findall(r"^TORCH_VERSION=(\S+)", script, re.M)
    (resolved,) = re.findall(r"^RUNTIME_TORCH=(\S+)", locker, re.M)
    assert pinned == resolved == "2.13.0"


@pytest.mark.parametrize("args, message", [
    (["nope"], "image-env: unknown image 'nope' (choose from: runtime eval launcher all)"),
    ([], "image-env: unknown image '' (choose from: runtime eval launcher all)"),
])
def test_bad_image_fails_in_one_line(args, message):
    r = subprocess.run(["bash", str(REPO / "scripts" / "image-env.sh"), *args], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 2 and r.stderr.strip() == message and r.stdout == ""


def test_missing_lock_fails_in_one_line(tmp_path):
    r = subprocess.run(["bash", str(REPO / "scripts" / "image-env.sh"), "launcher", str(tmp_path / "env")],
                       capture_output=True, text=True, timeout=30,
                       env={"PATH": "/usr/bin:/bin", "CHUNKGRPO_IMAGE_LOCKS": str(tmp_path)})
    assert r.returncode == 2
    assert r.stderr.strip() == f"image-env: no lock file {tmp_path}/launcher/requirements.lock"
    assert not (tmp_path / "env").exists()

"""Offline checks of images/: every image has a Dockerfile, hadolint is clean (and catches a bad one), the
Dockerfiles follow the project's conventions, the prod overlays carry only recorded digests, and the
runtime image's CUDA default matches the GPU checks. No Docker, no network."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.manifests.render import HADOLINT, IMAGES, REPO, all_pods, need_tool, render

# --------------------------------------------------------------------------- Dockerfiles

DOCKERFILES = sorted(IMAGES.glob("*/Dockerfile"))


def test_every_image_has_a_dockerfile():
    assert {p.parent.name for p in DOCKERFILES} >= {"runtime", "eval", "launcher"}


def _hadolint(path: Path) -> subprocess.CompletedProcess:
    cmd = [str(need_tool(HADOLINT)), "--no-color"]
    config = IMAGES / ".hadolint.yaml"
    if config.exists():
        cmd += ["--config", str(config)]
    return subprocess.run(cmd + [str(path)], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_hadolint_clean(dockerfile):
    out = _hadolint(dockerfile)
    assert out.returncode == 0, out.stdout + out.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text(
        "FROM ubuntu:latest\nRUN apt-get update && apt-get install -y curl\nRUN pip install requests\n"
    )
    out = _hadolint(bad)
    assert out.returncode != 0
    assert "DL3007" in out.stdout and "DL3008" in out.stdout


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_dockerfile_conventions(dockerfile):
    text = dockerfile.read_text()
    froms = re.findall(r"^FROM\s+(\S+)", text, re.M)
    assert froms
    args = dict(re.findall(r"^ARG\s+([A-Z_]+)=(\S+)", text, re.M))
    for ref in froms:
        ref = re.sub(r"\$\{?([A-Z_]+)\}?", lambda m: args.get(m.group(1), m.group(0)), ref)
        if ref in re.findall(r"\bAS\s+(\S+)", text, re.I):
            continue  # a previous stage
        name = ref.split("@", 1)[0]
        tag = name.rsplit(":", 1)[1] if ":" in name.rsplit("/", 1)[-1] else None
        assert tag and tag != "latest", f"{dockerfile}: base image {ref} has no release tag"
        if str(dockerfile.relative_to(REPO)) in _locked_dockerfiles():  # digests only from the resolver
            from scripts import digests

            assert not digests.unrecorded_digests({ref: ref}, digests.load_lock()), ref
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users and users[-1].split(":")[0] not in {"root", "0"}, "final stage must run as non-root"
    assert re.search(r"^ARG\s+CHUNKGRPO_VERSION=", text, re.M), "package version build arg"
    assert not re.search(r"(AWS_SECRET_ACCESS_KEY|PASSWORD|TOKEN)\s*=", text), "no secrets in images"


# --------------------------------------------------------------------------- digests


def _locked_dockerfiles() -> set[str]:
    from scripts import digests

    return {d["path"] for i in digests.load_lock()["images"] for d in i.get("dockerfiles") or []}


def test_prod_overlays_carry_no_unrecorded_digest():
    """The repo's own prod overlays pass honestly: every digest in them was written by the resolver
    (today there is none: images are referenced by tag until `digests resolve` has run)."""
    from scripts import digests

    assert digests.check(REPO) == []
    unresolved = digests.unresolved(digests.load_lock())
    assert digests.check(REPO, strict=True) == [
        f"{ref}: not resolved to a digest (run `python scripts/digests.py resolve`)" for ref in unresolved]
    lock_names = {i["name"] for i in digests.load_lock()["images"]}
    for variant in ("prod-h800", "prod-h100"):
        for _, t in all_pods(render(variant)):
            for c in t["spec"]["containers"] + t["spec"].get("initContainers", []):
                assert c["image"].split("@")[0].rsplit(":", 1)[0] in lock_names, c["image"]


def test_runtime_image_defaults_to_cuda12_and_cuda13_is_a_consistent_build_option():
    """The default runtime build uses a CUDA 12 base and the matching torch wheel index (the widest driver
    support, the minimum `chunkgrpo.gpu` names); the CUDA 13 build-arg set names only ARGs the Dockerfile
    has, a CUDA 13 base in the image lock (so the resolver pins it) and its matching wheel index."""
    from chunkgrpo import gpu
    from scripts import digests

    text = (IMAGES / "runtime" / "Dockerfile").read_text()
    lock = [{"name": i["name"], "tag": i["tag"]} for i in digests.load_lock()["images"]]
    default = dict(re.findall(r"^ARG (CUDA_IMAGE|TORCH_INDEX_URL)=(\S+)", text, re.M))
    option = dict(
        line.split("=", 1)
        for line in (IMAGES / "runtime" / "cuda13.build-args").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert set(option) == set(default) == {"CUDA_IMAGE", "TORCH_INDEX_URL"}
    for args, major in ((default, "12"), (option, "13")):
        name, tag = args["CUDA_IMAGE"].split("@")[0].split(":")
        assert tag.startswith(major + ".") and {"name": name, "tag": tag} in lock, args
        cu = "cu" + "".join(tag.split(".")[:2])
        assert args["TORCH_INDEX_URL"].endswith("/" + cu)
    assert gpu.DEFAULT_IMAGE_CUDA == ".".join(default["CUDA_IMAGE"].split(":")[1].split(".")[:2])

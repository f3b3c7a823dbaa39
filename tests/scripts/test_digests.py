"""scripts/digests.py (the release tool that resolves, records and checks image digests) on a copy of
manifests/ and images/: placeholders fail the check, the resolver (with a stand-in `docker`) writes the
lock, the pinned-images component and the Dockerfile ARGs, and then the strict check passes."""

from __future__ import annotations

import shutil
from pathlib import Path

from scripts import digests

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "manifests"
IMAGES = REPO / "images"


def _manifests_copy(tmp_path) -> Path:
    root = tmp_path / "repo"
    shutil.copytree(MANIFESTS, root / "manifests")
    shutil.copytree(IMAGES, root / "images")
    return root


def test_a_placeholder_digest_in_a_prod_overlay_fails_the_check(tmp_path):
    root = _manifests_copy(tmp_path)
    comp = root / "manifests" / "components" / "pinned-images" / "kustomization.yaml"
    comp.write_text(
        comp.read_text().replace(
            "images: []",
            "images:\n- name: ghcr.io/mlflow/mlflow\n  newTag: v3.17.2-full\n"
            "  digest: sha256:5772fa203d85ce2176105f755d84c44b57526104560741bd62097126618df20c\n",
        )
    )
    problems = digests.check(root)
    assert problems and all("was not written by `digests resolve`" in p for p in problems)
    assert any(p.startswith("overlays/prod-h100") for p in problems)


def test_resolver_writes_lock_component_and_dockerfiles_then_check_passes(tmp_path, monkeypatch):
    """`digests resolve` with a stand-in `docker` (no Docker engine here): every image gets a digest with
    provenance, the prod overlays pin exactly those, Dockerfile ARGs too, and the strict check passes."""
    import datetime as dt
    import hashlib

    root = _manifests_copy(tmp_path)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "docker"
    fake.write_text("#!/usr/bin/env python3\nimport hashlib, json, sys\n"
                    "assert sys.argv[1:4] == ['buildx', 'imagetools', 'inspect'], sys.argv\n"
                    "print(json.dumps('sha256:' + hashlib.sha256(sys.argv[4].encode()).hexdigest()))\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{__import__('os').environ['PATH']}")
    lock = digests.resolve(root / "manifests" / "images.lock.yaml", repo=root,
                           pinned=root / "manifests" / "components" / "pinned-images" / "kustomization.yaml",
                           now=dt.datetime(2026, 1, 2, tzinfo=dt.timezone.utc))
    want = {
        f"{i['name']}:{i['tag']}": "sha256:" + hashlib.sha256(f"{i['name']}:{i['tag']}".encode()).hexdigest()
        for i in lock["images"]
    }
    reread = digests.load_lock(root / "manifests" / "images.lock.yaml")
    for img in reread["images"]:
        ref = f"{img['name']}:{img['tag']}"
        assert (
            img["digest"] == want[ref] and "imagetools inspect" in img["resolved_by"] and img["resolved_at"]
        )
    rendered = digests._render(root / "manifests" / "overlays" / "prod-h100")
    assert f"ghcr.io/mlflow/mlflow:v3.17.2-full@{want['ghcr.io/mlflow/mlflow:v3.17.2-full']}" in rendered
    assert (
        f"python:3.11-slim-bookworm@{want['python:3.11-slim-bookworm']}"
        in (root / "images/launcher/Dockerfile").read_text()
    )
    assert digests.check(root, strict=True) == []
    # a digest edited by hand afterwards is caught again
    comp = root / "manifests" / "components" / "pinned-images" / "kustomization.yaml"
    comp.write_text(
        comp.read_text().replace(want["ghcr.io/mlflow/mlflow:v3.17.2-full"], "sha256:" + "0" * 64)
    )
    assert any("not written by" in p for p in digests.check(root))


def _fake_docker(tmp_path, monkeypatch) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "docker"
    fake.write_text("#!/usr/bin/env python3\nimport hashlib, json, sys\n"
                    "print(json.dumps('sha256:' + hashlib.sha256(sys.argv[4].encode()).hexdigest()))\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{__import__('os').environ['PATH']}")


def _cu13_args(root: Path) -> list[str]:
    lines = (root / "images/runtime/cuda13.build-args").read_text().splitlines()
    return [x for line in lines if line and not line.startswith("#") for x in ("--build-arg", line)]


def test_building_from_an_unresolved_base_image_fails(capsys):
    """Today nothing is resolved: the build gate of every image fails, naming each base image and the
    resolver; the eval image's bases are in the lock (none built from a digest nobody recorded)."""
    for image, bases in {"runtime": ["ghcr.io/astral-sh/uv:0.9.5", "nvidia/cuda:12.6.3-base-ubuntu24.04"],
                         "eval": ["ghcr.io/astral-sh/uv:0.9.5", "nvidia/cuda:12.1.1-cudnn8-devel-ubuntu22.04",
                                  "nvidia/cuda:12.6.3-base-ubuntu24.04"],
                         "launcher": ["python:3.11-slim-bookworm"]}.items():
        dockerfile = IMAGES / image / "Dockerfile"
        problems = digests.check_build(dockerfile)
        assert len(problems) == len(bases), problems
        for base, p in zip(bases, problems):
            assert f"base image {base}: {base} is not resolved to a digest" in p and "digests.py resolve" in p
    assert digests.main(["check", "--build", str(IMAGES / "launcher" / "Dockerfile")]) == 1
    assert "not resolved to a digest" in capsys.readouterr().out


def test_the_build_gate_passes_at_the_recorded_digests_and_fails_on_any_other(tmp_path, monkeypatch, capsys):
    """After `digests resolve` every image builds (the CUDA 13 build-arg set too, which the resolver pins);
    a base by tag alone, at another digest, or outside the lock fails."""
    root = _manifests_copy(tmp_path)
    _fake_docker(tmp_path, monkeypatch)
    lock_path = root / "manifests" / "images.lock.yaml"
    lock = digests.resolve(lock_path, repo=root,
                           pinned=root / "manifests" / "components" / "pinned-images" / "kustomization.yaml")
    for image in ("runtime", "eval", "launcher"):
        assert digests.check_build(root / "images" / image / "Dockerfile", lock_path=lock_path) == [], image
    runtime = root / "images" / "runtime" / "Dockerfile"
    monkeypatch.setattr(digests, "LOCK", lock_path)
    for image in ("runtime", "eval"):  # the CUDA 13 build-arg set builds both torch images
        dockerfile = root / "images" / image / "Dockerfile"
        assert digests.main(["check", "--build", str(dockerfile), *_cu13_args(root)]) == 0, image
        assert "every base image at its recorded digest" in capsys.readouterr().out

    cuda13 = next(i for i in lock["images"] if i["tag"] == "13.0.1-base-ubuntu24.04")
    by_tag = {"CUDA_IMAGE": "nvidia/cuda:13.0.1-base-ubuntu24.04"}
    (p,) = digests.check_build(runtime, by_tag, lock_path=lock_path)
    assert f"built by tag, not at the recorded digest {cuda13['digest'][:19]}" in p
    other = {"CUDA_IMAGE": "nvidia/cuda:13.0.1-base-ubuntu24.04@sha256:" + "1" * 64}
    (p,) = digests.check_build(runtime, other, lock_path=lock_path)
    assert "digest sha256:111111111111... differs from the recorded" in p
    unlisted = {"CUDA_IMAGE": "nvidia/cuda:12.8.0-base-ubuntu24.04"}
    (p,) = digests.check_build(runtime, unlisted, lock_path=lock_path)
    assert "is not in images.lock.yaml" in p
    assert digests.main(["check", "--build", str(runtime), "--build-arg", "CUDA_IMAGE"]) == 2


def test_base_images_follow_args_stages_and_mounts():
    text = ("ARG A=reg/a:1\nARG B=reg/b:2@sha256:" + "2" * 64 + "\nFROM ${A} AS first\n"
            "RUN --mount=from=first,source=/x,target=/y true\nFROM $B\nCOPY --from=first /x /x\n"
            "COPY --from=reg/c:3 /z /z\n")
    assert digests.base_images(text) == ["reg/a:1", "reg/b:2@sha256:" + "2" * 64, "reg/c:3"]
    assert digests.base_images(text, {"A": "reg/a:9"})[0] == "reg/a:9"

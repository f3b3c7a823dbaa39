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

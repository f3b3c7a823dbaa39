"""sync_models under kfp.local: a model from the (offline) hub cache lands in the local S3."""

import shutil
import uuid

import pytest

from components.models.component import sync_models

pytestmark = pytest.mark.integration


def test_sync_from_hub_cache_locally(local_runner, tiny_model_dir, tmp_path, monkeypatch):
    from chunkgrpo.store.client import ArtifactStore

    hub = tmp_path / "hf" / "hub" / "models--acme--tiny"
    shutil.copytree(tiny_model_dir, hub / "snapshots" / ("1" * 40))
    (hub / "refs").mkdir()
    (hub / "refs" / "main").write_text("1" * 40)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # read by the task's own process
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    root = ArtifactStore().uri(f"comp-models-{uuid.uuid4().hex[:6]}")
    out = sync_models(hub_ids=["acme/tiny"], root=root, revision="").output
    assert out == [f"{root}/acme/tiny"]
    assert ArtifactStore().read_manifest(out[0]) is not None

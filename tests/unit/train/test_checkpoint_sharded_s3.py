"""Sharded checkpoints in the real local S3 (SeaweedFS): complete only once every rank's part and then the
manifest are there, and retention to `checkpoint.keep` that deletes whole checkpoints, never the newest
nor one being read."""

from __future__ import annotations

import json
import threading
import time

import pytest

from chunkgrpo.store import StoreError
from chunkgrpo.train import checkpoint_format as ckpt
from chunkgrpo.train import checkpoint_sharded as sharded

pytestmark = pytest.mark.integration


def _folder(root, step):
    """A sharded checkpoint folder of two ranks with its manifest; returns it and each rank's entries."""
    d = ckpt.step_dir(root, step)
    (d / "dcp").mkdir(parents=True)
    (d / "rng").mkdir()
    for r in (0, 1):
        (d / "dcp" / f"__{r}_0.distcp").write_bytes(bytes([r, step]) * 5000)
        (d / "rng" / f"rank{r}.pt").write_bytes(b"rng%d" % r)
    (d / sharded.METADATA).write_bytes(b"metadata")
    (d / "scheduler.pt").write_bytes(b"s")
    (d / "trainer_state.json").write_text("{}")
    ckpt.write_manifest(d, {"step": step})
    parts = [sharded.hash_files(d, sharded.own_files(d, r)) for r in (0, 1)]
    return d, parts


@pytest.fixture
def store(services_env):
    from chunkgrpo.store.client import ArtifactStore

    return ArtifactStore()


def test_complete_in_s3_only_after_every_rank_part(store, services_env, tmp_path):
    base = f"s3://{services_env.store_config.bucket}/runs/parts-{time.time_ns()}"
    d, parts = _folder(tmp_path, 3)
    assert set(parts[0]) | set(parts[1]) == set(json.loads((d / "MANIFEST.json").read_text())["files"])
    uri = f"{base}/{d.name}"
    errors = []

    def rank0():
        try:
            sharded.upload_part(d, uri, store, parts[0], 0, 2, (d / "MANIFEST.json").read_bytes(), wait_s=60,
                                poll_s=0.1)
        except Exception as e:  # pragma: no cover - reported by the assert below
            errors.append(e)

    th = threading.Thread(target=rank0)
    th.start()
    deadline = time.time() + 60
    while not store.exists(f"{uri}/{sharded.PARTS}/rank0.json"):
        assert time.time() < deadline
        time.sleep(0.05)
    time.sleep(0.5)
    assert not store.is_complete(uri)  # rank 0's files are up, rank 1's are not: no manifest
    sharded.upload_part(d, uri, store, parts[1], 1, 2, None, wait_s=0)
    th.join(60)
    assert not errors and store.is_complete(uri)
    got = store.get_folder(uri, tmp_path / "back")  # every file verified against the manifest
    shard = "dcp/__1_0.distcp"
    assert (tmp_path / "back" / shard).read_bytes() == (d / shard).read_bytes()
    assert len(got.files) == 7


def test_a_rank_that_never_uploads_leaves_the_checkpoint_incomplete(store, services_env, tmp_path):
    base = f"s3://{services_env.store_config.bucket}/runs/parts-{time.time_ns()}"
    d, parts = _folder(tmp_path, 3)
    uri = f"{base}/{d.name}"
    with pytest.raises(StoreError, match=r"rank\(s\) \[1\] did not reach S3"):
        sharded.upload_part(d, uri, store, parts[0], 0, 2, (d / "MANIFEST.json").read_bytes(), wait_s=1,
                            poll_s=0.1)
    assert not store.is_complete(uri)
    # a part of an earlier upload of this step with other checksums does not count either
    stale = {rel: {**e, "sha256": "0" * 64} for rel, e in parts[1].items()}
    store.put_bytes(json.dumps(stale).encode(), f"{uri}/{sharded.PARTS}/rank1.json")
    with pytest.raises(StoreError):
        sharded.upload_part(d, uri, store, parts[0], 0, 2, (d / "MANIFEST.json").read_bytes(), wait_s=1,
                            poll_s=0.1)
    assert not store.is_complete(uri)


def test_retention_keeps_the_newest_and_any_being_read(store, services_env, tmp_path):
    prefix = f"s3://{services_env.store_config.bucket}/runs/retain-{time.time_ns()}"
    for step in (1, 2, 3, 4):
        d, _ = _folder(tmp_path / f"l{step}", step)
        ckpt.upload(d, prefix, store)
    marker = sharded.mark_reading(store, f"{prefix}/step-000001", "resume-1", expires_s=600)
    deleted = sharded.prune_remote(store, prefix, keep=2)
    assert [u.rsplit("/", 1)[-1] for u in deleted] == ["step-000002"]
    assert not store.list(f"{prefix}/step-000002/")  # whole: every shard, not only the manifest
    assert sorted(ckpt.remote_checkpoints(prefix, store)) == [1, 3, 4]
    # the reader is done (or its marker lapsed): the old checkpoint goes at the next pass
    store.put_bytes(json.dumps({"time": time.time() - 700, "expires_s": 600}).encode(), marker)
    sharded.prune_remote(store, prefix, keep=2)
    assert sorted(ckpt.remote_checkpoints(prefix, store)) == [3, 4]
    # keep=1 never deletes the newest; keep=0 keeps all
    assert sharded.prune_remote(store, prefix, keep=0) == []
    sharded.prune_remote(store, prefix, keep=1)
    assert sorted(ckpt.remote_checkpoints(prefix, store)) == [4]

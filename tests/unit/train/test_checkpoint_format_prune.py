"""Local checkpoints once S3 has them: only the newest stays on the node's disk (train/checkpoint_format.py
`prune`), with the real background `Mirror` (its store replaced by an in-memory one)."""

import threading

import pytest

from chunkgrpo.train import checkpoint_format as ckpt


def _write(root, step):
    d = ckpt.step_dir(root, step)
    d.mkdir(parents=True)
    (d / "trainable.safetensors").write_bytes(b"w" * 100)
    ckpt.write_manifest(d, {})
    return d


class Store:
    """put_folder into a dict; `gate` holds uploads back until set (an upload in flight)."""

    def __init__(self):
        self.objects, self.gate = {}, threading.Event()
        self.gate.set()

    def put_folder(self, path, uri, meta=None):
        assert self.gate.wait(30)
        self.objects[uri] = sorted(p.name for p in path.iterdir())


@pytest.fixture
def store():
    return Store()


def test_mirrored_checkpoints_beyond_the_newest_are_removed(tmp_path, store):
    root = tmp_path / "checkpoints"
    m = ckpt.Mirror("s3://b/ckpt", store_factory=lambda: store)
    try:
        for step in (1, 2, 3):  # as the trainer does: finalize (prunes), then submit the new one
            ckpt.finalize(ckpt.stage_dir(root, step), root, step, {}, keep=3, mirror=m)
            m.submit(ckpt.step_dir(root, step))
            assert m.wait(30)
        # keep=3 alone would keep all three; S3 has 1 and 2, so only the newest stays locally
        assert [p.name for p in ckpt.complete_checkpoints(root)] == ["step-000003"]
        assert set(store.objects) == {f"s3://b/ckpt/step-00000{s}" for s in (1, 2, 3)}
    finally:
        m.close()


def test_a_checkpoint_still_uploading_is_kept(tmp_path, store):
    root = tmp_path / "checkpoints"
    m = ckpt.Mirror("s3://b/ckpt", store_factory=lambda: store)
    try:
        _write(root, 1)
        m.submit(ckpt.step_dir(root, 1))
        assert m.wait(30)
        store.gate.clear()  # step 2's upload hangs
        _write(root, 2)
        m.submit(ckpt.step_dir(root, 2))
        _write(root, 3)
        removed = ckpt.prune(root, keep=3, mirror=m)
        assert [p.name for p in removed] == ["step-000001"]  # in S3 and not the newest
        assert [p.name for p in ckpt.complete_checkpoints(root)] == ["step-000002", "step-000003"]
        store.gate.set()
        assert m.wait(30)
        assert [p.name for p in ckpt.prune(root, keep=3, mirror=m)] == ["step-000002"]
    finally:
        store.gate.set()
        m.close()


def test_without_a_mirror_keep_alone_bounds_the_local_copies(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3, 4):
        _write(root, step)
    assert [p.name for p in ckpt.prune(root, keep=2)] == ["step-000001", "step-000002"]
    assert [p.name for p in ckpt.complete_checkpoints(root)] == ["step-000003", "step-000004"]


def test_held_checkpoints_wait_for_release_and_are_never_pruned_meanwhile(tmp_path, store):
    """The last checkpoint waits while the final model goes up first (`Checkpointer.final_first`)."""
    root = tmp_path / "checkpoints"
    m = ckpt.Mirror("s3://b/ckpt", store_factory=lambda: store)
    try:
        _write(root, 1)
        m.submit(ckpt.step_dir(root, 1))
        assert m.wait(30)
        m.hold()
        _write(root, 2)
        m.submit(ckpt.step_dir(root, 2))
        assert not m.wait(0.5)  # held: not uploaded
        assert "s3://b/ckpt/step-000002" not in store.objects and m.is_pending(ckpt.step_dir(root, 2))
        assert m.pending_bytes() == 100  # its files (the manifest is small and sized apart)
        assert ckpt.prune(root, keep=1, mirror=m) == [ckpt.step_dir(root, 1)]  # step 2 stays, not in S3
        m.release()
        assert m.wait(30) and "s3://b/ckpt/step-000002" in store.objects
    finally:
        m.close()

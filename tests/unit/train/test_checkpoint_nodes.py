"""Sharded checkpoints across nodes with their own disks: two processes, each a "node" (torchrun's
LOCAL_WORLD_SIZE=1 of WORLD_SIZE=2, local rank 0) with its own output folder, driving the real
`Checkpointer` with the real local S3. Each node's folder holds only its rank's shards; the checkpoint is
complete in S3 only with every node's part; it resumes on 2 nodes and on 1, continuing exactly as an
uninterrupted run. The part's own rules (layout, retention, completing a part) are checked without servers."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from chunkgrpo.train import checkpoint_format as ckpt
from chunkgrpo.train import checkpoint_nodes as nodes
from tests.ranks import run_ranks
from tests.unit.train.test_checkpoint_sharded import Toy, _run, _same


def _worker(rank: int, world: int, port: int, outs: list[str], steps: int, result: str,
            checkpoint: dict, envs: list[dict], resume: bool) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                      LOCAL_WORLD_SIZE="1", **envs[rank])
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        t = Toy(Path(outs[rank]), rank, world, False, checkpoint, local_rank=0)
        if resume:
            t.checkpoints.resume()
        resumed_at, at_resume = t.opt_step, t.full_state()
        states = t.train_to(steps)
        final = t.full_state()
        error = ""
        try:
            t.checkpoints.finish()
        except Exception as e:
            error = str(e)
        t.checkpoints.close()
        torch.save({"resumed_at": resumed_at, "at_resume": at_resume, "final": final, "states": states,
                    "history": t.history, "layout": t.checkpoints.layout, "error": error},
                   f"{result}.rank{rank}")
    finally:
        if world > 1:
            dist.destroy_process_group()


def _nodes(outs: list[Path], steps: int, tag: str, checkpoint: dict, envs: list[dict] | None = None,
           resume: bool = True) -> list[dict]:
    """One process per node, node r writing into outs[r]; every rank's result."""
    from chunkgrpo.processes import free_port

    world = len(outs)
    result = outs[0].parent / tag
    run_ranks(_worker, (world, free_port(), [str(o) for o in outs], steps, str(result), checkpoint,
                        envs or [{}] * world, resume), world)
    return [torch.load(f"{result}.rank{r}", weights_only=True) for r in range(world)]


def _files(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.integration
def test_two_nodes_write_their_own_shards_and_resume_on_two_nodes_and_on_one(services_env, tmp_path):
    from chunkgrpo.store.client import ArtifactStore

    prefix = f"s3://{services_env.store_config.bucket}/runs/nodes/ckpt"
    over = {"s3_prefix": prefix}
    ref = _run(1, tmp_path / "ref", 6, "ref")  # uninterrupted, one process
    outs = [tmp_path / "node0", tmp_path / "node1"]

    a = _nodes(outs, 2, "a", over)
    assert [r["layout"] for r in a] == ["node-sharded"] * 2 and not any(r["error"] for r in a)
    part0, part1 = (ckpt.step_dir(o / "checkpoints", 2) for o in outs)
    # each node's disk holds its own rank's files and the manifest of the whole, never MANIFEST.json
    assert _files(part0) == {"PART.json", "dcp/.metadata", "dcp/__0_0.distcp", "rng/rank0.pt", "scheduler.pt",
                             "trainer_state.json"}
    assert _files(part1) == {"PART.json", "dcp/__1_0.distcp", "rng/rank1.pt"}
    whole = json.loads((part0 / "PART.json").read_text())["files"]
    assert (part1 / "PART.json").read_bytes() == (part0 / "PART.json").read_bytes()
    assert set(whole) == (_files(part0) | _files(part1)) - {"PART.json"}
    assert not ckpt.complete_checkpoints(outs[0] / "checkpoints")
    st = ArtifactStore()
    assert st.read_manifest(prefix + "/step-000002").files == whole  # complete in S3: every node's part

    inode = (part1 / "dcp" / "__1_0.distcp").stat().st_ino
    b = _nodes(outs, 2, "b", over)  # 2 nodes again: each completes its part from S3 (nothing to train)
    assert [r["resumed_at"] for r in b] == [2, 2] and _same(b[0]["at_resume"], ref["states"][2])
    assert ckpt.is_complete(part1) and (part1 / "dcp" / "__1_0.distcp").stat().st_ino == inode  # kept
    ckpt.verify(part1)
    b = _nodes(outs, 4, "b", over)  # and continue from the completed copies
    assert [r["resumed_at"] for r in b] == [2, 2]
    assert _same(b[0]["at_resume"], ref["states"][2])
    assert _same(b[0]["final"], ref["states"][4])
    assert nodes.is_part(ckpt.step_dir(outs[1] / "checkpoints", 4))
    assert not part0.exists() and not part1.exists()  # each node keeps its newest part only (step 2 in S3)

    c = _nodes(outs[:1], 6, "c", over)  # one node: node 0's part of step 4 completed from S3
    assert c[0]["resumed_at"] == 4
    assert _same(c[0]["at_resume"], ref["states"][4])
    assert _same(c[0]["final"], ref["final"])
    assert [h["loss"] for h in c[0]["history"]] == [h["loss"] for h in ref["history"]]

    fresh = _nodes([tmp_path / "fresh0", tmp_path / "fresh1"], 6, "d", over)  # empty disks: all from S3
    assert [r["resumed_at"] for r in fresh] == [6, 6]
    assert _same(fresh[0]["at_resume"], ref["final"])


@pytest.mark.integration
def test_a_checkpoint_missing_one_nodes_part_is_not_complete(services_env, tmp_path):
    from chunkgrpo.processes import free_port
    from chunkgrpo.store.client import ArtifactStore

    prefix = f"s3://{services_env.store_config.bucket}/runs/nodes-part/ckpt"
    over = {"s3_prefix": prefix, "mirror_wait_s": 2, "mirror_timeout_s": 2}
    outs = [tmp_path / "node0", tmp_path / "node1"]
    dead = {"CHUNKGRPO_S3_ENDPOINT": f"http://127.0.0.1:{free_port()}"}  # node 1 cannot reach S3
    a = _nodes(outs, 2, "a", over, envs=[{}, dead], resume=False)
    assert "did not reach" in a[0]["error"] and "did not reach" in a[1]["error"]
    st = ArtifactStore()
    assert st.list_complete(prefix) == [] and st.read_manifest(prefix + "/step-000002") is None
    assert st.exists(prefix + "/step-000002/dcp/__0_0.distcp")  # node 0's part is there, node 1's is not
    assert not st.exists(prefix + "/step-000002/dcp/__1_0.distcp")
    assert nodes.is_part(ckpt.step_dir(outs[1] / "checkpoints", 2))  # kept on node 1's disk
    # node 0's part alone is no checkpoint: a resume on one node starts from scratch
    b = _nodes(outs[:1], 2, "b", {"s3_prefix": prefix})
    assert b[0]["resumed_at"] == 0 and not b[0]["error"]


# ------------------------------------------------------------------------- without servers


def test_the_layout_is_sharded_across_nodes_only_where_s3_joins_the_parts():
    assert nodes.layout(True, False, True)[0] == "node-sharded"
    assert nodes.layout(True, True, False)[0] == nodes.layout(True, True, True)[0] == "sharded"
    kind, why = nodes.layout(True, False, False)
    assert kind == "gathered" and "checkpoint.s3_prefix" in why
    assert nodes.layout(False, False, True)[0] == "gathered"


WHOLE = {"dcp/__0_0.distcp": b"zero" * 100, "dcp/__1_0.distcp": b"one" * 100, "dcp/.metadata": b"m",
         "scheduler.pt": b"s", "trainer_state.json": b"{}", "rng/rank0.pt": b"r0", "rng/rank1.pt": b"r1"}


def _manifest():
    import hashlib

    from chunkgrpo.store.manifest import Manifest

    files = {k: {"sha256": hashlib.sha256(v).hexdigest(), "size": len(v)} for k, v in WHOLE.items()}
    return Manifest(files=files, created="now", meta={})


def _part(root: Path, step: int, files: dict[str, bytes]) -> Path:
    """Node 1's part of step `step` holding `files` (their entries as its rank hashed them)."""
    import hashlib

    staging = ckpt.stage_dir(root, step)
    for rel, data in files.items():
        (staging / rel).parent.mkdir(parents=True, exist_ok=True)
        (staging / rel).write_bytes(data)
    mine = {k: {"sha256": hashlib.sha256(v).hexdigest(), "size": len(v)} for k, v in files.items()}
    return nodes.finalize_part(staging, root, step, _manifest().to_json(), mine)


class _Store:
    """An S3 stand-in holding the complete checkpoint WHOLE: `read_manifest`, `get_file` (which can fail)."""

    def __init__(self, fail: bool = False):
        self.fail, self.fetched = fail, []

    def read_manifest(self, uri):
        return _manifest()

    def get_file(self, key, path, sha256=None, size=None):
        from chunkgrpo.store import StoreError

        if self.fail:
            raise StoreError("connection reset")
        rel = key.split("/step-000002/", 1)[1]
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_bytes(WHOLE[rel])
        self.fetched.append(rel)


def test_a_part_is_completed_from_s3_keeping_the_files_it_holds(tmp_path):
    part = _part(tmp_path, 2, {"dcp/__1_0.distcp": WHOLE["dcp/__1_0.distcp"], "rng/rank1.pt": b"r1"})
    assert nodes.is_part(part) and nodes.parts(tmp_path) == [part] and not ckpt.complete_checkpoints(tmp_path)
    (part / "rng" / "rank1.pt").write_bytes(b"rX")  # changed since: fetched again
    store = _Store()
    assert nodes.fill_part("s3://b/ckpt/step-000002", tmp_path, 2, store) == part
    assert ckpt.is_complete(part) and not (part / nodes.PART).exists()
    assert "dcp/__1_0.distcp" not in store.fetched and "rng/rank1.pt" in store.fetched
    assert sorted(store.fetched) == sorted(set(WHOLE) - {"dcp/__1_0.distcp"})
    ckpt.verify(part)


def test_a_failed_fill_puts_the_part_back(tmp_path):
    from chunkgrpo.store import StoreError

    part = _part(tmp_path, 2, {"dcp/__1_0.distcp": WHOLE["dcp/__1_0.distcp"], "rng/rank1.pt": b"r1"})
    with pytest.raises(StoreError):
        nodes.fill_part("s3://b/ckpt/step-000002", tmp_path, 2, _Store(fail=True))
    assert nodes.is_part(part) and (part / "dcp" / "__1_0.distcp").read_bytes() == WHOLE["dcp/__1_0.distcp"]
    assert not (tmp_path / ".download-step-000002").exists()


def test_a_part_whose_files_disagree_with_its_ranks_entries_is_not_written(tmp_path):
    staging = ckpt.stage_dir(tmp_path, 2)
    (staging / "stray.bin").write_bytes(b"x")
    with pytest.raises(OSError, match="stray.bin"):
        nodes.finalize_part(staging, tmp_path, 2, b"{}", {})
    assert not ckpt.step_dir(tmp_path, 2).exists()


def test_each_node_keeps_its_newest_part_and_those_not_yet_in_s3(tmp_path):
    for step in (2, 4, 6, 8):
        _part(tmp_path, step, {"rng/rank1.pt": b"r1"})
    fetched = ckpt.step_dir(tmp_path, 3)  # a complete copy an earlier resume fetched from S3
    fetched.mkdir()
    ckpt.write_manifest(fetched, {})
    deleted = nodes.prune_parts(tmp_path, keep=2, pending={4}, failing=False, backlog=0)
    assert sorted(ckpt.step_of(p) for p in deleted) == [2, 3, 6] and not fetched.exists()
    assert [ckpt.step_of(p) for p in nodes.parts(tmp_path)] == [4, 8]
    _part(tmp_path, 10, {"rng/rank1.pt": b"r1"})
    with pytest.raises(ckpt.MirrorBacklogError, match="step-000004"):  # S3 failing: stop, delete nothing
        nodes.prune_parts(tmp_path, keep=1, pending={4, 8}, failing=True, backlog=0)
    assert [ckpt.step_of(p) for p in nodes.parts(tmp_path)] == [4, 8, 10]
    assert nodes.prune_parts(tmp_path, keep=0, pending=set(), failing=False, backlog=0) == []

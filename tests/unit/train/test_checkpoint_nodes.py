"""Sharded checkpoints across nodes with their own disks: two processes, each a "node" (torchrun's
LOCAL_WORLD_SIZE=1 of WORLD_SIZE=2, local rank 0) with its own output folder, driving the real
`Checkpointer` with the real local S3. Each node's folder holds only its rank's shards; the checkpoint is
complete in S3 only with every node's part; it resumes on 2 nodes and on 1, continuing exactly as an
uninterrupted run."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from chunkgrpo.train import checkpoint_format as ckpt
from chunkgrpo.train import checkpoint_nodes as nodes
from tests.unit.train.test_checkpoint_sharded import Toy, _run, _same

pytestmark = pytest.mark.integration


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
        states = {}
        while t.opt_step < steps:
            t.step()
            if t.opt_step % 2 == 0:
                t.checkpoints.save()
                states[t.opt_step] = t.full_state()
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
    mp.start_processes(_worker, args=(world, free_port(), [str(o) for o in outs], steps, str(result),
                                      checkpoint, envs or [{}] * world, resume),
                       nprocs=world, join=True, start_method="spawn")
    return [torch.load(f"{result}.rank{r}", weights_only=True) for r in range(world)]


def _files(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


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
    b = _nodes(outs, 4, "b", over)  # 2 nodes again: each completes its part from S3, then resumes
    assert [r["resumed_at"] for r in b] == [2, 2]
    assert _same(b[0]["at_resume"], ref["states"][2])
    assert _same(b[0]["final"], ref["states"][4])
    assert ckpt.is_complete(part1) and (part1 / "dcp" / "__1_0.distcp").stat().st_ino == inode  # kept
    ckpt.verify(part1)
    assert nodes.is_part(ckpt.step_dir(outs[1] / "checkpoints", 4))

    c = _nodes(outs[:1], 6, "c", over)  # one node: node 0's part of step 4 completed from S3
    assert c[0]["resumed_at"] == 4
    assert _same(c[0]["at_resume"], ref["states"][4])
    assert _same(c[0]["final"], ref["final"])
    assert [h["loss"] for h in c[0]["history"]] == [h["loss"] for h in ref["history"]]

    fresh = _nodes([tmp_path / "fresh0", tmp_path / "fresh1"], 6, "d", over)  # empty disks: all from S3
    assert [r["resumed_at"] for r in fresh] == [6, 6]
    assert _same(fresh[0]["at_resume"], ref["final"])


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

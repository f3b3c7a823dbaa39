"""FSDP on two nodes, each with its own disk (two torchrun agents on 127.0.0.1, one rank each, different
output folders): a sharded checkpoint folder needs every rank's files on one filesystem, so on several
nodes the checkpoint is gathered to rank 0 and is complete there; on one node it stays sharded."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.integration.test_train_torchrun import TORCHRUN, _env, prompts_file  # noqa: F401 (fixture)

pytestmark = pytest.mark.integration


def _node(rank: int, model, prompts, out, port: int) -> subprocess.Popen:
    return subprocess.Popen(
        [TORCHRUN, "--nnodes=2", f"--node_rank={rank}", "--nproc_per_node=1", "--master_addr=127.0.0.1",
         f"--master_port={port}", "-m", "chunkgrpo.train", "--config", "tiny_cpu", f"model={model}",
         f"prompts={prompts}", f"output_dir={out}", "progress=false", "distributed=fsdp", "max_steps=2",
         "checkpoint.every=2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())


@pytest.mark.timeout(900)
def test_two_nodes_with_their_own_disks_gather_checkpoints_to_rank_0(tiny_model_dir, prompts_file,  # noqa: F811
                                                                     tmp_path):
    outs = [tmp_path / "node0", tmp_path / "node1"]
    procs = [_node(r, tiny_model_dir, prompts_file, outs[r], 29547) for r in (0, 1)]
    results = []
    try:
        for p in procs:
            results.append(p.communicate(timeout=800))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err[-3000:]
    assert "gathered to rank 0" in results[0][1]
    step = outs[0] / "checkpoints" / "step-000002"
    manifest = json.loads((step / "MANIFEST.json").read_text())
    files = set(manifest["files"])  # {relative path: {sha256, size}}
    assert not any(f.startswith("dcp/") for f in files) and (step / "trainer_state.json").is_file()
    assert all((step / f).is_file() for f in files)  # complete on node 0's own disk
    assert (outs[0] / "final").is_dir()
    assert not (outs[1] / "checkpoints" / "step-000002" / "dcp").exists()

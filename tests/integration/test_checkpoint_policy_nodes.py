"""FSDP on two nodes, each with its own disk (two torchrun agents on 127.0.0.1, one rank each, different
output folders). With `checkpoint.s3_prefix` every rank writes its shards to its own node's folder and
uploads them; the checkpoint is complete in S3 and a resume on 2 nodes continues exactly as an
uninterrupted run. Without S3 there is no place where the nodes' shards meet: the checkpoint is gathered
to rank 0 and complete on node 0's disk."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from tests.integration.test_train_torchrun import (  # noqa: F401 (fixture)
    TORCHRUN,
    _env,
    _final_weights,
    prompts_file,
)

pytestmark = pytest.mark.integration


def _node(rank: int, model, prompts, out, port: int, *over: str) -> subprocess.Popen:
    return subprocess.Popen(
        [TORCHRUN, "--nnodes=2", f"--node_rank={rank}", "--nproc_per_node=1", "--master_addr=127.0.0.1",
         f"--master_port={port}", "-m", "chunkgrpo.train", "--config", "tiny_cpu", f"model={model}",
         f"prompts={prompts}", f"output_dir={out}", "progress=false", "distributed=fsdp",
         "checkpoint.every=2", *over],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())


def _two_nodes(model, prompts, outs, port: int, *over: str) -> list[str]:
    """Both nodes to the end; each node's stderr."""
    procs = [_node(r, model, prompts, outs[r], port, *over) for r in (0, 1)]
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
    return [err for _, err in results]


def _files(folder) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.timeout(900)
def test_two_nodes_without_s3_gather_checkpoints_to_rank_0(tiny_model_dir, prompts_file,  # noqa: F811
                                                           tmp_path):
    outs = [tmp_path / "node0", tmp_path / "node1"]
    errs = _two_nodes(tiny_model_dir, prompts_file, outs, 29547, "max_steps=2")
    assert "checkpoints: gathered to rank 0" in errs[0] and "checkpoint.s3_prefix" in errs[0]
    step = outs[0] / "checkpoints" / "step-000002"
    files = set(json.loads((step / "MANIFEST.json").read_text())["files"])  # {relative path: entry}
    assert not any(f.startswith("dcp/") for f in files) and (step / "trainer_state.json").is_file()
    assert all((step / f).is_file() for f in files)  # complete on node 0's own disk
    assert (outs[0] / "final").is_dir()
    assert not (outs[1] / "checkpoints" / "step-000002").exists()


@pytest.mark.exactness
@pytest.mark.timeout(1800)
def test_two_nodes_with_s3_shard_to_their_own_disks_and_resume_exactly(
        tiny_model_dir, prompts_file, services_env, tmp_path):  # noqa: F811
    from chunkgrpo.store.client import ArtifactStore

    bucket = services_env.store_config.bucket
    ref = [tmp_path / "ref0", tmp_path / "ref1"]
    _two_nodes(tiny_model_dir, prompts_file, ref, 29548, "max_steps=4",
               f"checkpoint.s3_prefix=s3://{bucket}/nodes-ref/ckpt")  # uninterrupted

    prefix = f"s3://{bucket}/nodes-run/ckpt"
    outs = [tmp_path / "node0", tmp_path / "node1"]
    s3 = f"checkpoint.s3_prefix={prefix}"
    errs = _two_nodes(tiny_model_dir, prompts_file, outs, 29549, "max_steps=2", s3)
    assert "checkpoints: sharded across nodes" in errs[0]
    part0, part1 = (o / "checkpoints" / "step-000002" for o in outs)
    assert {"PART.json", "dcp/.metadata", "dcp/__0_0.distcp", "rng/rank0.pt"} <= _files(part0)
    assert _files(part1) == {"PART.json", "dcp/__1_0.distcp", "rng/rank1.pt"}  # node 1: its own shards
    assert not (part0 / "MANIFEST.json").exists() and not (part1 / "MANIFEST.json").exists()
    manifest = ArtifactStore().read_manifest(prefix + "/step-000002")  # complete in S3
    assert manifest is not None and manifest.files == json.loads((part0 / "PART.json").read_text())["files"]

    errs = _two_nodes(tiny_model_dir, prompts_file, outs, 29550, "max_steps=4", s3)
    assert "resumed from" in errs[0] and "step-000002" in errs[0]
    # each node completed its part of step 2 from S3 to resume, and keeps only its newest part (step 4)
    assert not part0.exists() and not part1.exists()
    assert (outs[1] / "checkpoints" / "step-000004" / "PART.json").is_file()
    a, b = _final_weights(ref[0]), _final_weights(outs[0])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    h_ref = json.loads((ref[0] / "train_summary.json").read_text())["history"]
    h_out = json.loads((outs[0] / "train_summary.json").read_text())["history"]
    assert [h["loss"] for h in h_ref] == [h["loss"] for h in h_out]

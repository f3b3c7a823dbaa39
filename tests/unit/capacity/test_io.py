"""Capacity-plan terms of `chunkgrpo.capacity.io`: I/O time per single-rank phase against the timeout it
waits under, NCCL buffers, reward workers' CUDA contexts, FSDP's no-sync gradients, and the default
timeout sized from the FLUX.1-dev full fine-tuning estimate. On the tiny model's architecture (a GPU pool
of 8 ranks per node, 80 GiB each), except the default-timeout check (FLUX.1-dev's published size)."""

from __future__ import annotations

import dataclasses

import pytest

from chunkgrpo.capacity import io
from chunkgrpo.capacity.arch import FLUX_DEV_TRANSFORMER_PARAMS, GiB, ModelArch
from chunkgrpo.capacity.plan import capacity_plan, render_markdown, render_table
from chunkgrpo.capacity.pool import local_pool
from chunkgrpo.train.config import TrainConfig
from chunkgrpo.train.dist import DEFAULT_TIMEOUT_S, IO_BYTES_PER_S

GPU_POOL = dataclasses.replace(local_pool(gpu_memory=80 * GiB), gpus_per_node=8)


@pytest.fixture(scope="module")
def arch(tiny_model_dir):
    return ModelArch.from_folder(tiny_model_dir)


def _plan(arch, overrides=(), **kw):
    cfg = TrainConfig.load("tiny_cpu", ["distributed=fsdp", "lora.enabled=false", *overrides])
    return capacity_plan(cfg, kw.pop("pool", GPU_POOL), arch=arch, **kw)


def _parts(plan, phase):
    return next(i for i in plan.items if i.what == f"{phase} phase").parts


def test_io_phases_are_bytes_over_bandwidth_against_their_timeouts(arch):
    plan = _plan(arch)
    by = {p.phase: p for p in plan.io}
    assert list(by) == ["model fetch", "checkpoint save", "resume download", "export"]
    ckpt = plan.facts["checkpoint_bytes"]
    # FSDP: each of the 8 ranks writes and hashes its share; a node downloads at most the whole
    assert plan.world == 8 and by["checkpoint save"].nbytes == -(-ckpt // 8)
    assert by["resume download"].nbytes == ckpt
    assert by["checkpoint save"].seconds == pytest.approx(2 * -(-ckpt // 8) / IO_BYTES_PER_S)
    assert by["export"].nbytes == 4 * plan.facts["trainable_params"]
    assert (by["model fetch"].wait, by["model fetch"].timeout_field) == ("store", "io_wait_s")
    save = by["checkpoint save"]
    assert (save.wait, save.timeout_field) == ("collective", "dist_timeout_s")
    assert all(p.fits and not p.tight for p in plan.io) and plan.problems() == [] and plan.warnings() == []
    assert "I/O checkpoint save: " in render_table(plan) and "Single-rank I/O" in render_markdown(plan)


def test_a_timeout_shorter_than_its_phase_fails_and_a_tight_one_warns():
    cfg = TrainConfig.load("tiny_cpu", ["dist_timeout_s=1000", "io_wait_s=900"])
    phases = io.io_phases(cfg, model_folder=100_000_000_000, checkpoint=150_000_000_000, final=10**9)
    problems = io.io_problems(phases)  # checkpoint: 1500 s > 1000 s; model folder: 1000 s > 900 s
    assert problems == [
        "I/O time (model fetch): 1000 s exceeds io_wait_s=900 s (raise io_wait_s to at least 2000)",
        "I/O time (checkpoint save): 1500 s exceeds dist_timeout_s=1000 s (raise dist_timeout_s to at least "
        "3000)",
        "I/O time (resume download): 1500 s exceeds dist_timeout_s=1000 s (raise dist_timeout_s to at least "
        "3000)",
    ]
    tight = io.io_phases(cfg, model_folder=50_000_000_000, checkpoint=10**9, final=10**9)  # 500 of 900 s
    assert io.io_problems(tight) == []
    assert io.io_warnings(tight) == ["I/O time (model fetch): 500 s is over half of io_wait_s=900 s"]


def test_the_plan_fails_naming_the_phase_when_the_timeout_is_short(arch):
    plan = _plan(arch, ["dist_timeout_s=0.001"])
    assert any(p.startswith("I/O time (checkpoint save): ") and "dist_timeout_s=0 s" in p
               for p in plan.problems())
    assert not plan.to_dict()["fits"]


def test_default_timeout_covers_twice_the_flux_full_finetune_estimate():
    """DEFAULT_TIMEOUT_S (dist_timeout_s, io_wait_s) is twice the longest single-rank I/O of chunk_grpo_flux
    (FLUX.1-dev full fine-tuning, checkpoint = fp32 weights + AdamW, 12 bytes/param), rounded up to the
    hour."""
    cfg = TrainConfig.load("chunk_grpo_flux")
    assert cfg.dist_timeout_s == cfg.io_wait_s == DEFAULT_TIMEOUT_S
    W = FLUX_DEV_TRANSFORMER_PARAMS
    phases = io.io_phases(cfg, model_folder=58 * 10**9, checkpoint=12 * W, final=4 * W)
    longest = max(p.seconds for p in phases)
    assert longest == pytest.approx(1428, abs=1)  # the checkpoint save (and resume download)
    assert DEFAULT_TIMEOUT_S == 3600 * -(-2 * longest // 3600)
    assert io.io_warnings(phases) == [] and io.io_problems(phases) == []


def test_an_fsdp_checkpoint_is_written_in_shares_on_every_node(arch):
    """Two nodes of 8: each rank writes and hashes 1/16 of the checkpoint (none gathers it); without FSDP
    rank 0 writes the whole."""
    plan = _plan(arch, nodes=2)
    ckpt = plan.facts["checkpoint_bytes"]
    by = {p.phase: p for p in plan.io}
    assert plan.world == 16 and by["checkpoint save"].nbytes == -(-ckpt // 16)
    ddp = _plan(arch, ["distributed=ddp", "lora.enabled=true"], nodes=2)
    assert {p.phase: p for p in ddp.io}["checkpoint save"].nbytes == ddp.facts["checkpoint_bytes"]


def test_nccl_buffers_only_with_more_than_one_gpu_rank(arch):
    assert _parts(_plan(arch), "load")["NCCL buffers"] == io.NCCL_BUFFER_BYTES
    one = dataclasses.replace(GPU_POOL, gpus_per_node=1)
    assert "NCCL buffers" not in _parts(_plan(arch, pool=one), "load")
    assert "NCCL buffers" not in _parts(_plan(arch, device="cpu"), "load")
    two_nodes = _plan(arch, pool=one, nodes=2)
    assert two_nodes.world == 2 and _parts(two_nodes, "policy")["NCCL buffers"] == io.NCCL_BUFFER_BYTES


def test_reward_workers_add_a_cuda_context_each_unless_served(arch):
    two = ["rewards=[{name: hpsv3}, {name: imagereward}, {name: brightness}]"]
    parts = _parts(_plan(arch, two), "rollout")
    assert parts["reward worker CUDA contexts"] == 2 * io.CUDA_CONTEXT_BYTES  # brightness runs in-process
    served = ["rewards=[{name: hpsv3, url: 'http://r:8000'}, {name: ImageReward}]"]  # an alias counts too
    assert _parts(_plan(arch, served), "decode")["reward worker CUDA contexts"] == io.CUDA_CONTEXT_BYTES
    assert "reward worker CUDA contexts" not in _parts(_plan(arch, two, device="cpu"), "rollout")


def test_fsdp_no_sync_window_keeps_unsharded_fp32_gradients(arch):
    window = _plan(arch, ["grad_accum=2", "policy_batch=1", "chunks=uniform:1"])
    assert window.facts["backwards_per_window"] > 1
    term = "FSDP no-sync gradients (every unit, fp32)"
    assert _parts(window, "policy")[term] == 4 * window.facts["trainable_params"]
    per_backward = _plan(arch, ["grad_accum=2", "policy_batch=1", "chunks=uniform:1",
                                "fsdp_grad_sync=backward"])
    assert term not in _parts(per_backward, "policy")
    assert _parts(window, "policy")[term] + sum(_parts(per_backward, "policy").values()) == sum(
        _parts(window, "policy").values())
    ddp = _plan(arch, ["distributed=ddp", "grad_accum=2", "policy_batch=1", "chunks=uniform:1"])
    assert term not in _parts(ddp, "policy")  # the all-reduce is once per step anyway

"""Both branching recipes (tiny variants of tempflow_grpo_flux / granular_grpo_flux) train under real
torchrun processes (2 ranks, gloo): DDP replicas stay identical, FSDP shards train, every rank logs the
same all-reduced metrics, and the run length is counted in rollouts."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.integration

TORCHRUN = str(Path(sys.executable).parent / "torchrun")


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("data") / "prompts.txt"
    p.write_text("a cat on a chair\na red car\nthree apples\na bowl of fruit\n")
    return p


@pytest.mark.parametrize("preset,distributed,port,steps", [
    ("tempflow_grpo_tiny_cpu", "ddp", 29581, 2),     # per_iteration: one optimizer step per rollout
    ("granular_grpo_tiny_cpu", "fsdp", 29582, 8),    # per_step: 4 branching steps × 2 rollouts
])
def test_branching_presets_train_under_torchrun(
    tiny_model_dir, prompts_file, tmp_path, preset, distributed, port, steps
):
    out = tmp_path / preset
    cmd = [
        TORCHRUN,
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={port}",
        "-m",
        "chunkgrpo.train",
        "--config",
        preset,
        f"model={tiny_model_dir}",
        f"prompts={prompts_file}",
        f"output_dir={out}",
        "progress=false",
        "max_iterations=2",
        f"distributed={distributed}",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "train_summary.json").read_text())
    assert (summary["iterations"], summary["optimizer_steps"]) == (2, steps)
    ranks = [json.loads((out / "ranks" / f"rank{i}.json").read_text()) for i in range(2)]
    assert ranks[0]["world"] == 2 and ranks[0]["optimizer_step"] == steps
    assert ranks[0]["history"] == ranks[1]["history"]  # metrics all-reduced
    assert all(torch.isfinite(torch.tensor([h["loss"], h["reward_mean"]])).all() for h in ranks[0]["history"])
    if distributed == "ddp":
        assert ranks[0]["trainable_sha256"] == ranks[1]["trainable_sha256"]
    else:
        assert ranks[0]["sharded"] and ranks[0]["trainable_sha256"] != ranks[1]["trainable_sha256"]
    meta = json.loads((out / "final" / "chunkgrpo_model.json").read_text())
    assert meta["method"] == preset.split("_")[0] and meta["kind"] == "lora"
    lora = load_file(str(out / "final" / "pytorch_lora_weights.safetensors"))
    assert any(v.abs().sum() > 0 for k, v in lora.items() if "lora_B" in k)  # moved from the zero init

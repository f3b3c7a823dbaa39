"""The value the time (and guidance) embedding receives under real torchrun processes with bf16: DDP with
bf16 LoRA base weights, FSDP (MixedPrecisionPolicy param_dtype=bf16, which casts every forward input) with
LoRA and with a full fine-tune — always the exact fp32 `fp32(int(σ·1000)/1000)·1000`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = str(Path(sys.executable).parent / "torchrun")


CASES = [("ddp", "true"), ("fsdp", "true"), ("fsdp", "false")]  # (distributed, lora.enabled)


def test_time_embedding_sees_exact_fp32_timesteps_under_ddp_and_fsdp_bf16(tiny_model_dir, tmp_path):
    """One launch: its two ranks set up and probe a trainer per case in turn (tests/timestep_probe.py)."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\na dog\n")
    out = tmp_path / "probe"
    cmd = [TORCHRUN, "--nproc_per_node=2", "--master_addr=127.0.0.1", "--master_port=29571",
           str(ROOT / "tests" / "timestep_probe.py"), str(out)]
    for i, (distributed, lora) in enumerate(CASES):
        cmd += [*(["--"] if i else []), f"model={tiny_model_dir}", f"prompts={prompts}",
                f"output_dir={tmp_path / f'o{i}'}", "progress=false", "mixed_precision=bf16",
                f"distributed={distributed}", f"lora.enabled={lora}", "checkpoint.resume=false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    for i, (distributed, lora) in enumerate(CASES):
        for rank in (0, 1):
            res = json.loads(Path(f"{out}.{i}.rank{rank}").read_text())
            assert res["world"] == 2 and res["bf16"] and res["fsdp"] == (distributed == "fsdp"), (i, res)
            if distributed == "fsdp":
                # sharded master weights
                assert res["param_dtype_seen"] in ("torch.float32", "torch.bfloat16")
            assert len(res["rows"]) == 8
            for row in res["rows"]:
                assert row["dtype"] == "torch.float32" and row["exact"], (i, row)
                assert all(v == row["expect"] for v in row["seen"])
            # 979 (not the bf16 980) reaches FLUX at the second step of the 8-step shift schedule
            assert res["rows"][1]["expect"] == pytest.approx(int(res["rows"][1]["timestep"]), abs=1e-3)

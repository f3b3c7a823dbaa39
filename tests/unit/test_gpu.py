"""GPUs where GPUs were requested (`chunkgrpo.gpu`): a stage that asks for a GPU CUDA cannot use stops in one
line naming the driver found, torch's CUDA and the fix, before anything is loaded; it never runs on the CPU.

The message tests fake the driver (a `/proc/driver/nvidia/version` file) and torch's CUDA build; the CLI tests
run the real command on this machine, which has no usable CUDA device (skipped where one is)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from chunkgrpo import gpu
from chunkgrpo.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
PROPRIETARY = ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.124.06  Wed Feb 26 01:50:08 UTC 2025\n"
               "GCC version:  gcc version 12.3.0 (Ubuntu 12.3.0-1ubuntu1~22.04)\n")
OPEN = ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.82.07  Release Build  "
        "(dvs-builder@U16-I3-B03-4-3)  Wed Aug 27 16:29:05 UTC 2025\nGCC version:  gcc version 13.3.0\n")
FLUX_TRAIN_PRESETS = sorted(p.stem for p in (ROOT / "chunkgrpo" / "presets").glob("*_flux.yaml"))


@pytest.fixture
def node(tmp_path, monkeypatch):
    """Set the faked node: `node(driver_text or None, torch_cuda or None, available)`."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def set_node(driver: str | None, torch_cuda: str | None, available: bool = False):
        proc = tmp_path / "version"
        if driver is not None:
            proc.write_text(driver)
        monkeypatch.setattr(gpu, "PROC_VERSION", proc)
        monkeypatch.setattr(gpu, "_torch_cuda", lambda: ("2.13.0+cu" + (torch_cuda or "").replace(".", ""),
                                                         torch_cuda, available))
    return set_node


def test_driver_version_reads_both_kernel_module_formats(tmp_path):
    for text, want in ((PROPRIETARY, "570.124.06"), (OPEN, "580.82.07")):
        (tmp_path / "v").write_text(text)
        assert gpu.driver_version(tmp_path / "v") == want
    assert gpu.driver_version(tmp_path / "absent") is None


def test_minimum_driver_per_cuda_major():
    assert gpu.min_driver("13.0") == "580.65.06"
    assert gpu.min_driver("12.6") == gpu.min_driver("12.8") == "525.60.13"
    assert gpu.min_driver("99.0") is None


def test_an_old_driver_under_cuda13_torch_names_driver_cuda_and_both_fixes(node):
    node(PROPRIETARY, "13.0")
    with pytest.raises(UserError) as e:
        gpu.require("cuda")
    line = str(e.value)
    assert "\n" not in line
    assert "NVIDIA driver 570.124.06" in line and "CUDA 13.0" in line and ">= 580.65.06" in line
    assert "CUDA 12.6" in line and "525.60.13" in line  # the image built for the older CUDA
    assert line.startswith("device=cuda but CUDA sees no GPU")


def test_an_old_driver_under_cuda12_torch_asks_for_a_newer_driver_only(node):
    node("NVRM version: NVIDIA UNIX x86_64 Kernel Module  470.256.02  Thu May  2 14:37:44 UTC 2024\n", "12.6")
    line = gpu.problem("cuda:0")
    assert "NVIDIA driver 470.256.02" in line and "older than 525.60.13" in line and "CUDA 12.6" in line
    assert "runtime image" not in line  # there is no older image to switch to


def test_no_driver_and_cpu_only_builds_are_named(node):
    node(None, "13.0")
    line = gpu.problem("cuda")
    assert "no NVIDIA driver" in line and "CUDA 13.0" in line and "nvidia.com/gpu" in line
    node(PROPRIETARY, None)
    line = gpu.problem("cuda")
    assert "CPU-only build" in line and "NVIDIA driver 570.124.06" in line


def test_a_new_enough_driver_without_a_visible_device_says_so(node, monkeypatch):
    node(OPEN, "13.0")
    assert "given no GPU device" in gpu.problem("cuda")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert "CUDA_VISIBLE_DEVICES=''" in gpu.problem("cuda")


def test_auto_fails_only_in_a_task_given_gpus(node):
    """`auto` resolves to the CPU on a CPU machine (and in a CPU pod of a CUDA image, whose env says
    NVIDIA_VISIBLE_DEVICES=all), but in a pod granted GPUs by the device plugin it must not."""
    node(PROPRIETARY, "13.0")
    for env in ({}, {"NVIDIA_VISIBLE_DEVICES": "all"}, {"NVIDIA_VISIBLE_DEVICES": "void"}):
        assert gpu.require("auto", env) == "cpu"
    with pytest.raises(UserError, match=r"^device=auto in a task that was given GPUs .*570\.124\.06"):
        gpu.require("auto", {"NVIDIA_VISIBLE_DEVICES": "GPU-6f1c2b4e-0b0c-4f4c-9a0e-1c2d3e4f5a6b"})
    assert gpu.require("cpu", {"NVIDIA_VISIBLE_DEVICES": "0,1"}) == "cpu"


def test_a_usable_gpu_passes(node):
    node(OPEN, "13.0", available=True)
    assert gpu.problem("cuda") is None
    assert gpu.require("auto", {"NVIDIA_VISIBLE_DEVICES": "0"}) == "cuda"
    assert gpu.require("cuda:3") == "cuda:3"


def test_dist_setup_never_falls_back_to_the_cpu_in_a_task_given_gpus(node, monkeypatch):
    from chunkgrpo.train import dist

    node(PROPRIETARY, "13.0")
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", "GPU-0")
    with pytest.raises(UserError, match="570.124.06"):
        dist.setup("auto")
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", "all")
    assert dist.setup("auto").device.type == "cpu"


def test_profile_and_preflight_check_the_gpu_first(node, tmp_path):
    from chunkgrpo.dynamics import ProfileConfig, run_profile
    from chunkgrpo.preflight import PreflightSpec, check

    node(PROPRIETARY, "13.0")
    with pytest.raises(UserError, match="570.124.06"):  # before "profile needs a model"
        run_profile(ProfileConfig(device="cuda", out=str(tmp_path / "p.json")))
    problems = check(PreflightSpec(device="cuda", mlflow=False, model=str(tmp_path), prompts=str(tmp_path)))
    assert any("570.124.06" in p for p in problems)
    assert not any("570.124.06" in p for p in check(PreflightSpec(mlflow=False, model=str(tmp_path))))


needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a usable CUDA device")


def _cli(args: list[str]) -> tuple[int, list[str], float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for k in ("MLFLOW_TRACKING_URI", "CHUNKGRPO_S3_ENDPOINT", "NVIDIA_VISIBLE_DEVICES"):
        env.pop(k, None)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "chunkgrpo", *args], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=300)
    lines = r.stderr.strip().splitlines() + r.stdout.strip().splitlines()
    return r.returncode, lines, time.monotonic() - t0


@needs_no_cuda
@pytest.mark.parametrize("preset", FLUX_TRAIN_PRESETS)
def test_every_flux_training_preset_stops_in_one_gpu_line(preset):
    """No model, no prompts given: the GPU line comes before those checks, so nothing else was read."""
    rc, lines, took = _cli(["train", "--config", preset])
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith("chunkgrpo train: error: device=cuda but ") and "CUDA" in lines[0], lines
    assert ("NVIDIA driver" in lines[0] or "no NVIDIA driver" in lines[0]), lines
    assert took < 120, took  # interpreter + torch import, not a model load


@needs_no_cuda
def test_eval_hpdv2_stops_in_one_gpu_line_before_the_model_is_read(tmp_path):
    rc, lines, took = _cli(["evaluate", "--config", "eval_hpdv2", "model=s3://nowhere/run/final",
                            f"output_dir={tmp_path / 'eval'}"])
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith("chunkgrpo evaluate: error: device=cuda but ") and "CUDA" in lines[0], lines
    assert not (tmp_path / "eval").exists()
    assert took < 120, took


def test_the_flux_presets_and_eval_hpdv2_ask_for_cuda():
    from chunkgrpo.eval.config import EvalConfig
    from chunkgrpo.train.config import TrainConfig

    assert len(FLUX_TRAIN_PRESETS) == 6
    assert {TrainConfig.load(p).device for p in FLUX_TRAIN_PRESETS} == {"cuda"}
    assert EvalConfig.load("eval_hpdv2", ["model=m"]).device == "cuda"

"""benchmarks/fsdp_gpu_check.py: the real-size configuration's parameter counts on the meta device, bad
input, and every stage at --size tiny on the CPU printing its measurement beside the plan's prediction."""

import json
import subprocess
import sys

import pytest

from tests import benchmark_scripts

STAGES = ["load", "decode", "forward", "backward", "save", "iteration"]


def run_tiny(*args: str) -> subprocess.CompletedProcess:
    script = benchmark_scripts.ROOT / "benchmarks" / "fsdp_gpu_check.py"
    return subprocess.run([sys.executable, str(script), "--size", "tiny", "--device", "cpu", *args],
                          capture_output=True, text=True, timeout=600, cwd=benchmark_scripts.ROOT)


def test_real_size_counts_are_flux_dev_t5_xxl_and_one_eighth_shard_on_meta():
    bench = benchmark_scripts.load("fsdp_gpu_check")
    c = bench.real_counts()
    assert c["transformer"] == 11_901_408_320  # FLUX.1-dev's published count
    assert c["text_encoder_2"] == 4_762_310_656  # T5 v1.1 XXL's encoder
    assert c["text_encoder"] == 123_060_480  # CLIP ViT-L/14's text tower
    # rank 0 of 8: ⌈d0/8⌉ rows of every tensor, a little over 1/8 (FSDP's padding)
    assert c["transformer"] / 8 <= c["shard_elements"] <= c["transformer"] / 8 * 1.001
    assert c["shard_elements"] == 1_487_676_040


@pytest.mark.parametrize("argv, needle", [
    (["--stages", "load,nope"], "'nope'"),
    (["--stages", "save", "--out", "/nonexistent-folder"], "/nonexistent-folder"),
    (["--budget-s", "0", "--device", "cpu"], "--budget-s 0"),
])
def test_bad_input_is_one_line_and_exit_2(argv, needle, capsys):
    bench = benchmark_scripts.load("fsdp_gpu_check")
    assert bench.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err


@pytest.mark.integration  # a minute of CPU: the plan, a reward stand-in process and flux_gpu.py's iteration
def test_every_stage_at_tiny_size_prints_measured_beside_predicted(tmp_path):
    out = tmp_path / "check.json"
    run = run_tiny("--out", str(tmp_path), "--json", str(out))
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [json.loads(ln) for ln in run.stdout.splitlines() if ln.startswith("{")]
    assert json.loads(out.read_text()) == lines
    by = {ln["stage"]: ln for ln in lines}
    assert [ln["stage"] for ln in lines] == ["setup", *STAGES]
    for stage in STAGES:
        assert "error" not in by[stage] and "skipped" not in by[stage], by[stage]
        assert by[stage]["measured"] and by[stage]["predicted"], by[stage]
    load = by["load"]
    # exactly rank 0's shards of FSDP2 at world 8, as the plan's load term counts them
    assert load["measured"]["shard_elements"] == load["shard_elements_expected"]
    assert load["measured"]["transformer_shard_gib"] == pytest.approx(
        load["predicted"]["transformer_shard_gib"], abs=1e-6)
    assert load["measured"]["reward_models_gib"] > 0
    assert by["decode"]["measured"]["images"] == 24  # the rollout's 2 prompts × 12
    assert by["backward"]["measured"]["inputs"] == 7  # the plan's policy inputs per forward
    save = by["save"]
    assert save["measured"]["bytes"] >= 30 * 10**6 and save["measured"]["write_gb_per_s"] > 0
    assert save["predicted"]["write_gb_per_s"] == 0.2
    assert not list(tmp_path.glob("fsdp-gpu-check-*"))  # the state dict is deleted after
    assert by["iteration"]["measured"]["samples"] == 3 and by["iteration"]["predicted"]["peak_gib"] > 0


@pytest.mark.integration
def test_budget_skips_stages_that_would_overrun_it(tmp_path):
    run = run_tiny("--stages", "save,iteration", "--budget-s", "1")
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [json.loads(ln) for ln in run.stdout.splitlines() if ln.startswith("{")]
    assert [ln["stage"] for ln in lines] == ["setup", "save", "iteration"]
    assert all("would pass --budget-s 1" in ln["skipped"] for ln in lines[1:])

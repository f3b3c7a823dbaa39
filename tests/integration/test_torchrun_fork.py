"""Forked torchrun workers (chunkgrpo/torchrun_local.py, `$CHUNKGRPO_FORK_WORKERS=1`, set by local pipeline
runs): each rank is what `python -u -m MODULE` would have been (argv, `__main__`, torchrun's per-rank
environment, its own session, unbuffered text output, non-daemon threads joined and atexit handlers run,
SystemExit's code reaching torchrun), the launcher's preload reads none of torchrun's per-rank variables,
training gives bit-identical weights forked or fresh, and `run_torchrun` in a single-threaded process forks
the launcher itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from chunkgrpo.torchrun_local import ENV_FORK, PRELOAD, command

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
# what torchrun's agent sets per worker (torch/distributed/elastic/agent/server/local_elastic_agent.py)
PER_RANK = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
            "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
            "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
            "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING")


def _env(fork: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    return {**env, ENV_FORK: "1" if fork else "0", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT),
            "TRANSFORMERS_VERBOSITY": "error"}


def _probe(tmp_path: Path, fork: bool, *extra: str) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / ("fork" if fork else "fresh")
    out.mkdir()
    r = subprocess.run(command(2, "-m", "tests.fork_probe", str(out), *extra), capture_output=True, text=True,
                       env=_env(fork), cwd=ROOT, timeout=600)
    return r, out


def test_a_forked_rank_is_what_a_fresh_python_m_would_be(tmp_path):
    got = {}
    for fork in (False, True):
        r, out = _probe(tmp_path, fork)
        assert r.returncode == 0, r.stderr[-3000:]
        ranks = [json.loads((out / f"rank{i}.json").read_text()) for i in range(2)]
        for i, rec in enumerate(ranks):
            assert rec["rank"] == i and rec["world"] == rec["local_world"] == 2 and rec["omp"] == "1"
            assert rec["name"] == "__main__" and rec["argv"][0].endswith("tests/fork_probe.py")
            assert rec["argv"][1:] == [str(out)] and rec["own_session"] and rec["text_unbuffered"]
            # the interpreter's exit: the non-daemon thread was joined, the atexit handler ran
            assert (out / f"thread{i}").read_text() == "thread"
            assert (out / f"atexit{i}").read_text() == "atexit"
            assert f"fork_probe rank {i}: line" in r.stdout + r.stderr
        got[fork] = ranks
    # fresh: `python -u -m tests.fork_probe` imported nothing of the trainer; forked: all of it already there
    assert got[False][0]["preloaded"] == [] and got[False][0]["launcher_cmdline"][1:3] == [
        "-m", "chunkgrpo.torchrun_local"]
    assert got[True][0]["preloaded"] == ["chunkgrpo.train.trainer", "diffusers.pipelines.flux.pipeline_flux",
                                         "peft"]


def test_a_forked_ranks_exit_code_fails_the_launch(tmp_path):
    r, out = _probe(tmp_path, True, "3")
    assert r.returncode == 1 and "exitcode  : 3" in r.stderr, r.stderr[-3000:]
    assert (out / "atexit1").exists()  # it still ended as an interpreter ends


def test_the_preload_reads_no_per_rank_variable():
    """The workers inherit modules imported before torchrun set RANK, MASTER_PORT, ...: those imports must
    not have read any of them (recorded as pipeline/warm.py records a warm server's imports)."""
    code = ("import json, sys; from pipeline.warm import record_imports; "
            f"seen, _ = record_imports({list(PRELOAD)!r}); print(json.dumps(sorted(seen)))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(True), cwd=ROOT,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    seen = set(json.loads(r.stdout.strip().splitlines()[-1]))
    assert len(seen) > 10  # the recording works: the imports read HF_*, MLFLOW_*, ...
    assert not seen & set(PER_RANK), seen & set(PER_RANK)


def test_training_is_bit_identical_forked_or_fresh(tiny_model_dir, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat on a chair\na red car\nthree apples\na bowl of fruit\n")
    weights, history = {}, {}
    for fork in (False, True):
        out = tmp_path / f"out-{fork}"
        cmd = command(2, "-m", "chunkgrpo.train", "--config", "tiny_cpu", f"model={tiny_model_dir}",
                      f"prompts={prompts}", f"output_dir={out}", "progress=false", "max_steps=2")
        r = subprocess.run(cmd, capture_output=True, text=True, env=_env(fork), cwd=tmp_path, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        weights[fork] = load_file(str(out / "final" / "pytorch_lora_weights.safetensors"))
        history[fork] = json.loads((out / "ranks" / "rank0.json").read_text())["history"]
    assert weights[False].keys() == weights[True].keys()
    assert all(bool((weights[False][k] == weights[True][k]).all()) for k in weights[False])
    assert history[False] == history[True]


def test_run_torchrun_forks_the_launcher_in_a_single_threaded_process(tmp_path):
    out = tmp_path / "probe"
    out.mkdir()
    # this process's sys.stdout is an object of its own (as under a log capture): the forked launcher and
    # ranks still write into the pipe run_torchrun reads, as fresh processes would
    code = ("import io, sys; from chunkgrpo.torchrun import run_torchrun; "
            "from chunkgrpo.torchrun_local import command; real = sys.stdout; sys.stdout = io.StringIO(); "
            f"run_torchrun(command(2, '-m', 'tests.fork_probe', {str(out)!r}), out=real)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(True), cwd=ROOT,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rec = json.loads((out / "rank0.json").read_text())
    # the launcher is a fork of `python -c ...`, not a fresh `python -m chunkgrpo.torchrun_local`
    assert rec["launcher_cmdline"][1] == "-c" and rec["preloaded"], rec
    assert "fork_probe rank 1: line" in r.stdout

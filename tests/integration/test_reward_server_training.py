"""Training (`chunkgrpo train`, a process of its own) against a real reward server process on 127.0.0.1.

* The same numbers: a run whose reward is served trains exactly as the run that scores it in-process
  (same seed; per-step loss, gradient norm and reward equal within 1e-6 relative, the final LoRA weights
  within 1e-6 absolute; PNG is lossless and a float32 score survives JSON exactly).
* Faults mid-run: the server killed (not back within the client's deadline) or failing (HTTP 500) stops
  the run with one line naming the URL and the cause, after the last complete checkpoint and with nothing
  half-written; the same command, once the server is back, resumes and ends where the uninterrupted run
  ends. A server killed and back within the deadline costs the run nothing.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from chunkgrpo.train.checkpoint_format import verify
from tests.integration.reward_servers import ROOT, TOKEN, Server

pytestmark = pytest.mark.integration

STEPS = 4  # one rollout of 8 images per optimizer step (tiny_cpu: grad_accum = group_size = 8)
RTOL, WEIGHT_ATOL = 1e-6, 1e-6

# A served reward that is `brightness` while the file `flag` is absent, and fails (HTTP 500) while it exists
GATED = '''
import os

from chunkgrpo.scoring.rewards import get_reward


def brightness(flag):
    inner = get_reward("brightness")

    def fn(images, prompts):
        if os.path.exists(flag):
            raise RuntimeError("scorer offline")
        return inner(images, prompts)

    return fn
'''


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("data") / "prompts.txt"
    p.write_text("a cat on a chair\na red car\na bowl of fruit\na lighthouse at night\n")
    return p


def _argv(model: Path, prompts: Path, out: Path, reward: str) -> list[str]:
    return [sys.executable, "-m", "chunkgrpo", "train", "--config", "tiny_cpu", f"model={model}",
            f"prompts={prompts}", f"output_dir={out}", "progress=false", f"max_steps={STEPS}",
            "checkpoint.every=1", "checkpoint.keep=0", f"rewards=[{reward}]"]


def _env(folder: Path) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(folder)]),
            "CHUNKGRPO_REWARD_TOKEN": TOKEN}


def _train(argv: list[str], folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env=_env(folder), cwd=folder, capture_output=True, text=True, timeout=900)


def _weights(out: Path) -> dict:
    return load_file(str(out / "final" / "pytorch_lora_weights.safetensors"))


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def reference(tiny_model_dir, prompts_file, tmp_path_factory) -> dict:
    """The uninterrupted run with `brightness` scored in the training process."""
    folder = tmp_path_factory.mktemp("in-process")
    out = folder / "run"
    r = _train(_argv(tiny_model_dir, prompts_file, out, "{name: brightness}"), folder)
    assert r.returncode == 0, r.stderr[-3000:]
    return {"summary": json.loads((out / "train_summary.json").read_text()), "weights": _weights(out)}


def _served(url: str, name: str = "brightness", **client) -> str:
    options = ", ".join(f"{k}: {v}" for k, v in client.items())
    return f'{{name: "{name}", url: "{url}", options: {{{options}}}}}'


def test_served_reward_trains_as_the_in_process_one(reference, tiny_model_dir, prompts_file, tmp_path):
    s = Server(tmp_path, "brightness")
    try:
        out = tmp_path / "run"
        r = _train(_argv(tiny_model_dir, prompts_file, out, _served(s.url)), tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
        # every reward of the run was scored by the server: one request per rollout of 8 images
        assert f'chunkgrpo_reward_images_total{{scorer="brightness"}} {STEPS * 8}' in s.metrics()
    finally:
        s.stop()
    served = json.loads((out / "train_summary.json").read_text())["history"]
    local = reference["summary"]["history"]
    assert [h["optimizer_step"] for h in served] == [h["optimizer_step"] for h in local] == [1, 2, 3, 4]
    for a, b in zip(served, local):
        for key in ("reward_mean", "loss", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=RTOL, abs=1e-12), (key, a, b)
    assert _max_diff(_weights(out), reference["weights"]) <= WEIGHT_ATOL


def _wait_for_checkpoint(out: Path, step: int, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    target = out / "checkpoints" / f"step-{step:06d}"
    deadline = time.monotonic() + timeout_s
    while not target.is_dir():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"no {target.name} after {timeout_s} s"
        time.sleep(0.02)


def _nothing_half_written(out: Path) -> list[int]:
    """No final model or summary; every checkpoint complete (verifies against its manifest), nothing
    staged beside them. Returns the checkpoints' steps."""
    assert not (out / "final").exists() and not (out / "train_summary.json").exists()
    dirs = sorted((out / "checkpoints").iterdir())
    assert all(re.fullmatch(r"step-\d{6}", d.name) for d in dirs), [d.name for d in dirs]
    for d in dirs:
        verify(d)
    return [int(d.name.split("-")[1]) for d in dirs]


def _one_line_error(stderr: str) -> str:
    errors = [line for line in stderr.splitlines() if line.startswith("chunkgrpo train: error: ")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert stderr.rstrip().splitlines()[-1] == errors[0]
    return errors[0]


@pytest.mark.parametrize("fault", ["killed", "HTTP 500"])
def test_server_lost_mid_run_is_one_line_and_the_run_resumes(fault, reference, tiny_model_dir, prompts_file,
                                                            tmp_path):
    flag = tmp_path / "offline"
    (tmp_path / "gated.py").write_text(GATED)
    if fault == "killed":
        name, extra = "brightness", ()
    else:
        name, extra = "gated:brightness", ("--option", f"flag={flag}")
    started = [Server(tmp_path, name, *extra)]
    try:
        url, out = started[0].url, tmp_path / "run"
        argv = _argv(tiny_model_dir, prompts_file, out, _served(url, name, deadline_s=3, backoff_s=0.1))
        proc = subprocess.Popen(argv, env=_env(tmp_path), cwd=tmp_path, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            _wait_for_checkpoint(out, 2, proc)
            if fault == "killed":
                started[0].kill()
            else:
                flag.write_text("")
            _, stderr = proc.communicate(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert proc.returncode == 2, stderr[-3000:]
        error = _one_line_error(stderr)
        cause = (r"(ConnectionRefusedError: \[Errno 111\] Connection refused|Connection ?Reset.*); "
                 r"gave up after \d+ attempts in 3 s" if fault == "killed" else
                 r"HTTP 500 \(RuntimeError: scorer offline\)")
        assert re.fullmatch(rf"chunkgrpo train: error: reward '{re.escape(name)}' at {url}/score: {cause}",
                            error), error
        steps = _nothing_half_written(out)
        assert steps and max(steps) < STEPS, steps
        # the server back where the run looks for it: the same command resumes and ends as the
        # uninterrupted run
        if fault == "killed":
            started.append(Server(tmp_path, name, *extra, port=started[0].port))
        else:
            flag.unlink()
        r = _train(argv, tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
        resumed = out / "checkpoints" / f"step-{max(steps):06d}"
        assert f"resumed from {resumed}" in r.stdout + r.stderr, r.stderr[-3000:]
    finally:
        for s in started:
            s.stop()
    assert json.loads((out / "train_summary.json").read_text())["optimizer_steps"] == STEPS
    assert _max_diff(_weights(out), reference["weights"]) <= WEIGHT_ATOL


def test_server_killed_and_back_within_the_deadline_costs_nothing(reference, tiny_model_dir, prompts_file,
                                                                  tmp_path):
    started = [Server(tmp_path, "brightness")]
    try:
        out = tmp_path / "run"
        reward = _served(started[0].url, deadline_s=300, backoff_s=0.2)
        argv = _argv(tiny_model_dir, prompts_file, out, reward)
        proc = subprocess.Popen(argv, env=_env(tmp_path), cwd=tmp_path, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            _wait_for_checkpoint(out, 2, proc)
            started[0].kill()
            time.sleep(1.0)
            started.append(Server(tmp_path, "brightness", port=started[0].port))
            stdout, stderr = proc.communicate(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert proc.returncode == 0, stderr[-3000:]
        assert f"trained {STEPS} optimizer steps" in stdout
        # the restarted server scored what was left: at least the last rollout, never a lost one twice
        metrics = started[1].metrics()
        scored = re.search(r'chunkgrpo_reward_images_total\{scorer="brightness"\} (\d+)', metrics)
        assert 8 <= int(scored.group(1)) <= (STEPS - 2) * 8
    finally:
        for s in started:
            s.stop()
    assert _max_diff(_weights(out), reference["weights"]) <= WEIGHT_ATOL

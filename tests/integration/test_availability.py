"""Faults in the services around training, against real servers this test starts
and stops itself: MLflow down at start or mid-run, SIGTERM (a pod eviction), S3 down mid-run, and
an S3 outage long enough that the local disk policy would have to drop data.

Training must finish (or stop only where it would otherwise lose data), with every checkpoint and
every metric accounted for. These cases count as "faults injected / survived with nothing lost"."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from chunkgrpo.processes import free_port
from chunkgrpo.services import local_services
from chunkgrpo.train import checkpoint_format as ckpt
from chunkgrpo.train.config import TrainConfig
from chunkgrpo.train.trainer import Trainer, run_training
from tests.fixtures_services import kill_service

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("data") / "prompts.txt"
    p.write_text("a cat on a chair\na red car\nthree apples\n")
    return p


def _cfg(model, prompts, out, *over):
    return TrainConfig.load(
        "tiny_cpu",
        [
            f"model={model}",
            f"prompts={prompts}",
            f"output_dir={out}",
            "progress=false",
            "checkpoint.every=1",
            "tracking.image_every=0",
            *over,
        ],
    )


@pytest.fixture
def env(monkeypatch):
    """Set env vars for one test (restored afterwards)."""
    def apply(values: dict[str, str]) -> None:
        for k, v in values.items():
            monkeypatch.setenv(k, v)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    return apply


def _on_iteration(monkeypatch, hooks: dict[int, callable]) -> None:
    """Run hooks[i] right before training iteration i (0-based) — the fault injection points."""
    real = Trainer.iteration

    def iteration(self):
        if (hook := hooks.pop(self.iteration_idx, None)) is not None:
            hook()
        return real(self)

    monkeypatch.setattr(Trainer, "iteration", iteration)


def _later(delay_s: float, fn) -> threading.Thread:
    t = threading.Thread(target=lambda: (time.sleep(delay_s), fn()), daemon=True)
    t.start()
    return t


def test_mlflow_down_at_start_does_not_block_or_stop_training(
    tiny_model_dir, prompts_file, tmp_path, env, caplog
):
    env({"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{free_port()}"})  # nothing listens there
    caplog.set_level(logging.WARNING)
    t0 = time.monotonic()
    summary = run_training(
        _cfg(tiny_model_dir, prompts_file, tmp_path, "max_steps=2", "tracking.flush_timeout_s=2")
    )
    elapsed = time.monotonic() - t0
    assert (
        summary["optimizer_steps"] == 2 and (tmp_path / "final" / "pytorch_lora_weights.safetensors").exists()
    )
    assert "mlflow_run_id" not in summary
    assert "MLflow unreachable" in caplog.text and "tracking calls not delivered" in caplog.text
    assert elapsed < 120, elapsed  # it used to hang 256 s at start, then crash
    assert (
        os.environ.get("MLFLOW_HTTP_REQUEST_MAX_RETRIES") is None
    )  # the bounded settings were scoped to the run


def test_mlflow_crash_mid_run_loses_no_metric(tiny_model_dir, prompts_file, tmp_path, env, monkeypatch):
    from mlflow import MlflowClient

    with local_services(tmp_path / "svc") as svc:
        env(svc.env())
        restarted = []
        _on_iteration(monkeypatch, {
            1: lambda: kill_service(svc, "mlflow"),  # down for iterations 1..3 at least
            2: lambda: restarted.append(_later(1.0, svc.up)),  # back (~6 s to start) while training goes on
        })
        summary = run_training(_cfg(tiny_model_dir, prompts_file, tmp_path / "run", "max_steps=5",
                                    "tracking.experiment=outage", "tracking.flush_timeout_s=180"))
        restarted[0].join(timeout=180)
        assert summary["optimizer_steps"] == 5
        run = MlflowClient().get_run(summary["mlflow_run_id"])
        assert run.info.status == "FINISHED"
        hist = MlflowClient().get_metric_history(run.info.run_id, "reward/mean")
        assert sorted(m.step for m in hist) == [1, 2, 3, 4, 5]  # the ones logged during the outage arrived
        by_step = {m.step: m.value for m in hist}
        assert all(abs(by_step[h["optimizer_step"]] - h["reward_mean"]) < 1e-6 for h in summary["history"])
        assert run.data.params["method"] == "chunk"
        assert {"chunk_plan.json", "train_summary.json"} <= {
            a.path for a in MlflowClient().list_artifacts(run.info.run_id)
        }


def test_sigterm_marks_the_run_killed_and_keeps_the_checkpoint(services_env, tiny_model_dir, prompts_file,
                                                                tmp_path):
    """Against the session's servers: nothing here stops them (the eviction is the training's)."""
    from mlflow import MlflowClient

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "chunkgrpo", "train", "--config", "tiny_cpu", f"model={tiny_model_dir}",
           f"prompts={prompts_file}", f"output_dir={out}", "progress=false", "max_steps=50",
           "checkpoint.every=1", "tracking.image_every=0", "tracking.experiment=evicted"]
    proc = subprocess.Popen(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (out / "checkpoints" / "step-000002" / "MANIFEST.json").exists():
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)  # what the kubelet sends on eviction
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "chunkgrpo train: terminated by signal 15" in err and "Traceback" not in err
    client = MlflowClient()
    exp = client.get_experiment_by_name("evicted")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "KILLED"
    for p in ckpt.complete_checkpoints(out / "checkpoints"):
        ckpt.verify(p)  # every committed checkpoint is whole
    r = subprocess.run(
        [*cmd[:-1], "max_steps=3", "tracking.experiment=evicted"],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
        timeout=600,
    )
    assert r.returncode == 0 and "resumed from" in r.stderr, r.stderr[-3000:]


def test_s3_outage_mid_run_keeps_training_and_mirrors_everything(tiny_model_dir, prompts_file, tmp_path, env,
                                                                 monkeypatch):
    from chunkgrpo.store.client import ArtifactStore

    with local_services(tmp_path / "svc", mlflow=False) as svc:
        env({k: v for k, v in svc.env().items() if not k.startswith("MLFLOW")})
        monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
        monkeypatch.setenv("CHUNKGRPO_S3_RETRIES", "3")  # the store's own retries: ~1.5 s of backoff
        prefix = f"s3://{svc.config.bucket}/runs/outage/ckpt"
        restarted = []
        _on_iteration(monkeypatch, {
            1: svc.down,  # S3 gone for 3 s and more, twice the store's own retries
            2: lambda: restarted.append(_later(3.0, svc.up)),
        })
        out = tmp_path / "run"
        summary = run_training(_cfg(tiny_model_dir, prompts_file, out, "max_steps=5", "checkpoint.keep=1",
                                    "checkpoint.mirror_backlog=10", f"checkpoint.s3_prefix={prefix}",
                                    "checkpoint.mirror_wait_s=300"))
        restarted[0].join(timeout=120)
        assert summary["optimizer_steps"] == 5
        st = ArtifactStore()
        # every checkpoint reached S3 (the outage's ones too), then S3 retention kept checkpoint.keep=1
        assert [u.rsplit("/", 1)[-1] for u in st.list_complete(prefix)] == ["step-000005"]
        local = ckpt.complete_checkpoints(out / "checkpoints")
        assert [p.name for p in local] == [
            "step-000005"
        ]  # older ones deleted once they were in S3 (at the latest: the end)
        st.get_folder(prefix + "/step-000005", tmp_path / "check")  # verified
        assert json.loads((tmp_path / "check" / "trainer_state.json").read_text())["optimizer_step"] == 5


def test_s3_outage_stops_only_where_the_disk_policy_would_lose_data(
    tiny_model_dir, prompts_file, tmp_path, env, monkeypatch
):
    with local_services(tmp_path / "svc", mlflow=False) as svc:
        env({k: v for k, v in svc.env().items() if not k.startswith("MLFLOW")})
        monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
        prefix = f"s3://{svc.config.bucket}/runs/long-outage/ckpt"
        _on_iteration(monkeypatch, {0: svc.down})  # down for good, right after the start
        out = tmp_path / "run"
        with pytest.raises(ckpt.MirrorBacklogError, match="not yet mirrored to S3"):
            run_training(_cfg(tiny_model_dir, prompts_file, out, "max_steps=6", "checkpoint.keep=1",
                              f"checkpoint.s3_prefix={prefix}"))
        # keep=1 would have deleted step-1, which exists nowhere else: both are still there, whole
        local = ckpt.complete_checkpoints(out / "checkpoints")
        assert [p.name for p in local] == ["step-000001", "step-000002"]
        for p in local:
            ckpt.verify(p)
        svc.up()
        # the next run (S3 back) resumes locally and mirrors what never reached S3
        summary = run_training(_cfg(tiny_model_dir, prompts_file, out, "max_steps=3", "checkpoint.keep=3",
                                    f"checkpoint.s3_prefix={prefix}"))
        assert summary["optimizer_steps"] == 3
        from chunkgrpo.store.client import ArtifactStore

        names = [u.rsplit("/", 1)[-1] for u in ArtifactStore().list_complete(prefix)]
        assert names == ["step-000001", "step-000002", "step-000003"]


def test_tampered_s3_checkpoint_falls_back_to_the_older_one(
    services_env, tiny_model_dir, prompts_file, tmp_path, caplog
):
    """A new pod (empty disk) resumes from S3; the newest S3 checkpoint has a replaced object (its
    manifest untouched): the download fails verification and the previous S3 checkpoint is used."""
    from chunkgrpo.store.client import ArtifactStore

    prefix = f"s3://{services_env.store_config.bucket}/runs/tampered/ckpt"
    out = tmp_path / "run"
    run_training(_cfg(tiny_model_dir, prompts_file, out, "max_steps=2", f"checkpoint.s3_prefix={prefix}",
                      "checkpoint.keep=5"))
    st = ArtifactStore()
    st.put_bytes(b"not the optimizer state", prefix + "/step-000002/optimizer.pt")
    import shutil

    shutil.rmtree(out)
    caplog.set_level(logging.INFO, logger="chunkgrpo.train.trainer")
    summary = run_training(
        _cfg(
            tiny_model_dir,
            prompts_file,
            out,
            "max_steps=3",
            f"checkpoint.s3_prefix={prefix}",
            "checkpoint.keep=5",
        )
    )
    assert (
        "checkpoint step-000002 (s3) is unusable" in caplog.text and "fell back to step-000001" in caplog.text
    )
    assert summary["optimizer_steps"] == 3 and [h["optimizer_step"] for h in summary["history"]] == [1, 2, 3]
    assert not (out / "checkpoints" / ".download-step-000002").exists()  # the failed download left nothing
    # the re-trained step-2 was mirrored over the tampered S3 copy: it verifies again
    st.get_folder(prefix + "/step-000002", tmp_path / "check")


def test_a_crash_marks_the_run_failed_and_keeps_the_checkpoints(
    services_env, tiny_model_dir, prompts_file, tmp_path, monkeypatch
):
    """A run that dies of an error (here a diverged loss at iteration 2) is not left RUNNING in MLflow:
    it is FAILED, its metrics so far arrived, and the checkpoints written before stay complete."""
    from mlflow import MlflowClient

    from chunkgrpo.train.context import NonFiniteLossError

    def diverge():
        raise NonFiniteLossError("non-finite loss at optimizer step 3")

    _on_iteration(monkeypatch, {2: diverge})
    out = tmp_path / "run"
    with pytest.raises(NonFiniteLossError):
        run_training(_cfg(tiny_model_dir, prompts_file, out, "max_steps=5", "tracking.experiment=crashed"))
    client = MlflowClient()
    (run,) = client.search_runs([client.get_experiment_by_name("crashed").experiment_id])
    assert run.info.status == "FAILED"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "reward/mean")) == [1, 2]
    assert [p.name for p in ckpt.complete_checkpoints(out / "checkpoints")] == ["step-000001", "step-000002"]
    assert not (out / "final").exists()

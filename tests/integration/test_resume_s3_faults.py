"""S3 faults while resuming, against a real SeaweedFS of the test's own: an
unreachable or hung (SIGSTOP) S3 is retried with backoff for `checkpoint.s3_wait_s`, then the run
stops with one line — it never starts from scratch while S3 may hold its checkpoints; with local
checkpoints it resumes from them, saying so; a clock skewed beyond S3's limit is one line too."""

from __future__ import annotations

import logging
import os
import signal
import time

import pytest

from chunkgrpo.errors import UserError
from chunkgrpo.store import StoreError
from chunkgrpo.store.client import ArtifactStore
from chunkgrpo.train.config import TrainConfig
from chunkgrpo.train.trainer import run_training
from tests.fixtures_services import _need_weed

pytestmark = pytest.mark.integration  # starts a SeaweedFS of its own


@pytest.fixture
def own_s3(tmp_path, monkeypatch):
    """A SeaweedFS only this test uses (it is stopped, frozen or killed here); always stopped at the end."""
    _need_weed()
    from chunkgrpo.processes import free_port
    from chunkgrpo.services import LocalServices, LocalServicesConfig

    svc = LocalServices(LocalServicesConfig(home=str(tmp_path / "svc"), s3_port=free_port(), mlflow=False))
    svc.up()
    for k, v in svc.env().items():
        if not k.startswith("MLFLOW"):
            monkeypatch.setenv(k, v)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    try:
        yield svc
    finally:
        rec = svc._load_state().get("services", {}).get("s3")
        if rec:
            try:
                os.killpg(rec["pgid"], signal.SIGCONT)  # a frozen server must run to stop
            except OSError:
                pass
        svc.down()


def _cfg(model, prompts, out, *over):
    p = prompts
    p.write_text("a cat on a chair\na red car\n")
    return TrainConfig.load(
        "tiny_cpu",
        [
            f"model={model}",
            f"prompts={p}",
            f"output_dir={out}",
            "progress=false",
            "tracking.image_every=0",
            "max_steps=1",
            "checkpoint.every=1",
            "checkpoint.s3_prefix=s3://chunkgrpo/runs/faults",
            *over,
        ],
    )


def test_s3_down_while_resuming_fails_in_one_line_after_the_wait(own_s3, tiny_model_dir, tmp_path, caplog):
    own_s3.down()
    out = tmp_path / "run"
    t0 = time.monotonic()
    with pytest.raises(StoreError, match="refusing to start from scratch") as e:
        run_training(_cfg(tiny_model_dir, tmp_path / "p.txt", out, "checkpoint.s3_wait_s=6"))
    took = time.monotonic() - t0
    assert len(str(e.value).splitlines()) == 1 and "s3://chunkgrpo/runs/faults" in str(e.value)
    assert 3 <= took < 60, took  # it waited (backoff), and not forever
    assert "retrying in" in caplog.text
    assert not list((out / "checkpoints").glob("step-*")) and not (out / "final").exists()  # nothing trained


def test_hung_s3_hits_a_timeout_then_falls_back_to_local_checkpoints(
    own_s3, tiny_model_dir, tmp_path, caplog
):
    out = tmp_path / "run"
    run_training(_cfg(tiny_model_dir, tmp_path / "p.txt", out))  # step-1 locally and in S3
    pgid = own_s3._load_state()["services"]["s3"]["pgid"]
    os.killpg(pgid, signal.SIGSTOP)  # accepts connections (kernel backlog), never answers
    caplog.set_level(logging.INFO)
    t0 = time.monotonic()
    # resume only (setup): a further step's mirror could not finish against a frozen S3
    from chunkgrpo.train.trainer import Trainer

    t = Trainer(_cfg(tiny_model_dir, tmp_path / "p.txt", out, "checkpoint.s3_wait_s=3"))
    try:
        t.setup()
    finally:
        t.close()
    took = time.monotonic() - t0
    assert t.opt_step == 1  # resumed from the local step-1
    assert "S3 unreachable for" in caplog.text and "resuming from the local checkpoints" in caplog.text
    assert took < 60, took


def test_hung_s3_without_local_checkpoints_fails_in_one_line(own_s3, tiny_model_dir, tmp_path):
    os.killpg(own_s3._load_state()["services"]["s3"]["pgid"], signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(StoreError, match="refusing to start from scratch"):
        run_training(_cfg(tiny_model_dir, tmp_path / "p.txt", tmp_path / "run", "checkpoint.s3_wait_s=2"))
    assert time.monotonic() - t0 < 60


def test_clock_skew_is_one_line(own_s3, monkeypatch):
    import datetime as dt

    import minio.time

    real = minio.time.utcnow
    monkeypatch.setattr(minio.time, "utcnow", lambda: real() + dt.timedelta(hours=2))
    with pytest.raises(UserError, match="RequestTimeTooSkewed") as e:
        ArtifactStore().list("s3://chunkgrpo/runs/")
    assert len(str(e.value).splitlines()) == 1


def test_hung_s3_during_training_fails_the_mirror_attempt_within_its_timeout(own_s3, tmp_path):
    """A frozen S3 (SIGSTOP: connections accepted, never answered) while a checkpoint uploads: the
    trainer's mirror client gives up on the request after `checkpoint.mirror_timeout_s` and reports
    failing, so pruning decides (keep beyond `keep` within the backlog, or stop in one line) instead of
    training stalling on the socket for the store's upload-sized timeout × its retries."""
    from chunkgrpo.train import checkpoint_format as ckpt
    from chunkgrpo.train.checkpoint_policy import mirror_store

    folder = tmp_path / "step-000001"
    folder.mkdir()
    (folder / "weights.bin").write_bytes(os.urandom(1 << 20))
    cfg = TrainConfig.load("tiny_cpu", ["checkpoint.mirror_timeout_s=3"])
    store = mirror_store(cfg)
    assert store.config.read_timeout_s == 3 and store.config.retries == 1
    pgid = own_s3._load_state()["services"]["s3"]["pgid"]
    os.killpg(pgid, signal.SIGSTOP)
    mirror = ckpt.Mirror("s3://chunkgrpo/runs/hung", store_factory=lambda: mirror_store(cfg), backoff_s=30)
    try:
        t0 = time.monotonic()
        mirror.submit(folder)
        still_pending = mirror.settle(folder)
        took = time.monotonic() - t0
    finally:
        os.killpg(pgid, signal.SIGCONT)
        mirror.close()
    assert still_pending and mirror.failing, (still_pending, mirror.failing, mirror.last_error)
    # it waited on the frozen server for one 3 s timeout: not 300 s × 6 attempts, nor a second read
    assert 2.5 <= took < 5.5, took
    assert folder.exists()  # nothing deleted

"""The retry wait of the background delivery loops (`chunkgrpo/backoff.py`) and its use by the MLflow
tracker and the S3 checkpoint mirror: a long backoff while nobody waits, a short one while somebody waits
for the queue to drain, and a drain that starts mid-backoff ends it at once."""

from __future__ import annotations

import threading
import time

import pytest

from chunkgrpo.backoff import retry_wait


def _timed(cv, stop, draining, delay, drain):
    t0 = time.monotonic()
    with cv:
        stopped = retry_wait(cv, stop, draining, delay, drain)
    return stopped, time.monotonic() - t0


def test_without_a_drain_the_full_delay_is_waited():
    stopped, took = _timed(threading.Condition(), lambda: False, lambda: False, 0.4, 0.05)
    assert not stopped and took >= 0.35


def test_while_draining_the_wait_is_cut_to_the_drain_retry():
    stopped, took = _timed(threading.Condition(), lambda: False, lambda: True, 30.0, 0.1)
    assert not stopped and took < 5.0


def test_a_drain_starting_mid_backoff_ends_the_wait_and_stop_is_reported():
    cv, state = threading.Condition(), {"draining": False, "stop": False}

    def later(key):
        time.sleep(0.2)
        with cv:
            state[key] = True
            cv.notify_all()

    threading.Thread(target=later, args=("draining",), daemon=True).start()
    stopped, took = _timed(cv, lambda: state["stop"], lambda: state["draining"], 30.0, 10.0)
    assert not stopped and 0.15 <= took < 10.0
    threading.Thread(target=later, args=("stop",), daemon=True).start()
    stopped, took = _timed(cv, lambda: state["stop"], lambda: state["draining"], 30.0, 20.0)
    assert stopped and took < 10.0


@pytest.mark.parametrize("delay,drain", [(-1.0, 1.0), (1.0, 0.0)])
def test_bad_waits_are_refused_naming_them(delay, drain):
    with pytest.raises(ValueError, match=f"got {delay}, {drain}"), threading.Condition() as cv:
        retry_wait(cv, lambda: False, lambda: False, delay, drain)


class _Flaky:
    """A store (or MLflow client) that fails its first `fails` calls, then answers."""

    def __init__(self, fails: int):
        self.fails, self.calls = fails, []

    def __call__(self, *args, **kwargs):
        self.calls.append(time.monotonic())
        if len(self.calls) <= self.fails:
            raise ConnectionRefusedError("down")


def test_the_mirror_retries_soon_once_somebody_waits_and_not_before(tmp_path):
    from chunkgrpo.train import checkpoint_format as ckpt

    d = ckpt.step_dir(tmp_path, 1)
    d.mkdir()
    flaky = _Flaky(fails=1)

    class Store:
        def put_folder(self, path, uri, meta=None):
            flaky()

    m = ckpt.Mirror("s3://bucket/ckpt", store_factory=Store, backoff_s=60.0, drain_retry_s=0.2)
    try:
        m.submit(d)
        time.sleep(1.0)
        assert len(flaky.calls) == 1 and m.failing  # backing off 60 s: nobody waits yet
        t0 = time.monotonic()
        assert m.wait(30)
        assert time.monotonic() - t0 < 10 and len(flaky.calls) == 2  # retried at once, not after 60 s
        assert m.uploaded == ["s3://bucket/ckpt/step-000001"] and not m.failing
    finally:
        m.close()


def test_the_tracker_closing_retries_soon_and_delivers_the_runs_end(monkeypatch):
    from chunkgrpo import tracking

    flaky = _Flaky(fails=1)
    ended = []

    class Client:
        def set_terminated(self, run_id, status):
            ended.append((run_id, status))

    def open_run(client):
        flaky()
        return "run-1", "0"

    monkeypatch.setattr(tracking, "_client", Client)
    t = tracking.BackgroundTracker(open_run, backoff_s=60.0, drain_retry_s=0.2, flush_timeout_s=30)
    try:
        t.set_tags({"a": "b"})
        deadline = time.monotonic() + 30
        while t.failures < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.5)
        assert len(flaky.calls) == 1  # backing off 60 s while the run is open
        t0 = time.monotonic()
        assert t.close("FINISHED")
        assert time.monotonic() - t0 < 10 and ended == [("run-1", "FINISHED")]
    finally:
        t.close("FINISHED", timeout=0)

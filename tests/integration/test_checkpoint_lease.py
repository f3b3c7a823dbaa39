"""One training per checkpoint prefix, against the shared real SeaweedFS: a second live writer (another
output dir or seed) is refused in one line naming the holder; a retried pod of the same run takes its lease
back; a lease whose heartbeat is older than its expiry is taken over; two writers racing for a free lease
cannot both win (S3 conditional writes)."""

from __future__ import annotations

import json
import logging
import threading
import time

import pytest

from chunkgrpo.errors import UserError
from chunkgrpo.store.client import ArtifactStore
from chunkgrpo.train.config import TrainConfig
from chunkgrpo.train.lease import LEASE_NAME, LeaseLostError, WriterLease
from chunkgrpo.train.trainer import Trainer, run_training

pytestmark = pytest.mark.integration  # real SeaweedFS (the services fixture)


@pytest.fixture
def prefix(services_env, request):
    return f"s3://chunkgrpo/runs/lease/{request.node.name}-{time.time_ns()}"


def _lease(prefix, out="/runs/a", seed=1, expires_s=60.0, clock=time.time):
    return WriterLease(ArtifactStore(), prefix, output_dir=out, seed=seed, expires_s=expires_s, clock=clock)


def test_a_second_live_writer_is_refused_naming_the_holder(prefix):
    a = _lease(prefix)
    a.acquire()
    for out, seed in (("/runs/b", 1), ("/runs/a", 2)):  # another output dir, or another seed
        with pytest.raises(UserError) as e:
            _lease(prefix, out, seed).acquire()
        assert len(str(e.value).splitlines()) == 1 and "output_dir=/runs/a seed=1" in str(e.value)
    holder = json.loads(ArtifactStore().get_bytes(f"{prefix}/{LEASE_NAME}"))
    assert holder["output_dir"] == "/runs/a" and holder["expires_s"] == 60.0
    a.release()
    _lease(prefix, "/runs/b").acquire()  # released: free for another run


def test_the_same_run_takes_its_lease_back_and_a_stale_one_is_taken_over(prefix, caplog):
    a = _lease(prefix)
    a.acquire()
    a.stop()  # the pod dies: the lease stays
    again = _lease(prefix)  # a retried pod of the same run (same output dir and seed)
    again.acquire()
    with pytest.raises(UserError):
        _lease(prefix, "/runs/b").acquire()
    caplog.set_level(logging.WARNING)
    later = _lease(prefix, "/runs/b", clock=lambda: time.time() + 61)  # heartbeat older than its expiry
    later.acquire()
    assert "was stale; taken over" in caplog.text
    with pytest.raises(LeaseLostError, match="taken over"):
        again.renew()  # the old holder learns it at its next heartbeat


def test_two_writers_racing_for_a_free_lease_cannot_both_win(prefix):
    won, refused = [], []
    start = threading.Barrier(4)

    def take(i: int) -> None:
        start.wait()
        try:
            _lease(prefix, f"/runs/{i}").acquire()
            won.append(i)
        except UserError:
            refused.append(i)

    threads = [threading.Thread(target=take, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(won) == 1 and len(refused) == 3, (won, refused)


def _cfg(model, prompts, out, prefix, *over):
    return TrainConfig.load("tiny_cpu", [f"model={model}", f"prompts={prompts}", f"output_dir={out}",
                                         "progress=false", "tracking.image_every=0", "max_steps=1",
                                         "checkpoint.every=1", "checkpoint.mirror_wait_s=30",
                                         f"checkpoint.s3_prefix={prefix}", *over])


def test_two_trainings_mirroring_to_one_prefix_the_second_is_refused(prefix, tiny_model_dir, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat on a chair\na red car\n")
    first = Trainer(_cfg(tiny_model_dir, prompts, tmp_path / "a", prefix))
    try:
        first.setup()  # holds the lease while it trains
        with pytest.raises(UserError) as e:
            run_training(_cfg(tiny_model_dir, prompts, tmp_path / "b", prefix, "seed=7"))
        assert len(str(e.value).splitlines()) == 1 and str((tmp_path / "a").resolve()) in str(e.value)
        assert not list((tmp_path / "b").glob("checkpoints/step-*"))
    finally:
        first.close()
    run_training(_cfg(tiny_model_dir, prompts, tmp_path / "a", prefix))  # the same run, retried: resumes
    assert [u.rsplit("/", 1)[-1] for u in ArtifactStore().list_complete(prefix)] == ["step-000001"]


def test_a_retried_pod_with_a_fresh_output_dir_takes_its_runs_lease_back_by_writer_id(prefix):
    dead = WriterLease(ArtifactStore(), prefix, output_dir="/cache/tmpa", seed=1, expires_s=60,
                       writer_id="run-1")
    dead.acquire()
    dead.stop()
    WriterLease(ArtifactStore(), prefix, output_dir="/cache/tmpb", seed=1, expires_s=60,
                writer_id="run-1").acquire()
    with pytest.raises(UserError, match="writer_id=run-1"):
        WriterLease(ArtifactStore(), prefix, output_dir="/cache/tmpc", seed=1, expires_s=60,
                    writer_id="run-2").acquire()

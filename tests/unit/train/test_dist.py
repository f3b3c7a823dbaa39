"""`dist.wait_all`: ranks agree on a single-rank phase's outcome through the c10d key-value store (a real
TCPStore here, threads as ranks), outside any collective: the waiting ranks say what they wait for, a
failure reaches every rank, and a hang fails naming its phase within the deadline."""

from __future__ import annotations

import re
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from chunkgrpo.train import dist as D


@pytest.fixture
def store():
    s = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    yield s


def _ranks(store, world, work, **kw):
    """Run `work(rank)` -> failed flag, then wait_all, on `world` threads; returns per rank (result, lines,
    seconds) where result is the failed ranks or the exception."""
    out = {}

    def one(rank):
        lines = []
        t0 = time.monotonic()
        try:
            failed = work(rank)
            res = D.wait_all(kw.get("phase", "model fetch"), failed, deadline_s=kw.get("deadline", 30.0),
                             progress_s=kw.get("progress", 0.3), store=store, rank=rank, world=world,
                             say=lines.append)
        except Exception as e:
            res = e
        out[rank] = (res, lines, time.monotonic() - t0)

    threads = [threading.Thread(target=one, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return out


def test_waiting_ranks_say_what_they_wait_for(store):
    out = _ranks(store, 3, lambda r: time.sleep(1.2 if r == 0 else 0) or False)
    for rank in range(3):
        assert out[rank][0] == []
    assert out[0][1] == []  # the rank that did the work waited for nobody
    for rank in (1, 2):
        lines = out[rank][1]
        assert lines, rank
        assert all(re.fullmatch(r"waiting for rank 0: model fetch, \d+ s of 30 s", x) for x in lines), lines
        assert out[rank][2] >= 1.1  # they waited for rank 0


def test_a_failure_reaches_every_rank(store):
    out = _ranks(store, 3, lambda r: r == 0)
    assert [out[r][0] for r in range(3)] == [[0], [0], [0]]


def test_a_hang_fails_naming_its_phase_within_the_deadline(store):
    """Rank 0 never finishes its phase: rank 1 fails within its deadline, naming the phase and rank."""
    lines = []
    t0 = time.monotonic()
    with pytest.raises(D.PhaseTimeout, match=r"^checkpoint save: rank 0 not done within 1 s"):
        D.wait_all("checkpoint save", False, deadline_s=1.0, progress_s=0.4, store=store, rank=1, world=2,
                   say=lines.append)
    assert 0.9 <= time.monotonic() - t0 < 3.0
    assert lines and "waiting for rank 0: checkpoint save" in lines[0]


def test_each_call_of_a_phase_has_its_own_keys(store):
    # rank 0 posts its first export (world 1: it waits for nobody); rank 1's first call meets it, its second
    # waits for a second call of rank 0 that never comes
    assert D.wait_all("export", False, deadline_s=5, store=store, rank=0, world=1) == []
    assert D.wait_all("export", False, deadline_s=5, store=store, rank=1, world=2) == []
    with pytest.raises(D.PhaseTimeout, match="export: rank 0 not done"):
        D.wait_all("export", False, deadline_s=0.5, store=store, rank=1, world=2)


def test_single_process_needs_no_store():
    assert D.wait_all("model fetch", False, deadline_s=1) == []
    assert D.wait_all("model fetch", True, deadline_s=1) == [0]

"""The thread policy (chunkgrpo.threads): passive OpenMP waits set before torch loads, torch threads capped
at the cores the process may use, one clear error for a bad setting."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from chunkgrpo import threads
from tests.repo_copy import ROOT


def _py(code: str, **env) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items()
            if k not in ("OMP_WAIT_POLICY", "KMP_BLOCKTIME", "OMP_NUM_THREADS", "CHUNKGRPO_THREADS",
                         "CHUNKGRPO_THREAD_POLICY")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**base, "PYTHONPATH": str(ROOT), **env})


def test_importing_chunkgrpo_sets_the_passive_wait_policy_before_torch_loads():
    r = _py("import chunkgrpo, os, sys; print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)")
    assert r.stdout.split() == ["PASSIVE", "False"], r.stderr
    # the user's own choice is kept; the legacy policy (for before/after measurements) sets nothing
    kept = _py("import chunkgrpo, os; print(os.environ['OMP_WAIT_POLICY'])", OMP_WAIT_POLICY="ACTIVE")
    assert kept.stdout.strip() == "ACTIVE"
    r = _py("import chunkgrpo, os; print(os.environ.get('OMP_WAIT_POLICY'))",
            CHUNKGRPO_THREAD_POLICY="legacy")
    assert r.stdout.strip() == "None"
    # the short-spin policy: a bounded libgomp spin instead of passive waiting, the user's value kept
    r = _py("import chunkgrpo, os; print(os.environ.get('OMP_WAIT_POLICY'), os.environ['GOMP_SPINCOUNT'])",
            CHUNKGRPO_THREAD_POLICY="spin")
    assert r.stdout.split() == ["None", threads.SPIN_COUNT], r.stderr
    r = _py("import chunkgrpo, os; print(os.environ['GOMP_SPINCOUNT'])", CHUNKGRPO_THREAD_POLICY="spin",
            GOMP_SPINCOUNT="500")
    assert r.stdout.strip() == "500"


def test_thread_count_order_and_caps(monkeypatch):
    monkeypatch.setattr(threads, "available_cores", lambda: 4)
    assert threads.thread_count(environ={}) == 4
    assert threads.thread_count(2, environ={"CHUNKGRPO_THREADS": "3"}) == 2  # the argument first
    assert threads.thread_count(environ={"CHUNKGRPO_THREADS": "3", "OMP_NUM_THREADS": "1"}) == 3
    assert threads.thread_count(environ={"OMP_NUM_THREADS": "1,1"}) == 1
    assert threads.thread_count(16, environ={}) == 4  # never more than the available cores
    assert threads.thread_count(environ={"CHUNKGRPO_THREADS": "0"}) == 4  # 0 = all
    # torchrun ranks of one node share its cores
    assert threads.thread_count(environ={"LOCAL_WORLD_SIZE": "2"}) == 2
    assert threads.thread_count(environ={"LOCAL_WORLD_SIZE": "8"}) == 1
    assert threads.thread_count(4, environ={"LOCAL_WORLD_SIZE": "2"}) == 2


def test_available_cores_is_the_affinity_mask_not_the_machine():
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no CPU affinity on this platform")
    r = _py("import os; os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]}); "
            "from chunkgrpo import threads; threads.configure(); import torch; "
            "print(threads.available_cores(), torch.get_num_threads())")
    assert r.stdout.split() == ["1", "1"], r.stderr


def test_configure_applies_the_override_before_and_after_torch_loads():
    before = _py("from chunkgrpo import threads; threads.configure(); import torch; "
                 "print(torch.get_num_threads())", CHUNKGRPO_THREADS="1")
    after = _py("import torch; from chunkgrpo import threads; threads.configure(); "
                "print(torch.get_num_threads())", CHUNKGRPO_THREADS="1")
    assert before.stdout.strip() == after.stdout.strip() == "1", (before.stderr, after.stderr)


@pytest.mark.parametrize("env, bad", [({"CHUNKGRPO_THREADS": "two"}, "CHUNKGRPO_THREADS='two'"),
                                      ({"CHUNKGRPO_THREADS": "-1"}, "CHUNKGRPO_THREADS='-1'"),
                                      ({"CHUNKGRPO_THREAD_POLICY": "spinning"},
                                       "CHUNKGRPO_THREAD_POLICY='spinning'")])
def test_a_bad_setting_is_one_line_exit_2(env, bad):
    r = subprocess.run([sys.executable, "-m", "chunkgrpo", "local", "status", "--home", "/nonexistent-x"],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT), **env})
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.strip().count("\n") == 0 and bad in r.stderr and "Traceback" not in r.stderr


def test_xdist_workers_share_the_cores():
    """Under pytest-xdist each worker gets its share of the cores (tests/fixtures_services.py), as torchrun's
    ranks do: two 2-thread workers on 2 cores would oversubscribe them."""
    import torch

    from tests import fixtures_services

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    if workers < 2 or fixtures_services.USER_THREADS is not None:
        pytest.skip("not run by several xdist workers (or $CHUNKGRPO_THREADS chosen by the user)")
    assert torch.get_num_threads() == max(1, threads.available_cores() // workers)

"""The thread policy (chunkgrpo.threads): passive OpenMP waits set before torch loads, torch threads capped
at the cores the process may use, one clear error for a bad setting."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from chunkgrpo import threads
from tests.repo_copy import ROOT


def _py_env(**env) -> dict:
    """This environment without the thread settings (the test process has them), plus `env`."""
    base = {k: v for k, v in os.environ.items()
            if k not in ("OMP_WAIT_POLICY", "KMP_BLOCKTIME", "OMP_NUM_THREADS", "CHUNKGRPO_THREADS",
                         "CHUNKGRPO_THREAD_POLICY", "GOMP_SPINCOUNT")}
    return {**base, "PYTHONPATH": str(ROOT), **env}


def _py(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=_py_env(**env))


def test_importing_chunkgrpo_changes_no_environment():
    r = _py("import os, chunkgrpo, chunkgrpo.cli; print(os.environ.get('OMP_WAIT_POLICY'), "
            "os.environ.get('KMP_BLOCKTIME'))")
    assert r.stdout.split() == ["None", "None"], r.stderr


PROBE = """
import os, runpy, sys
from chunkgrpo import cli

def main(argv=None):  # stands in for the command line: what the entry point set up before calling it
    print(os.environ.get("OMP_WAIT_POLICY"), "torch" in sys.modules)
    return 0

cli.main = main
runpy.run_module(sys.argv[1], run_name="__main__")
"""


@pytest.mark.parametrize("entry", ["chunkgrpo", "chunkgrpo.train"])
def test_the_module_entry_points_set_the_passive_wait_policy_before_torch_loads(entry):
    """`python -m chunkgrpo` and `python -m chunkgrpo.train` (torchrun's workers): the policy is in the
    environment before the command line runs, and torch is not loaded yet."""
    r = subprocess.run([sys.executable, "-c", PROBE, entry], capture_output=True, text=True, timeout=120,
                       env=_py_env())
    assert r.stdout.split() == ["PASSIVE", "False"], r.stderr


TORCHRUN_PROBE = """
import os, sys, types
run = types.ModuleType("torch.distributed.run")  # torch stands in: what the launcher's environment holds
def parse_args(argv):  # the launcher's first use of torch: print what the environment holds by then
    print(os.environ.get("OMP_WAIT_POLICY"))
    raise SystemExit(0)
run.parse_args = parse_args
dist = types.ModuleType("torch.distributed")
dist.run = run
torch = types.ModuleType("torch")
torch.distributed = dist
sys.modules.update({"torch": torch, "torch.distributed": dist, "torch.distributed.run": run})
from chunkgrpo import torchrun_local
torchrun_local._loopback_store = lambda: None
torchrun_local.main([])
"""


def test_the_torchrun_launcher_sets_the_policy_before_torch_loads():
    """`python -m chunkgrpo.torchrun_local`: its ranks inherit the launcher's environment."""
    r = _py(TORCHRUN_PROBE)
    assert r.stdout.strip() == "PASSIVE", r.stderr


def test_the_cli_sets_the_policy_and_keeps_the_users_choice():
    code = ("import os, sys\nfrom chunkgrpo import cli\n"
            "try:\n    cli.main(['--version'])\nexcept SystemExit:\n    pass\n"
            "print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)")
    r = _py(code)
    assert r.stdout.split()[-2:] == ["PASSIVE", "False"], r.stderr
    # the user's own choice is kept; the legacy policy (for before/after measurements) sets nothing
    assert _py(code, OMP_WAIT_POLICY="ACTIVE").stdout.split()[-2] == "ACTIVE"
    assert _py(code, CHUNKGRPO_THREAD_POLICY="legacy").stdout.split()[-2] == "None"


def test_set_env_policy_choices():
    env = {}
    threads.set_env_policy(env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}
    threads.set_env_policy(env := {"OMP_WAIT_POLICY": "ACTIVE"})
    assert env["OMP_WAIT_POLICY"] == "ACTIVE"  # the user's choice is kept
    threads.set_env_policy(env := {threads.ENV_POLICY: "legacy"})
    assert env == {threads.ENV_POLICY: "legacy"}
    # the short-spin policy: a bounded libgomp spin instead of passive waiting, the user's value kept
    threads.set_env_policy(env := {threads.ENV_POLICY: "spin"})
    assert env.get("OMP_WAIT_POLICY") is None and env["GOMP_SPINCOUNT"] == threads.SPIN_COUNT
    threads.set_env_policy(env := {threads.ENV_POLICY: "spin", "GOMP_SPINCOUNT": "500"})
    assert env["GOMP_SPINCOUNT"] == "500"


def test_scorer_workers_get_the_policy_in_their_environment(monkeypatch):
    from chunkgrpo.scoring import client

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv(threads.ENV_POLICY, raising=False)
    monkeypatch.setattr(client, "stage_modules", lambda modules: "staged")
    assert client.worker_env()["OMP_WAIT_POLICY"] == "PASSIVE"


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

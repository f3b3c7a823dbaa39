"""The two test tiers (a pytest plugin, loaded by tests/conftest.py and components/conftest.py).

    .venv/bin/python -m pytest -q -n 2 -m "not integration and not reward_envs"    # the fast tier
    .venv/bin/python -m pytest -q -n 2                                             # everything (CI)

The fast tier starts no server (SeaweedFS, MLflow, the promoter), no torchrun job and no kfp.local
pipeline; the tests that do carry the `integration` marker. This plugin keeps the fast tier honest: a test
without the marker fails at once, before anything starts, when

* it asks for a fixture that starts servers or a kfp.local runner (`SERVICE_FIXTURES`), or
* it launches one of those processes itself (`launch_kind` of the command line, checked in
  `subprocess.Popen`, through which torchrun, the servers and kfp.local tasks all start).
"""

from __future__ import annotations

import os
import subprocess

import pytest

SERVICE_FIXTURES = frozenset({"services", "services_env", "local_runner"})
MARKER = "integration"


class FastTierLaunchError(RuntimeError):
    """A test without the integration marker started a server, torchrun or kfp.local."""


def launch_kind(args) -> str | None:
    """What a command line starts that only an integration test may start ("SeaweedFS", "MLflow server",
    "the promoter", "torchrun", "kfp.local task"), or None. A command that starts them in a child of its
    own (`chunkgrpo local up`, `chunkgrpo pipeline run --local`) is seen where the child starts them, in
    that process, so a test running such a command carries the marker by review, not by this check."""
    argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
    words = [w for a in argv for w in os.fsdecode(a).split()]
    names = [os.path.basename(w) for w in words]
    text = " ".join(words)
    if "weed" in names:
        return "SeaweedFS"
    if "mlflow server" in text:
        return "MLflow server"
    if "chunkgrpo.promoter" in words:
        return "the promoter"
    if "torchrun" in names or {"torch.distributed.run", "chunkgrpo.torchrun_local"} & set(words):
        return "torchrun"
    if "kfp.dsl.executor_main" in text:
        return "kfp.local task"
    return None


_current: list = []  # the test item running now (empty between tests)


def check_launch(args, item=None) -> None:
    """Raise FastTierLaunchError when `item` (default: the running test) lacks the integration marker and
    `args` starts a server, torchrun or kfp.local."""
    item = item if item is not None else (_current[-1] if _current else None)
    if item is None or item.get_closest_marker(MARKER) is not None:
        return
    kind = launch_kind(args)
    if kind:
        raise FastTierLaunchError(f"{item.nodeid} starts {kind} but is not marked `integration` "
                                  f"(mark it: the fast tier starts no servers, torchrun or kfp.local)")


_popen_init = subprocess.Popen.__init__


def _guarded_popen_init(self, args, *a, **k):
    check_launch(args)
    _popen_init(self, args, *a, **k)


def pytest_configure(config):
    subprocess.Popen.__init__ = _guarded_popen_init


def pytest_unconfigure(config):
    subprocess.Popen.__init__ = _popen_init


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current.append(item)
    try:
        yield
    finally:
        _current.pop()


def pytest_runtest_setup(item):
    used = sorted(SERVICE_FIXTURES & set(getattr(item, "fixturenames", ())))
    if used and item.get_closest_marker(MARKER) is None:
        raise FastTierLaunchError(f"{item.nodeid} uses {', '.join(used)} (servers / kfp.local) but is not "
                                  f"marked `integration`")

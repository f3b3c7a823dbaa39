"""The test session's own temp folder (a pytest plugin of tests/conftest.py and components/conftest.py).

TMPDIR (inherited by every subprocess the tests start: kfp.local tasks, torchrun ranks, servers) and
`tempfile.tempdir` point at `<basetemp>/tmp`, so whatever the code under test leaves in its temp folder
lands inside pytest's basetemp (pytest keeps the last three) instead of the machine's /tmp. At the end the
session prints one warning line naming what was left there: the producers are expected to remove their
scratch (`chunkgrpo.tempdirs`); the line is a report, not a failure. It is printed when the
process exits, after the exit handlers registered later (those that stop scorer workers and remove their
staged folders). xdist workers inherit the controller's folder, which reports for all of them.
"""

from __future__ import annotations

import atexit
import os
import sys
import tempfile
from pathlib import Path

import pytest

NAME = "tmp"  # <basetemp>/tmp: short, for Unix socket paths made under it (at most 107 bytes)


@pytest.hookimpl(trylast=True)  # after the tmpdir plugin's pytest_configure made the basetemp factory
def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER") or not hasattr(config, "_tmp_path_factory"):
        return  # a worker: TMPDIR is the controller's, inherited
    folder = config._tmp_path_factory.getbasetemp() / NAME
    folder.mkdir(exist_ok=True)
    # torch.compile's kernel cache stays where torch keeps it for this user (the machine's temp folder, keyed
    # by content): a cold cache costs the compiling tests tens of seconds on every run
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", inductor_cache_dir())
    os.environ["TMPDIR"] = str(folder)
    tempfile.tempdir = str(folder)
    atexit.register(report, folder)


def inductor_cache_dir() -> str:
    """Where torch's inductor keeps its cache when TMPDIR is the machine's (its `default_cache_dir`)."""
    import getpass

    user = "".join(c if c.isalnum() or c in "-_" else "_" for c in getpass.getuser())
    return os.path.join(tempfile.gettempdir(), f"torchinductor_{user}")


def expected() -> set[str]:
    """Folders with one fixed name per user by design, not a run's scratch: torch's inductor cache (made by
    importing diffusers) and the basetemp of a pytest run that a test starts."""
    import getpass

    user = getpass.getuser()
    return {f"torchinductor_{user}", f"pytest-of-{user}"}


def left_behind(folder: Path | None) -> list[str]:
    try:
        return sorted(p.name for p in folder.iterdir() if p.name not in expected()) if folder else []
    except OSError:
        return []


def report(folder: Path) -> None:
    names = left_behind(folder)
    if names:
        shown = ", ".join(names[:12]) + (f", ... ({len(names)} in all)" if len(names) > 12 else "")
        print(f"warning: the tests' temp folder {folder} holds {len(names)} entries nobody removed: {shown}",
              file=sys.stderr, flush=True)

"""SIGTERM to a pytest session run as README's test command runs it (pytest-xdist, two workers) leaves no
server behind: the controller passes the signal on to its workers and waits while they unwind their fixtures
(`tests/fixtures_services.py`), before it stops itself. A CI job's timeout signals the controller only; on its
own, xdist gives a worker `NodeManager.EXIT_TIMEOUT` (10 s) and then kills it, and a worker whose running
test first stops a pipeline command (up to a minute: its tasks, then its servers) would be killed with its
session's servers still running. The held test below stands for that: its teardown takes longer than xdist
waits. The session lowers that wait to XDIST_WAIT_S (its conftest sets `NodeManager.EXIT_TIMEOUT`), so the
hold outlasting it costs seconds; what is tested (the controller waits for its workers, whatever xdist's
own wait) does not depend on the value."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.repo_copy import ROOT

pytestmark = pytest.mark.integration

XDIST_WAIT_S = 2  # xdist's own wait for a stopping worker in the held session (10 s by default)

HOLD = '''
import json, os, pathlib, time

import pytest

@pytest.fixture
def slow_teardown():
    yield
    time.sleep(float(os.environ["CHUNKGRPO_TEST_TEARDOWN_S"]))  # torn down before `services`

def test_hold_the_servers(services, slow_teardown):
    mark = pathlib.Path(os.environ["CHUNKGRPO_TEST_MARKS"]) / f"{os.getpid()}.json"
    mark.write_text(json.dumps({"home": str(services.home), "env": services.env}))
    time.sleep(900)
'''


def _alive_with(needle: str) -> list[str]:
    import psutil

    found = []
    for p in psutil.process_iter():
        try:
            line = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if needle in line and p.pid != os.getpid():
            found.append(f"{p.pid}: {line[:160]}")
    return found


@pytest.mark.parametrize("to", ["controller", "group"])
def test_sigterm_to_an_xdist_session_stops_every_workers_servers(tmp_path, to):
    """`controller`: a CI timeout signals the pytest process; `group`: `kill -- -PGID` signals it and its
    workers at once, so each worker also gets the controller's SIGTERM while it unwinds."""
    from chunkgrpo.processes import port_in_use

    session = tmp_path / "session"
    marks = tmp_path / "marks"
    session.mkdir()
    marks.mkdir()
    (session / "pytest.ini").write_text("[pytest]\n")
    (session / "conftest.py").write_text(
        'pytest_plugins = ["tests.fixtures_services"]\n'
        f"from xdist.workermanage import NodeManager\nNodeManager.EXIT_TIMEOUT = {XDIST_WAIT_S}\n")
    for name in ("test_a.py", "test_b.py"):  # loadfile: one file per worker
        (session / name).write_text(HOLD)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CHUNKGRPO_TEST_MARKS": str(marks),
           "CHUNKGRPO_TEST_TEARDOWN_S": str(XDIST_WAIT_S + 2)}  # outlasts xdist's own wait
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadfile",
         f"--basetemp={tmp_path / 'base'}", "."],
        cwd=session, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )
    held: list[dict] = []
    try:
        deadline = time.monotonic() + 600
        while len(list(marks.glob("*.json"))) < 2:
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "the workers' servers did not come up"
            time.sleep(0.5)
        held = [json.loads(m.read_text()) for m in marks.glob("*.json")]
        ports = [int(h["env"][k].rsplit(":", 1)[1].split("/")[0])
                 for h in held for k in ("MLFLOW_TRACKING_URI", "CHUNKGRPO_S3_ENDPOINT")]
        assert all(port_in_use(p) for p in ports), ports
        assert all(_alive_with(h["home"]) for h in held)  # each worker's weed + mlflow run meanwhile
        if to == "controller":
            os.kill(proc.pid, signal.SIGTERM)  # the controller only, as a CI timeout does
        else:
            os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if not held:  # failed before both workers' servers were up: those that were
            held = [json.loads(m.read_text()) for m in marks.glob("*.json")]
        left = [p for h in held for p in _alive_with(h["home"])]
        for line in left:  # a failure's servers (own sessions) are not left running either
            with contextlib.suppress(ProcessLookupError):
                os.killpg(int(line.split(":")[0]), signal.SIGKILL)
    assert proc.returncode != 0
    assert left == [], (left, out[-3000:])
    assert not any(port_in_use(p) for p in ports), (ports, out[-3000:])

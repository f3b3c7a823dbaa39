"""A `chunkgrpo pipeline run --local` that is stopped half-way leaves nothing running.

* SIGTERM to the command (a `kill`, a CI job's timeout) is handled like Ctrl-C: the running task and its
  torchrun workers are stopped, then the servers the command started, and it exits 130.
* A test fixture whose pipeline command is cut off by a timeout (what pytest-timeout does: an exception
  raised in the main thread while the test waits for the command) stops the command's process group and
  the servers it started, even with `--keep-services`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.fixtures_services import run_command, services_stopped_after

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]


def _env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _wait_for(pred, timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.5)


def _command(home: Path, s3: int, mlflow: int) -> list[str]:
    return [sys.executable, "-m", "chunkgrpo", "pipeline", "run", "--local", "--demo", "tiny",
            "--home", str(home), "--s3-port", str(s3), "--mlflow-port", str(mlflow)]


def _tree(pid: int) -> list:
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _ranks(pid: int) -> list[str]:
    """The torchrun ranks under `pid` (`python -u -m chunkgrpo.train ...`)."""
    import psutil

    found = []
    for p in _tree(pid)[1:]:
        try:
            cmd, name = " ".join(p.cmdline()), p.name()
        except psutil.Error:
            continue
        if "-m chunkgrpo.train" in cmd:
            found.append(f"{p.pid} {name} {cmd[:80]}")
    return found


def _alive(procs: list) -> list[str]:
    import psutil

    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
        except psutil.Error:
            pass
    return out


def test_sigterm_stops_the_running_task_and_the_services_like_ctrl_c(tmp_path):
    from chunkgrpo.processes import free_ports
    from chunkgrpo.services import LocalServices, LocalServicesConfig

    s3, mlflow = free_ports(2)
    home = tmp_path / "h"
    out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen(_command(home, s3, mlflow), stdout=o, stderr=e, env=_env(), cwd=tmp_path,
                                start_new_session=True)
    try:
        # killed while training: the kfp.local task and its torchrun workers are running
        _wait_for(lambda: "  train ..." in out.read_text() or proc.poll() is not None, 900, "the train task")
        assert proc.poll() is None, (out.read_text()[-2000:], err.read_text()[-2000:])
        # the train task's two torchrun ranks
        _wait_for(lambda: len(_ranks(proc.pid)) == 2 or proc.poll() is not None, 300, "the torchrun ranks")
        assert proc.poll() is None, ("ended before the ranks were seen", out.read_text()[-2000:])
        tree = _tree(proc.pid)
        assert _listening(s3) and _listening(mlflow)
        proc.send_signal(signal.SIGTERM)  # to the command only, as `kill PID` does
        rc = proc.wait(timeout=180)
        assert rc == 130, (rc, err.read_text()[-2000:])
        assert "chunkgrpo pipeline: interrupted" in err.read_text()
        _wait_for(lambda: not _alive(tree), 30, f"the run's processes to end: {_alive(tree)}")
        assert not _listening(s3) and not _listening(mlflow)
        cfg = LocalServicesConfig(home=str(home / "local"), s3_port=s3, mlflow_port=mlflow)
        status = LocalServices(cfg).status()
        assert {s.state for s in status.values()} == {"stopped"}, status
        # the pipeline's MLflow runs (parent, and the train stage's) end KILLED, none stays RUNNING
        from mlflow import MlflowClient

        db = MlflowClient(f"sqlite:///{home / 'local' / 'mlflow' / 'mlflow.db'}")
        runs = [r for x in db.search_experiments() for r in db.search_runs([x.experiment_id])]
        assert runs and "RUNNING" not in {r.info.status for r in runs}, [(r.info.run_name, r.info.status)
                                                                       for r in runs]
        assert "KILLED" in {r.info.status for r in runs}
    finally:  # whatever the outcome, nothing of this test stays behind
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        LocalServices(LocalServicesConfig(home=str(home / "local"), s3_port=s3, mlflow_port=mlflow)).down()


class _FixtureTimeout(Exception):
    """What pytest-timeout raises in the main thread when a test (or its fixture) runs too long."""


def test_a_fixture_whose_pipeline_times_out_leaves_no_server_behind(tmp_path):
    import psutil

    from chunkgrpo.processes import free_ports

    s3, mlflow = free_ports(2)
    home = tmp_path / "h"
    cmd = " ".join(_command(home, s3, mlflow)) + " --keep-services"
    seen: list = []
    names: list[str] = []  # their command lines, read while they run
    main = threading.get_ident()

    def time_out_when_running():
        """Once the servers answer, snapshot the command's processes, then raise the timeout in the main
        thread."""
        try:
            _wait_for(lambda: _listening(s3) and _listening(mlflow), 900, "the servers")
            time.sleep(2)
            me = psutil.Process()
            seen.extend(p for p in psutil.process_iter()
                        if p.pid != me.pid and str(home) in " ".join(_cmdline(p)))
            for p in list(seen):
                seen.extend(_tree(p.pid)[1:])
            names.extend(" ".join(_cmdline(p)) for p in seen)
        finally:
            signal.pthread_kill(main, signal.SIGALRM)

    previous = signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(_FixtureTimeout()))
    watcher = threading.Thread(target=time_out_when_running, daemon=True)
    try:
        with pytest.raises(_FixtureTimeout):
            # the clone_run fixture's shape (tests/pipeline/test_local_run.py)
            with services_stopped_after(home / "local", s3, mlflow):
                watcher.start()
                run_command(cmd, cwd=tmp_path, env=_env(), timeout=1200)
    finally:
        signal.signal(signal.SIGALRM, previous)
        watcher.join(timeout=60)
    seen_names = " ".join(names)
    # the snapshot saw them all
    assert all(w in seen_names for w in ("weed", "mlflow", "pipeline run --local")), seen_names
    _wait_for(lambda: not _alive(seen), 30, f"the processes to end: {_alive(seen)}")
    assert not _listening(s3) and not _listening(mlflow)


def _cmdline(p) -> list[str]:
    import psutil

    try:
        return p.cmdline()
    except psutil.Error:
        return []

"""The local torchrun launch (components/train, `chunkgrpo.torchrun_local`) listens on 127.0.0.1 only;
`torchrun --standalone` (what it replaced) listens on every interface."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from chunkgrpo.torchrun_local import command

pytestmark = pytest.mark.integration
WORKER = """
import os, time, torch.distributed as dist
dist.init_process_group("gloo")
open(os.path.join(os.environ["READY_DIR"], os.environ["RANK"]), "w").close()
while not os.path.exists(os.path.join(os.environ["READY_DIR"], "stop")):
    time.sleep(0.1)
dist.destroy_process_group()
"""


def _listening(cmd, tmp_path) -> set[tuple[str, int]]:
    """Addresses the launcher and its 2 ranks listen on while the process group is up."""
    import psutil

    tmp_path.mkdir(parents=True)
    (tmp_path / "w.py").write_text(WORKER)
    ready = tmp_path / "ready"
    ready.mkdir()
    env = {**os.environ, "READY_DIR": str(ready), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([*cmd, str(tmp_path / "w.py")], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not ((ready / "0").exists() and (ready / "1").exists()):
            assert proc.poll() is None and time.monotonic() < deadline, "torchrun did not start its 2 ranks"
            time.sleep(0.2)
        agent = psutil.Process(proc.pid)
        return {(c.laddr.ip, c.laddr.port) for p in [agent, *agent.children(recursive=True)]
                for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
    finally:
        (ready / "stop").touch()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_local_torchrun_listens_on_loopback_only(tmp_path):
    sockets = _listening(command(2), tmp_path / "local")
    assert sockets and all(ip == "127.0.0.1" for ip, _ in sockets), sockets


def test_standalone_would_listen_on_every_interface(tmp_path):
    """The check above can fail: `--standalone` exposes the rendezvous store beyond loopback."""
    sockets = _listening(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"],
        tmp_path / "standalone",
    )
    assert any(ip not in ("127.0.0.1", "::1") for ip, _ in sockets), sockets



@pytest.mark.parametrize("form", [
    ["--nproc-per-node=2"],  # the documented form: torchrun alone would take a c10d rendezvous on `::`
    ["--nproc-per-node=2", "--standalone"],
    ["--nproc-per-node=2", "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0"],
    ["--nproc-per-node=2", "--master-port=0"],
], ids=["plain", "standalone", "c10d-localhost", "master-port-0"])
def test_every_documented_form_listens_on_loopback_only(form, tmp_path):
    sockets = _listening([sys.executable, "-m", "chunkgrpo.torchrun_local", *form], tmp_path / "form")
    assert sockets and all(ip == "127.0.0.1" for ip, _ in sockets), sockets


@pytest.mark.parametrize("option", ["--master-addr=0.0.0.0", "--rdzv-endpoint=10.0.0.1:29400", "--nnodes=2",
                                    "--rdzv-backend=etcd"])
def test_a_launch_that_would_listen_elsewhere_is_refused_in_one_line(option, tmp_path):
    (tmp_path / "w.py").write_text("raise SystemExit('started')\n")
    r = subprocess.run([sys.executable, "-m", "chunkgrpo.torchrun_local", "--nproc-per-node=2", option,
                        str(tmp_path / "w.py")], capture_output=True, text=True, timeout=120)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("chunkgrpo.torchrun_local: error: ") and option.split("=")[0] in lines[0]


def test_sigterm_to_the_launcher_stops_its_workers_in_one_line(tmp_path):
    """A pod eviction or `kill` of the launcher: its ranks are stopped and it says so in one line, exit
    128 + SIGTERM, no traceback."""
    import psutil

    (tmp_path / "w.py").write_text(WORKER)
    ready = tmp_path / "ready"
    ready.mkdir()
    env = {**os.environ, "READY_DIR": str(ready), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([*command(2), str(tmp_path / "w.py")], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not ((ready / "0").exists() and (ready / "1").exists()):
            assert proc.poll() is None and time.monotonic() < deadline, "torchrun did not start its 2 ranks"
            time.sleep(0.2)
        ranks = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        "chunkgrpo.torchrun_local: stopped by signal 15 (SIGTERM); its workers were stopped")
    assert not [p for p in ranks if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_a_failed_worker_ends_the_launch_in_one_line_with_its_status(tmp_path):
    """A worker that fails (here: a file that is not there, exit 2) ends the launch with the worker's own
    message and one line of the launcher's, with the worker's status, not torchrun's agent traceback."""
    cmd = [sys.executable, "-m", "chunkgrpo.torchrun_local", "--nproc-per-node=1", "-m", "json.tool",
           str(tmp_path / "not-there.json")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "ChildFailedError" not in r.stderr, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last == ("chunkgrpo.torchrun_local: rank 0 of json.tool exited with status 2 (its output above "
                    "says why)"), r.stderr[-2000:]
    assert "not-there.json" in r.stderr  # the worker's own reason stays in the output


@pytest.mark.parametrize("status", [0, 3], ids=["success", "failure"])
def test_the_launch_removes_its_log_folder(status, tmp_path):
    """torchrun alone leaves a `torchelastic_*` folder (the workers' error files) in $TMPDIR at every
    launch; this launch removes the one it made, when its workers succeed and when one fails."""
    (tmp_path / "w.py").write_text(f"import torch.distributed as dist\ndist.init_process_group('gloo')\n"
                                   f"dist.destroy_process_group()\nraise SystemExit({status})\n")
    folder = tmp_path / "tmpdir"
    folder.mkdir()
    env = {**os.environ, "TMPDIR": str(folder), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([*command(2), str(tmp_path / "w.py")], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == status, r.stderr[-2000:]
    assert [p.name for p in folder.iterdir() if not p.name.startswith("torchinductor_")] == []

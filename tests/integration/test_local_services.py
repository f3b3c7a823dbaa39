"""`chunkgrpo local up|status|env|down` with real processes on free ports in a tmp state dir."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import time
import urllib.request

import psutil
import pytest

from chunkgrpo.cli import main
from chunkgrpo.errors import UserError
from chunkgrpo.processes import free_ports
from chunkgrpo.services import LocalServices, LocalServicesConfig

pytestmark = pytest.mark.integration


def _gone(pids: list[int]) -> bool:
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            continue
    return True


def _tree(pid: int) -> list[int]:
    p = psutil.Process(pid)
    return [pid] + [c.pid for c in p.children(recursive=True)]


def test_up_health_down_leaves_no_process(tmp_path, capsys, monkeypatch):
    from chunkgrpo import mlflow_db

    monkeypatch.setenv("CHUNKGRPO_CACHE", str(tmp_path / "cache"))  # no empty MLflow database kept yet
    s3_port, mlflow_port = free_ports(2)
    home = tmp_path / "home"
    args = ["--home", str(home), "--s3-port", str(s3_port), "--mlflow-port", str(mlflow_port)]
    t0 = time.perf_counter()
    assert main(["local", "up", *args]) == 0
    up_s = time.perf_counter() - t0
    try:
        state = json.loads((home / "state.json").read_text())["services"]
        pids = _tree(state["s3"]["pid"]) + _tree(state["mlflow"]["pid"])
        # health, from the outside
        with urllib.request.urlopen(f"http://127.0.0.1:{mlflow_port}/health", timeout=5) as r:
            assert r.status == 200
        with socket.create_connection(("127.0.0.1", s3_port), timeout=5):
            pass
        # secrets stay private; nothing listens beyond 127.0.0.1
        for f in ("credentials.json", "s3.json"):
            assert stat.S_IMODE((home / f).stat().st_mode) == 0o600
        assert stat.S_IMODE(home.stat().st_mode) == 0o700
        for pid in pids:
            for c in psutil.Process(pid).net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    assert c.laddr.ip == "127.0.0.1", (pid, c.laddr)
        # the server migrated its fresh database; an empty copy is kept for the next fresh home
        assert mlflow_db.is_migrated(mlflow_db.template_path())
        # a second `up` reuses the running services
        t1 = time.perf_counter()
        assert main(["local", "up", *args]) == 0
        assert time.perf_counter() - t1 < 2
        assert json.loads((home / "state.json").read_text())["services"]["s3"]["pid"] == state["s3"]["pid"]
        assert main(["local", "status", *args]) == 0
        capsys.readouterr()
        assert main(["local", "env", *args]) == 0
        env_out = capsys.readouterr().out
        assert f"export MLFLOW_TRACKING_URI=http://127.0.0.1:{mlflow_port}" in env_out
        assert f"export CHUNKGRPO_S3_ENDPOINT=http://127.0.0.1:{s3_port}" in env_out
    finally:
        t2 = time.perf_counter()
        assert main(["local", "down", *args]) == 0
        down_s = time.perf_counter() - t2
    assert _gone(pids), [p for p in pids if psutil.pid_exists(p)]
    assert not (home / "state.json").exists()
    assert main(["local", "status", *args]) == 1
    assert "stopped" in capsys.readouterr().out
    # weed's volume server stopped without its pre-stop pause (one volume server: nowhere to move to)
    assert "stop send heartbeat and wait 0 seconds" in (home / "logs" / "weed.log").read_text()
    print(f"\nlocal up {up_s:.1f}s (S3 + MLflow), down {down_s:.1f}s, {len(pids)} processes")


def test_down_after_a_download_does_not_wait_for_weeds_idle_connections(tmp_path):
    """A download leaves weed's internal connections (S3 gateway -> volume server) open; its graceful stop
    waits for them to time out: 30 s with weed's default, `seaweedfs.IDLE_TIMEOUT_S` (5 s) here."""
    from chunkgrpo.seaweedfs import IDLE_TIMEOUT_S
    from chunkgrpo.store.client import ArtifactStore

    s3_port, mlflow_port = free_ports(2)
    svc = LocalServices(LocalServicesConfig(home=str(tmp_path / "home"), s3_port=s3_port,
                                            mlflow_port=mlflow_port))
    svc.up()
    try:
        src = tmp_path / "src"
        src.mkdir()
        for i in range(3):
            (src / f"part{i}.bin").write_bytes(os.urandom(56 * 2**20))
        store = ArtifactStore(svc.store_config())
        store.put_folder(src, "idle/model")
        store.get_folder("idle/model", tmp_path / "dst")
        assert (tmp_path / "dst" / "part2.bin").read_bytes() == (src / "part2.bin").read_bytes()
    finally:
        t0 = time.perf_counter()
        svc.down()
        down_s = time.perf_counter() - t0
    print(f"\ndown after a download: {down_s:.1f} s (weed's idle timeout {IDLE_TIMEOUT_S} s)")
    assert down_s < IDLE_TIMEOUT_S + 15 < 30, down_s


def test_crashed_service_is_reported_and_restarted(tmp_path, caplog):
    (s3_port,) = free_ports(1)
    svc = LocalServices(LocalServicesConfig(home=str(tmp_path), s3_port=s3_port, mlflow=False))
    try:
        first = svc.up()["s3"].pid
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while svc.status()["s3"].state != "crashed" and time.monotonic() < deadline:
            time.sleep(0.1)
        st = svc.status()["s3"]
        assert st.state == "crashed" and "weed.log" in st.detail
        assert (
            main(["local", "status", "--home", str(tmp_path), "--s3-port", str(s3_port), "--no-mlflow"]) == 1
        )
        again = svc.up()["s3"]
        assert again.state == "running" and again.pid != first
        assert any("crashed" in r.getMessage() for r in caplog.records)
    finally:
        svc.down()
    assert svc.status()["s3"].state == "stopped"


def test_port_in_use_gives_a_clear_message(tmp_path):
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        busy = blocker.getsockname()[1]
        svc = LocalServices(LocalServicesConfig(home=str(tmp_path), s3_port=busy, mlflow=False))
        with pytest.raises(UserError, match=f"port {busy} \\(S3\\).*already in use.*--s3-port"):
            svc.up()
        assert svc.status()["s3"].state == "stopped"
        # through the CLI: one line, exit 2
        assert main(["local", "up", "--home", str(tmp_path), "--s3-port", str(busy), "--no-mlflow"]) == 2
        # a busy MLflow port is found before anything starts (no S3 left running)
        (s3_port,) = free_ports(1)
        svc = LocalServices(LocalServicesConfig(home=str(tmp_path), s3_port=s3_port, mlflow_port=busy))
        with pytest.raises(UserError, match=f"port {busy} \\(MLflow\\).*--mlflow-port"):
            svc.up()
        assert all(st.state == "stopped" for st in svc.status().values())
    assert not (tmp_path / "state.json").exists()


def test_a_deep_home_folder_works(tmp_path, monkeypatch):
    """weed's Unix sockets live in the home; their path is relative to it, since an absolute one longer than
    107 bytes cannot be bound (a deep --home, a pytest base folder). The fresh home's MLflow database starts
    from the kept empty copy (`chunkgrpo.mlflow_db`), made here by MLflow's own migrations, and the server
    runs on it."""
    import sqlite3

    from mlflow import MlflowClient
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    from chunkgrpo import mlflow_db

    monkeypatch.setenv("CHUNKGRPO_CACHE", str(tmp_path / "cache"))
    template = mlflow_db.template_path()
    template.parent.mkdir(parents=True)
    SqlAlchemyStore(f"sqlite:///{template}", "mlflow-artifacts:/").engine.dispose()

    def default_created(db):
        con = sqlite3.connect(db)
        try:
            return con.execute("SELECT creation_time FROM experiments WHERE name = 'Default'").fetchone()
        finally:
            con.close()

    home = tmp_path / ("d" * 60) / ("e" * 60) / "home"
    assert len(str(home / "filer.sock")) > 108
    s3_port, mlflow_port = free_ports(2)
    svc = LocalServices(LocalServicesConfig(home=str(home), s3_port=s3_port, mlflow_port=mlflow_port))
    try:
        svc.up()
        with socket.create_connection(("127.0.0.1", s3_port), timeout=5):
            pass
        assert (home / "filer.sock").is_socket()
        assert default_created(home / "mlflow" / "mlflow.db") == default_created(template)  # the copy
        client = MlflowClient(f"http://127.0.0.1:{mlflow_port}")
        assert client.get_experiment(client.create_experiment("seeded")).name == "seeded"
        assert mlflow_db.is_migrated(template)  # the copy itself is untouched
    finally:
        svc.down()


def _holding(taken: int, calls: int):
    """free_ports whose first `calls` calls hand out `taken` as their second port (weed's master.port): a
    port another process binds between the pick and weed's start. Later calls pick truly free ports.
    Returns the function and the list of its calls."""
    made: list[int] = []

    def pick(n: int) -> list[int]:
        ports = free_ports(n)
        made.append(n)
        if len(made) <= calls:
            ports[1] = taken
        return ports

    return pick, made


def test_weed_started_again_when_another_process_took_one_of_its_ports(tmp_path, monkeypatch, caplog):
    """The internal ports are picked free, then weed binds them; a process that binds one in between made
    weed die at start ("bind: address already in use") and `up` fail. It is started again on new ports."""
    import chunkgrpo.services as LS

    with socket.socket() as thief:
        thief.bind(("127.0.0.1", 0))
        thief.listen()
        taken = thief.getsockname()[1]
        pick, calls = _holding(taken, calls=1)
        monkeypatch.setattr(LS, "free_ports", pick)
        (s3_port,) = free_ports(1)
        svc = LocalServices(LocalServicesConfig(home=str(tmp_path), s3_port=s3_port, mlflow=False))
        try:
            with caplog.at_level("WARNING", logger="chunkgrpo.services"):
                svc.up()
            assert svc.status()["s3"].state == "running"
            state = json.loads((tmp_path / "state.json").read_text())["services"]["s3"]
            assert taken not in state["internal_ports"].values() and len(calls) == 2
            log = (tmp_path / "logs" / "weed.log").read_text()
            assert f"port {taken} for Master (specified by flag master.port) is not available" in log
            assert f"internal port {taken} taken" in caplog.text
        finally:
            svc.down()
    # every attempt colliding: the last one's error, nothing left running
    with socket.socket() as thief:
        thief.bind(("127.0.0.1", 0))
        thief.listen()
        taken = thief.getsockname()[1]
        monkeypatch.setattr(LS, "free_ports", _holding(taken, calls=LS.WEED_START_ATTEMPTS)[0])
        (s3_port,) = free_ports(1)
        svc = LocalServices(LocalServicesConfig(home=str(tmp_path / "b"), s3_port=s3_port, mlflow=False))
        with pytest.raises(UserError, match="local s3 exited"):
            svc.up()
        assert svc.status()["s3"].state == "stopped"
        assert (tmp_path / "b" / "logs" / "weed.log").read_text().count("starting:") == LS.WEED_START_ATTEMPTS


def test_taken_port_is_read_from_this_starts_log_lines_only(tmp_path):
    """Both ways weed reports a taken port (its own check; the bind after it), only for its internal ports
    and only in the lines of the latest start."""
    from chunkgrpo.seaweedfs import taken_internal_port

    log = tmp_path / "weed.log"
    rec = {"log": str(log), "internal_ports": {"master.port": 40001, "filer.port.grpc": 40002}}
    log.write_text("\n---- start 1\nF1127 filer.go:461 failed to listen on grpc port 40002: listen tcp "
                   "127.0.0.1:40002: bind: address already in use\n")
    assert taken_internal_port(rec) == 40002
    log.write_text(log.read_text() + "\n---- start 2\nE1127 mini.go:1244 Port allocation failed: port 40001 "
                   "for Master (specified by flag master.port) is not available on 127.0.0.1\n")
    assert taken_internal_port(rec) == 40001
    log.write_text(log.read_text() + "\n---- start 3\nlisten tcp 127.0.0.1:9000: bind: address already "
                   "in use\n")
    assert taken_internal_port(rec) is None  # the user's S3 port, not an internal one: no retry
    log.write_text(log.read_text() + "\n---- start 4\npanic: something else\n")
    assert taken_internal_port(rec) is None

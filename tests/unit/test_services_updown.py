"""chunkgrpo.services.LocalServices up and down. `up`: MLflow (the slow one to answer) is spawned
before SeaweedFS starts, so its imports overlap S3's start; if S3 fails, that MLflow is stopped. `down`: S3
and MLflow are stopped together (each stop mostly waits for its process to exit); a record that cannot be
stopped stays in the state."""

import threading

import pytest

from chunkgrpo import services as ls
from chunkgrpo.errors import UserError


def _services(tmp_path, monkeypatch, names, stop):
    svc = ls.LocalServices(ls.LocalServicesConfig(home=str(tmp_path / "local")))
    svc.home.mkdir(parents=True)
    svc._save_state({"services": {n: {"pid": 100 + i, "port": 1} for i, n in enumerate(names)}})
    monkeypatch.setattr(ls.LocalServices, "_status_of",
                        lambda self, name, rec: ls.ServiceStatus(name, "running", rec["pid"]))
    monkeypatch.setattr(ls.LocalServices, "_stop_record", lambda self, name, rec: stop(name))
    return svc


def test_s3_and_mlflow_stop_at_the_same_time(tmp_path, monkeypatch):
    both = threading.Barrier(2, timeout=20)  # one stop after the other would break it: neither returns
    order = []

    def stop(name):
        order.append(name)
        if name in ls.SERVICES:
            both.wait()

    svc = _services(tmp_path, monkeypatch, ["s3", "mlflow"], stop)
    out = svc.down()
    assert set(order) == set(ls.SERVICES)
    assert [s.name for s in out] == ["mlflow", "s3"] and {s.state for s in out} == {"stopped"}
    assert not svc.state_file.exists()  # nothing left recorded


def test_a_record_that_is_not_ours_is_kept_and_the_other_service_still_stops(tmp_path, monkeypatch):
    def stop(name):
        if name == "mlflow":
            raise UserError("state.json names pid 101 for local mlflow, but it is another program")

    svc = _services(tmp_path, monkeypatch, ["s3", "mlflow"], stop)
    with pytest.raises(UserError, match="another program"):
        svc.down()
    assert set(svc._load_state()["services"]) == {"mlflow"}  # s3 stopped and cleared, mlflow kept


def _starting(tmp_path, monkeypatch, s3_fails=False):
    """LocalServices whose process starts, waits and stops are recorded in `events` instead of run."""
    events = []
    svc = ls.LocalServices(ls.LocalServicesConfig(home=str(tmp_path / "local"), s3_port=41001,
                                                  mlflow_port=41002))
    monkeypatch.setattr(ls.LocalServices, "_check_ports", lambda self, ports, grace_s=0.0: None)
    monkeypatch.setattr(ls.LocalServices, "_start_s3",
                        lambda self: events.append("spawn s3") or {"pid": 1, "port": 41001,
                                                                       "log": str(tmp_path / "weed.log")})
    monkeypatch.setattr(ls.LocalServices, "_start_mlflow",
                        lambda self, s3_port: events.append(f"spawn mlflow s3={s3_port}") or {"pid": 2,
                                                                                            "port": 41002})

    def wait(self, name, rec):
        events.append(f"wait {name}")
        if name == "s3" and s3_fails:
            raise UserError("local s3 exited with code 1 during startup")

    monkeypatch.setattr(ls.LocalServices, "_wait_healthy", wait)
    monkeypatch.setattr(ls.LocalServices, "_ensure_buckets", lambda self, port: events.append("buckets"))
    monkeypatch.setattr(ls.LocalServices, "_stop_record",
                        lambda self, name, rec: events.append(f"stop {name}"))
    monkeypatch.setattr(ls.LocalServices, "_status_of",
                        lambda self, name, rec: ls.ServiceStatus(name, "running" if rec else "stopped"))
    return svc, events


def test_mlflow_starts_while_s3_starts(tmp_path, monkeypatch):
    svc, events = _starting(tmp_path, monkeypatch)
    svc.up()
    assert events == ["spawn mlflow s3=41001", "spawn s3", "wait s3", "buckets", "wait mlflow"]
    assert set(svc._load_state()["services"]) == {"s3", "mlflow"}


def test_s3_failing_to_start_stops_the_mlflow_started_with_it(tmp_path, monkeypatch):
    svc, events = _starting(tmp_path, monkeypatch, s3_fails=True)
    with pytest.raises(UserError, match="local s3 exited"):
        svc.up()
    assert events[-2:] == ["stop s3", "stop mlflow"] and "wait mlflow" not in events
    assert not svc.state_file.exists()  # nothing left recorded

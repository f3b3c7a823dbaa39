"""A busy local port is reported with the flag of the command the user ran: `chunkgrpo local up --s3-port`
for `local up`, `chunkgrpo pipeline run --local --s3-port` / `--mlflow-port` for a local pipeline run."""

import socket

import pytest

from chunkgrpo.cli import main
from chunkgrpo.processes import free_port


@pytest.fixture
def busy_port():
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        yield blocker.getsockname()[1]


def test_local_up_names_its_own_flag(tmp_path, busy_port, capsys):
    assert main(["local", "up", "--home", str(tmp_path), "--s3-port", str(busy_port), "--no-mlflow"]) == 2
    err = capsys.readouterr().err
    assert f"port {busy_port} (S3)" in err and "(chunkgrpo local up --s3-port N)" in err


@pytest.mark.parametrize("which", ["s3", "mlflow"])
def test_pipeline_run_local_names_the_pipeline_flag(tmp_path, busy_port, capsys, which):
    other = free_port()
    ports = {"s3": other, "mlflow": other}
    ports[which] = busy_port
    if ports["s3"] == ports["mlflow"]:
        pytest.skip("the kernel offered the busy port twice")
    rc = main(["pipeline", "run", "--local", "--home", str(tmp_path),
               "--s3-port", str(ports["s3"]), "--mlflow-port", str(ports["mlflow"])])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert f"port {busy_port}" in err and f"(chunkgrpo pipeline run --local --{which}-port N)" in err
    assert "local up" not in err

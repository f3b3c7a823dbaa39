"""chunkgrpo.seaweedfs: what `local down` removes of a stopped SeaweedFS is only what is provably dead."""

import socket
import tempfile
from pathlib import Path

import pytest

from chunkgrpo.seaweedfs import remove_weed_sockets, socket_listened_on


@pytest.fixture
def grpc_port():
    """A port number whose /tmp/seaweedfs-master-grpc-<port>.sock no one else uses during the test."""
    for port in range(61000, 61100):
        path = Path(tempfile.gettempdir()) / f"seaweedfs-master-grpc-{port}.sock"
        if not path.exists():
            yield port, path
            path.unlink(missing_ok=True)
            return
    pytest.skip("no free socket name")


def test_a_live_socket_of_another_program_is_left_alone(grpc_port):
    """A stale record names a port that a live program (another home's SeaweedFS) listens on now."""
    port, path = grpc_port
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as live:
        live.bind(str(path))
        live.listen(1)
        assert socket_listened_on(path)
        remove_weed_sockets({"internal_ports": {"master.port.grpc": port}})
        assert path.is_socket()


def test_a_dead_socket_of_the_stopped_instance_is_removed(grpc_port):
    port, path = grpc_port
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))
    dead.close()  # the file stays, nobody listens: what a killed weed leaves behind
    assert path.is_socket() and not socket_listened_on(path)
    remove_weed_sockets({"internal_ports": {"master.port.grpc": port}})
    assert not path.exists()


def test_a_plain_file_of_that_name_is_not_touched(grpc_port):
    port, path = grpc_port
    path.write_text("not a socket")
    remove_weed_sockets({"internal_ports": {"master.port.grpc": port}})
    assert path.read_text() == "not a socket"

"""chunkgrpo.seaweedfs: what `local down` removes of a stopped SeaweedFS is only what is provably dead; the
admin maintenance script is stored switched off."""

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


def _decode(buf: bytes) -> dict[int, list]:
    """A protobuf message's fields (number -> values): varints as ints, length-delimited as bytes."""
    fields: dict[int, list] = {}
    i = 0

    def varint() -> int:
        nonlocal i
        value = shift = 0
        while True:
            byte = buf[i]
            i += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return value

    while i < len(buf):
        key = varint()
        number, wire = key >> 3, key & 7
        if wire == 0:
            fields.setdefault(number, []).append(varint())
        else:
            assert wire == 2, wire
            n = varint()
            fields.setdefault(number, []).append(buf[i:i + n])
            i += n
    return fields


def test_the_admin_script_job_type_is_stored_switched_off(tmp_path):
    """weed's stored job-type config: admin_script, its admin runtime without `enabled` (field 1, proto3
    false), the detection interval weed writes itself (17 min); written over weed's own enabled default.
    That weed keeps it and runs no script is tested against the real server in
    tests/pipeline/test_local_run.py (`test_the_local_s3_ran_no_maintenance_script`)."""
    from chunkgrpo.seaweedfs import ADMIN_SCRIPT_CONFIG, admin_script_disabled, disable_admin_script

    top = _decode(admin_script_disabled())
    assert top[1] == [b"admin_script"] and top[2] == [1] and top[7] == [b"chunkgrpo"]
    runtime = _decode(top[5][0])
    assert 1 not in runtime and runtime[2] == [17] and runtime[10] == [1800]
    data = tmp_path / "seaweedfs"
    path = data / ADMIN_SCRIPT_CONFIG
    path.parent.mkdir(parents=True)
    path.write_bytes(bytes.fromhex("0a0c61646d696e5f736372697074") + b"\x2a\x02\x08\x01")  # enabled = 1
    assert disable_admin_script(data) == path
    assert path.read_bytes() == admin_script_disabled()
    assert sorted(p.name for p in path.parent.iterdir()) == ["config.pb"]  # no temp file left

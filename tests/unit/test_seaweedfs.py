"""chunkgrpo.seaweedfs: what `local down` removes of a stopped SeaweedFS is only what is provably dead; weed's
maintenance job types are stored switched off."""

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
    """A protobuf message's fields (number -> values), read by protobuf's own parser without a schema:
    varints as ints, length-delimited fields as bytes."""
    from google.protobuf import empty_pb2
    from google.protobuf.unknown_fields import UnknownFieldSet

    message = empty_pb2.Empty()
    message.ParseFromString(buf)
    fields: dict[int, list] = {}
    for field in UnknownFieldSet(message):
        assert field.wire_type in (0, 2), field.wire_type
        fields.setdefault(field.field_number, []).append(field.data)
    return fields


def test_every_maintenance_job_type_is_stored_switched_off(tmp_path):
    """weed's stored job-type configs: each job type named, its admin runtime without `enabled` (field 1,
    proto3 false) and with the detection interval weed writes itself; written over weed's own enabled
    defaults. That weed keeps them and runs no maintenance is tested against the real server in
    tests/pipeline/test_local_run.py (`test_the_local_s3_ran_no_maintenance`)."""
    from chunkgrpo.seaweedfs import PLUGIN_JOB_TYPES, disable_maintenance, job_type_config, job_type_disabled

    for job_type, interval in PLUGIN_JOB_TYPES.items():
        top = _decode(job_type_disabled(job_type))
        assert top[1] == [job_type.encode()] and top[2] == [1] and top[7] == [b"chunkgrpo"]
        runtime = _decode(top[5][0])
        assert 1 not in runtime and runtime[2] == [interval], (job_type, runtime)
    data = tmp_path / "seaweedfs"
    vacuum = data / job_type_config("vacuum")
    vacuum.parent.mkdir(parents=True)
    vacuum.write_bytes(b"\x0a\x06vacuum" + b"\x2a\x02\x08\x01")  # weed's default: enabled
    written = disable_maintenance(data)
    assert sorted(p.parent.name for p in written) == sorted(PLUGIN_JOB_TYPES)
    for path in written:
        assert path.read_bytes() == job_type_disabled(path.parent.name)
        assert [p.name for p in path.parent.iterdir()] == ["config.pb"]  # no temp file left

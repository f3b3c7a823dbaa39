"""`torchrun` for one node whose rendezvous listens on 127.0.0.1 only.

    python -m chunkgrpo.torchrun_local --nproc-per-node=N -m chunkgrpo.train --config PRESET ...

`torchrun --standalone` (and `--master-addr 127.0.0.1`) start the agent's TCPStore with a socket bound
to every interface (`::`): anyone who can reach the pod or the workstation can talk to the rendezvous
store while training runs. This entry point is torchrun with a static rendezvous on 127.0.0.1 and a free
port, whose store server is given a listening socket bound to 127.0.0.1 (TCPStore's `master_listen_fd`),
so nothing listens beyond loopback. That holds in every form it is started with: without
`--master-port` (where torchrun itself would switch to a c10d rendezvous on every interface), with
`--standalone` or a c10d rendezvous on a loopback endpoint, the launch becomes the static rendezvous on
127.0.0.1 (the given port, else a free one); a non-loopback `--master-addr`/`--rdzv-endpoint`, more than
one node or another rendezvous backend is refused in one line (exit 2). Every other torchrun argument is
passed through unchanged. SIGTERM/SIGINT to the launcher stops its workers and ends in one line
(exit 128 + the signal); a failed worker ends it in one line with the worker's exit status (the worker's
own message above it), not torchrun's `ChildFailedError` traceback.
"""

from __future__ import annotations

import signal
import socket
import sys
from collections.abc import Sequence

HOST = "127.0.0.1"
LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def launch_args(nproc_per_node: int | str) -> list[str]:
    """torchrun arguments of a single-node job: static rendezvous on 127.0.0.1 at a free port."""
    return ["--nnodes=1", "--rdzv-backend=static", f"--master-addr={HOST}", f"--master-port={_free_port()}",
            f"--nproc-per-node={nproc_per_node}"]


def command(nproc_per_node: int | str, *args: str) -> list[str]:
    """The full command: `python -m chunkgrpo.torchrun_local <launch_args> <args>`."""
    return [sys.executable, "-m", "chunkgrpo.torchrun_local", *launch_args(nproc_per_node), *args]


def _loopback_store() -> None:
    """Make the static rendezvous's TCPStore server listen on a socket bound to 127.0.0.1."""
    from torch.distributed.elastic.rendezvous import static_tcp_rendezvous as rdzv

    tcp_store = rdzv.TCPStore

    def store(host, port, world_size=None, is_master=False, *args, **kwargs):
        if is_master and "master_listen_fd" not in kwargs:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((HOST, int(port)))
            sock.listen(128)
            kwargs["master_listen_fd"] = sock.detach()
        return tcp_store(host, port, world_size, is_master, *args, **kwargs)

    rdzv.TCPStore = store


def single_node_loopback(args):
    """torchrun's parsed arguments turned into one node's static rendezvous on 127.0.0.1 (the only
    rendezvous whose store `_loopback_store` binds to loopback); a launch that would have to listen
    elsewhere is a UserError naming the option."""
    from torch.distributed import run as torchrun

    from chunkgrpo.errors import UserError

    _, max_nodes = torchrun.parse_min_max_nnodes(args.nnodes)
    if max_nodes != 1:
        raise UserError(f"--nnodes={args.nnodes}: this launcher runs one node only (torchrun runs several)")
    if args.rdzv_backend not in ("static", "c10d"):
        raise UserError(f"--rdzv-backend={args.rdzv_backend}: one node's launch uses a static rendezvous")
    port = args.master_port
    if args.rdzv_endpoint:
        host, _, endpoint_port = args.rdzv_endpoint.rpartition(":")
        if (host or args.rdzv_endpoint) not in LOOPBACK:
            raise UserError(f"--rdzv-endpoint={args.rdzv_endpoint}: the rendezvous listens on {HOST} only")
        port = port or (int(endpoint_port) if endpoint_port.isdigit() and int(endpoint_port) else None)
    if args.master_addr not in LOOPBACK:
        raise UserError(f"--master-addr={args.master_addr}: the rendezvous listens on {HOST} only")
    args.standalone = False
    args.rdzv_backend, args.rdzv_endpoint, args.master_addr = "static", "", HOST
    args.master_port = port or _free_port()
    return args


def main(argv: Sequence[str] | None = None) -> None:
    from chunkgrpo import startup, threads

    threads.set_env_policy()  # an entry point: the OpenMP environment before torch loads
    try:
        startup.fewer_full_collections()
    except ValueError as e:  # a bad $CHUNKGRPO_GC: one line, as the CLI says it
        print(f"chunkgrpo.torchrun_local: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    from torch.distributed import run as torchrun

    from chunkgrpo.errors import UserError

    try:
        args = single_node_loopback(torchrun.parse_args(list(sys.argv[1:] if argv is None else argv)))
    except UserError as e:
        print(f"chunkgrpo.torchrun_local: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    _loopback_store()
    scratch = _own_log_dir(args)
    torchrun.parse_args = lambda _argv: args  # torchrun's main (error recording, run) on these arguments
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        torchrun.main([])
    except ChildFailedError as e:  # a worker failed: its own output (above) says why; no agent traceback
        rank, failure = e.get_first_failure()
        code = failure.exitcode
        print(f"chunkgrpo.torchrun_local: rank {rank} of {e.name} exited with status {code} (its output "
              "above says why)", file=sys.stderr, flush=True)
        raise SystemExit(code if 0 < code < 256 else 128 - code if code < 0 else 1) from None
    except SignalException as e:  # SIGTERM/SIGINT to this agent: its workers are stopped by then
        signum = int(e.sigval)
        print(f"chunkgrpo.torchrun_local: stopped by signal {signum} ({signal.Signals(signum).name}); "
              "its workers were stopped", file=sys.stderr, flush=True)
        raise SystemExit(128 + signum) from None
    finally:
        if scratch:
            import shutil

            shutil.rmtree(scratch, ignore_errors=True)


def _own_log_dir(args) -> str:
    """Without `--log-dir`, torchrun makes a `torchelastic_*` folder in $TMPDIR for the workers' error
    files and never removes it. When nothing is redirected to log files there (no `--redirects`/`--tee`:
    the folder then holds only those error files, read by the agent when a worker fails), the launch gets
    a folder of its own instead, removed when it ends; returns it ('' = torchrun's own choice stands)."""
    if args.log_dir or str(args.redirects) != "0" or str(args.tee) != "0":
        return ""
    import tempfile

    args.log_dir = tempfile.mkdtemp(prefix="torchelastic_")
    return args.log_dir


if __name__ == "__main__":
    main()

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
passed through unchanged.

Forked workers (`$CHUNKGRPO_FORK_WORKERS=1`, which `chunkgrpo pipeline run --local` sets for its tasks):
torchrun starts each worker as a fresh `python -u -m MODULE`, which imports torch, diffusers, transformers,
peft and mlflow before it trains (about 6 s of CPU per worker and 2 s for torchrun itself on 2 cores; the
ranks import at once). With the variable, this process imports the worker's modules once (`PRELOAD`,
imports only: no torch operator runs, so no OpenMP thread team exists to break a fork) and torchrun's own
agent forks the workers from it (its `start_method="fork"` for a function entrypoint, the mechanism of
`torchrun --run-path --start-method fork`). Each worker is then what the fresh process would have been:
its own session (as torchrun's subprocess workers), torchrun's per-rank environment, `sys.argv` and
`__main__` as `python -m` sets them, line-buffered output (`-u`), and the interpreter's exit (non-daemon
threads joined, atexit handlers run, the exit code of `SystemExit`). The preloaded imports read none of
torchrun's per-rank variables (tests/integration/test_torchrun_fork.py records them), and training gives
bit-identical weights either way (same test). Not on a machine with an NVIDIA device (`/dev/nvidia*`): an
import that asks CUDA whether a GPU is there initialises it in the parent, and a forked child then cannot
use it. Not for a script path or `--no-python`, and not on a cluster pod (the compiled pipeline does not
set the variable).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

HOST = "127.0.0.1"
LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")
ENV_FORK = "CHUNKGRPO_FORK_WORKERS"
# what a `chunkgrpo.train` worker imports before it trains (load_flux imports the FLUX pipeline lazily)
PRELOAD = ("chunkgrpo.cli", "chunkgrpo.commands.train", "chunkgrpo.train.trainer",
           "diffusers.pipelines.flux.pipeline_flux", "peft", "mlflow")


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


def set_process_name(name: str) -> None:
    """The name `ps`, `top` and psutil show for this process (Linux: /proc/self/comm, 15 characters): a
    forked rank keeps the command line of the process it was forked from (torchrun's agent names its own
    process `pt_elastic`)."""
    try:
        Path("/proc/self/comm").write_text(name[:15])
    except OSError:
        pass


def fork_workers(environ=None) -> bool:
    """Whether workers are forked from this process: asked for (`$CHUNKGRPO_FORK_WORKERS=1`) and no NVIDIA
    device on the machine."""
    env = os.environ if environ is None else environ
    return env.get(ENV_FORK, "") == "1" and not any(Path("/dev").glob("nvidia[0-9]*"))


def _worker(module: str, *argv: str) -> None:
    """One rank, in a child forked by torchrun's agent: `python -u -m module argv` as a fresh interpreter
    would run it, ending as the interpreter ends (threads joined, atexit handlers, SystemExit's code)."""
    import runpy

    from chunkgrpo.local_processes import interpreter_teardown

    os.setsid()  # its own session, as torchrun's subprocess workers (a terminal's Ctrl-C goes to the agent)
    set_process_name(f"{module.rsplit('.', 1)[-1]}-rank{os.environ.get('RANK', '')}")
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)  # `-u`: the task log gets each line as it is written
    sys.argv = [module, *argv]  # run_module(alter_sys=True) replaces argv[0] with the module's file
    try:  # an exception goes on to torchrun's error file and exit code, as from a fresh `python -m`
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        interpreter_teardown()


def _forking(config_from_args):
    """torchrun's `config_from_args`, changed to start `-m MODULE` workers by forking this process after
    `PRELOAD` (everything else of torchrun's `run` is unchanged: rendezvous, agent, restarts, signals)."""

    def config(args):
        import importlib

        cfg, cmd, cmd_args = config_from_args(args)  # sets OMP_NUM_THREADS=1 for > 1 rank before the imports
        if not (args.module and isinstance(cmd, str) and args.training_script in cmd_args):
            return cfg, cmd, cmd_args
        for name in PRELOAD:
            importlib.import_module(name)
        cfg.start_method = "fork"
        sys.stdout.flush()
        sys.stderr.flush()
        return cfg, _worker, cmd_args[cmd_args.index(args.training_script):]

    return config


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
    from torch.distributed import run as torchrun

    from chunkgrpo.errors import UserError

    try:
        args = single_node_loopback(torchrun.parse_args(list(sys.argv[1:] if argv is None else argv)))
    except UserError as e:
        print(f"chunkgrpo.torchrun_local: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    _loopback_store()
    if fork_workers():
        torchrun.config_from_args = _forking(torchrun.config_from_args)
    torchrun.parse_args = lambda _argv: args  # torchrun's main (error recording, run) on these arguments
    from torch.distributed.elastic.multiprocessing.api import SignalException

    try:
        torchrun.main([])
    except SignalException as e:  # SIGTERM/SIGINT to this agent: its workers are stopped by then
        signum = int(e.sigval)
        print(f"chunkgrpo.torchrun_local: stopped by signal {signum} ({signal.Signals(signum).name}); "
              "its workers were stopped", file=sys.stderr, flush=True)
        raise SystemExit(128 + signum) from None


if __name__ == "__main__":
    main()

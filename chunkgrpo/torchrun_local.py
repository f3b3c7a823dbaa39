"""`torchrun` for one node whose rendezvous listens on 127.0.0.1 only.

    python -m chunkgrpo.torchrun_local --nproc-per-node=N -m chunkgrpo.train --config PRESET ...

`torchrun --standalone` (and `--master-addr 127.0.0.1`) start the agent's TCPStore with a socket bound
to every interface (`::`): anyone who can reach the pod or the workstation can talk to the rendezvous
store while training runs. This entry point is torchrun with a static rendezvous on 127.0.0.1 and a free
port, whose store server is given a listening socket bound to 127.0.0.1 (TCPStore's `master_listen_fd`),
so nothing listens beyond loopback. Every other torchrun argument is passed through unchanged.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Sequence

HOST = "127.0.0.1"


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


def main(argv: Sequence[str] | None = None) -> None:
    from chunkgrpo import threads

    threads.set_env_policy()  # before torch loads here: forked ranks share this process's OpenMP runtime
    from torch.distributed import run as torchrun

    _loopback_store()
    torchrun.main(list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()

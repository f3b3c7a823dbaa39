"""Several ranks of one test as processes (gloo on CPU), started by a forkserver: a process of this xdist
worker's that imported torch and chunkgrpo's checkpoint modules once, and forks one child per rank. A child
starts in a fraction of a second instead of importing them again (about 3 CPU-s each with `spawn`).

A forkserver's children do not inherit later changes to the caller's `os.environ` (the server was started
with the environment of its first use): `run_ranks` hands each child the caller's environment as it is at
the call. The server exits with the worker (it watches a pipe to it)."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable

import torch.multiprocessing as tmp

PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "safetensors.torch",
    "chunkgrpo.train.checkpoint_format",
    "chunkgrpo.train.checkpoint_sharded",
    "chunkgrpo.train.checkpoint_nodes",
    "chunkgrpo.store.client",
]


def _in_env(rank: int, env: dict, fn: Callable, args: tuple) -> None:
    os.environ.clear()
    os.environ.update(env)
    fn(rank, *args)


def run_ranks(fn: Callable, args: tuple, nprocs: int) -> None:
    """`fn(rank, *args)` in `nprocs` processes at once, in this process's environment; an exception in any
    of them is raised here (torch.multiprocessing's ProcessRaisedException)."""
    multiprocessing.set_forkserver_preload(PRELOAD)  # takes effect when the server starts (the first call)
    tmp.start_processes(_in_env, args=(dict(os.environ), fn, args), nprocs=nprocs, join=True,
                        start_method="forkserver")

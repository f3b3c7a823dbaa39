"""Process-group setup and the two distribution strategies.

* ``ddp``: parameters replicated (broadcast from rank 0 at start); before each optimizer step the
  trainable gradients are averaged with one flattened all-reduce. Equivalent to DDP with `no_sync`
  accumulation, and robust to ranks that issue different numbers of backward calls (a fully clipped
  unit does no backward at all in the per-step strategy).
* ``fsdp``: FSDP2 `fully_shard` on every transformer block, then the root (full shard); gradient
  reduce-scatter is deferred to the last backward of an accumulation window (`grad_sync`: the policy
  window engine turns `set_requires_gradient_sync` off for every backward of a window but its last, so
  each FSDP unit reduce-scatters once per optimizer step). Every rank then must run the same
  forward/backward sequence, which the trainer guarantees (fixed units per sample, no skipping).

Single-rank I/O (the model fetch by each node's local rank 0, writing the final model) is waited for
outside any collective: `wait_all` posts each rank's outcome to the process group's key-value store and
polls it with its own deadline, logging what it waits for, so a long download never runs into the
collective timeout (`TrainConfig.dist_timeout_s`, NCCL's watchdog) and a hang fails naming its phase.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# Timeout of every collective and deadline of a wait for another rank's I/O, by default: twice the longest
# single-rank I/O phase the capacity plan estimates for chunk_grpo_flux (FLUX.1-dev full fine-tuning: its
# 143 GB checkpoint written and hashed at `IO_BYTES_PER_S`, 1428 s), rounded up to the hour
# (`chunkgrpo.capacity.io`; tests/unit/capacity/test_io.py keeps the two consistent).
DEFAULT_TIMEOUT_S = 3600.0
# Bandwidth the I/O estimates assume for one rank's transfer (S3 download, disk write + sha256): 200 MB/s.
IO_BYTES_PER_S = 200e6
PROGRESS_S = 60.0  # a waiting rank says what it waits for this often
_phase_calls: dict[tuple, int] = {}  # per (store, rank, phase): the n-th call of a phase, as on every rank


class PhaseTimeout(RuntimeError):
    """A rank did not finish a single-rank phase (model fetch, export, ...) within its deadline."""


@dataclass
class DistInfo:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def one_node(self) -> bool:
        """Every rank runs on this node (torchrun's LOCAL_WORLD_SIZE is the whole world)."""
        return int(os.environ.get("LOCAL_WORLD_SIZE", str(self.world))) == self.world


def setup(device: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S) -> DistInfo:
    """Init the process group from torchrun's env (gloo on CPU, nccl on GPU), every collective timing out
    after `timeout_s`; single process otherwise.
    A GPU asked for (`cuda`, or `auto` in a task given GPUs) that CUDA cannot use is a UserError naming the
    driver and torch's CUDA (`chunkgrpo.gpu.require`), never a silent fallback to the CPU."""
    from chunkgrpo.gpu import require

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = require(device)
    dev = torch.device(f"cuda:{local_rank}") if device == "cuda" else torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if dev.type == "cuda" else "gloo", device_id=dev if dev.type == "cuda" else None,
            timeout=timedelta(seconds=timeout_s),
        )
    return DistInfo(rank, world, local_rank, dev)


def teardown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def broadcast_params(module: torch.nn.Module) -> None:
    """Make every rank start from rank 0's parameters (LoRA init, etc.)."""
    if not dist.is_initialized():
        return
    with torch.no_grad():
        for p in module.parameters():
            dist.broadcast(p.data, src=0)


def all_reduce_grads(params: list[torch.nn.Parameter]) -> None:
    """Average gradients over ranks with one flattened all-reduce (missing grads count as zero)."""
    if not dist.is_initialized():
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset:offset + n].view_as(p).to(p.dtype)
        offset += n


def all_reduce_mean(values: dict[str, float], device) -> dict[str, float]:
    """Average scalar metrics over ranks."""
    if not dist.is_initialized() or not values:
        return values
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    t /= dist.get_world_size()
    return dict(zip(keys, t.tolist()))


def all_reduce_max(value: float, device) -> float:
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def any_rank(flag: bool, device) -> bool:
    """True on every rank if `flag` is true on any (a collective: all ranks must call it)."""
    return all_reduce_max(1.0 if flag else 0.0, device) > 0


def wait_all(phase: str, failed: bool, *, deadline_s: float, progress_s: float = PROGRESS_S,
             store=None, rank: int | None = None, world: int | None = None,
             say: Callable[[str], None] | None = None) -> list[int]:
    """The ranks whose `failed` is true, on every rank, agreed through the key-value store instead of a
    collective (all ranks must call it, in the same order, as with a collective). A rank that did the
    phase's work calls it when done; the others call it at once and wait, saying every `progress_s` what
    they wait for ("waiting for rank 0: model fetch, 120 s of 3600 s"). Past `deadline_s` a PhaseTimeout
    names the phase and the ranks not done. `store`, `rank`, `world` default to the process group's."""
    slot: tuple = (id(store), rank, phase)
    if store is None:
        if not dist.is_initialized():
            return [0] if failed else []
        store = dist.distributed_c10d._get_default_store()
        rank, world = dist.get_rank(), dist.get_world_size()
        slot = ("process group", rank, phase)
    say = say or log.info
    n = _phase_calls[slot] = _phase_calls.get(slot, 0) + 1
    prefix = f"chunkgrpo/phase/{phase}/{n}/"

    def key(r: int) -> str:
        return f"{prefix}{r}"

    store.set(key(rank), b"failed" if failed else b"ok")
    pending = [r for r in range(world) if r != rank]
    t0 = time.monotonic()
    next_say = progress_s
    try:
        while True:
            pending = [r for r in pending if not store.check([key(r)])]
            waited = time.monotonic() - t0
            if not pending:
                break
            if waited >= deadline_s:
                raise PhaseTimeout(
                    f"{phase}: rank{'s' if len(pending) > 1 else ''} {_ranks(pending)} not done within "
                    f"{deadline_s:.0f} s (io_wait_s); see {'their' if len(pending) > 1 else 'its'} log")
            if waited >= next_say:
                say(f"waiting for rank{'s' if len(pending) > 1 else ''} {_ranks(pending)}: {phase}, "
                    f"{waited:.0f} s of {deadline_s:.0f} s")
                next_say += progress_s
            time.sleep(min(0.5, max(0.01, deadline_s - waited)))
        values = store.multi_get([key(r) for r in range(world)])
    except dist.DistError as e:  # the store's host (rank 0) is gone
        raise PhaseTimeout(f"{phase}: the rendezvous store stopped answering ({str(e).splitlines()[0]})"
                           ) from None
    return [r for r, v in enumerate(values) if bytes(v) != b"ok"]


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (f" (+{len(ranks) - 8} more)" if len(ranks) > 8 else "")


def broadcast_object(obj):
    """Rank 0's `obj` on every rank (plain Python values)."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def shard_fsdp(transformer: torch.nn.Module, mixed_bf16: bool) -> torch.nn.Module:
    """FSDP2 full shard: each transformer block is a unit, then the root. With bf16 the policy casts every
    floating forward input to bf16, the timestep included; the time/guidance embedding still receives the
    exact fp32 values (`chunkgrpo.flux.exact_time_embedding`, tested under torchrun)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mixed_bf16
        else MixedPrecisionPolicy()
    )
    for name in ("transformer_blocks", "single_transformer_blocks"):
        for block in getattr(transformer, name, []):
            fully_shard(block, mp_policy=mp)
    fully_shard(transformer, mp_policy=mp)
    return transformer

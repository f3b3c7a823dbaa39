"""Process-group setup and the two distribution strategies.

* ``ddp``: parameters replicated (broadcast from rank 0 at start); before each optimizer step the
  trainable gradients are averaged with one flattened all-reduce. Equivalent to DDP with `no_sync`
  accumulation, and robust to ranks that issue different numbers of backward calls (a fully clipped
  unit does no backward at all in the per-step strategy).
* ``fsdp``: FSDP2 `fully_shard` on every transformer block, then the root (full shard); gradient
  reduce-scatter is deferred to the last backward of an accumulation window. Every rank then must run
  the same forward/backward sequence, which the trainer guarantees (fixed units per sample, no skipping).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


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


def setup(device: str = "auto") -> DistInfo:
    """Init the process group from torchrun's env (gloo on CPU, nccl on GPU); single process otherwise.
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
            backend="nccl" if dev.type == "cuda" else "gloo", device_id=dev if dev.type == "cuda" else None
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

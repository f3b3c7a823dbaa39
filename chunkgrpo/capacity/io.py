"""Capacity-plan terms beside the memory model: stated estimates of what no meta-device trace measures.

**I/O time per phase** (single-rank work that other ranks wait for). One pass over a phase's bytes takes
bytes / `IO_BYTES_PER_S` (200 MB/s, `chunkgrpo.train.dist.IO_BYTES_PER_S`: an S3 transfer of one process
or a disk write); every phase makes two passes, the transfer and the sha256 verification of what it moved:

  model fetch      the model folder, by each node's local rank 0      others wait in the store (`io_wait_s`)
  checkpoint save  the checkpoint, written and hashed by rank 0;      others wait in a collective
                   under FSDP each rank its 1/world share (sharded    (`dist_timeout_s`)
                   on one node, and across nodes with
                   `checkpoint.s3_prefix`, which the pipeline sets)
  resume download  the newest checkpoint, downloaded and verified     others wait in a collective
                   by each node's local rank 0 (a node's own part     (`dist_timeout_s`)
                   of a sharded one is kept: at most the whole)
  export           the final model, written and hashed by rank 0      others wait in the store (`io_wait_s`)

A phase longer than the timeout it waits under is a problem (the run would fail there); one longer than
half of it is a warning (less than a 2× margin for a slow store or disk).

**GPU memory** (per rank, stated, not traced):
  NCCL buffers        `NCCL_BUFFER_BYTES` = 1 GiB once a GPU run has more than one rank: NCCL's
                      communicator buffers (NCCL_BUFFSIZE 4 MiB × up to 32 channels × send/receive ×
                      ring and tree, ≈ 1 GiB on 8-GPU NVLink nodes) and the process group's work queue
  reward worker CUDA  `CUDA_CONTEXT_BYTES` = 600 MiB per reward scored on the rank's GPU in a worker
  contexts            process of its own venv (`scoring.table.PACKAGE_SCORERS`: hpsv3, imagereward,
                      hpsv2.1, ...): a second CUDA context (CUDA 12 with lazy module loading, H100/H800)
  FSDP no-sync grads  `fsdp_grad_sync=window` with more than one backward per window: every rank keeps
                      the unsharded gradients of every FSDP unit between a window's backwards, in the
                      fp32 reduce dtype (4 bytes per trainable parameter)
The rank's own CUDA context and allocator slack stay in the plan's `reserve_bytes`.
"""

from __future__ import annotations

import dataclasses
import math

from chunkgrpo.capacity.arch import GiB
from chunkgrpo.train.dist import IO_BYTES_PER_S

MiB = 2**20
NCCL_BUFFER_BYTES = 1 * GiB
CUDA_CONTEXT_BYTES = 600 * MiB
PASSES = 2  # the transfer and its sha256 verification

# phase -> (what moves, where the other ranks wait, the TrainConfig field bounding that wait)
PHASES = {
    "model fetch": ("model folder", "store", "io_wait_s"),
    "checkpoint save": ("checkpoint", "collective", "dist_timeout_s"),
    "resume download": ("checkpoint", "collective", "dist_timeout_s"),
    "export": ("final model", "store", "io_wait_s"),
}


@dataclasses.dataclass
class IoPhase:
    phase: str
    nbytes: int
    seconds: float
    wait: str  # "store" (`dist.wait_all`) or "collective"
    timeout_field: str
    timeout_s: float

    @property
    def fits(self) -> bool:
        return self.seconds <= self.timeout_s

    @property
    def tight(self) -> bool:
        return self.fits and 2 * self.seconds > self.timeout_s

    def line(self) -> str:
        return (f"{self.phase}: {self.seconds:.0f} s ({PASSES} passes over {self.nbytes / 1e9:.1f} GB at "
                f"{IO_BYTES_PER_S / 1e6:.0f} MB/s), waited for in the {self.wait} under "
                f"{self.timeout_field}={self.timeout_s:.0f} s")


def io_phases(cfg, *, model_folder: int, checkpoint: int, final: int, writers: int = 1,
              bytes_per_s: float = IO_BYTES_PER_S) -> list[IoPhase]:
    """The run's single-rank I/O phases with their estimated seconds and the timeout each waits under;
    `writers` ranks write a checkpoint, each its share (FSDP: every rank)."""
    sizes = {"model folder": model_folder, "checkpoint": checkpoint, "final model": final}
    out = []
    for phase, (what, wait, field) in PHASES.items():
        nbytes = sizes[what] if phase != "checkpoint save" else -(-checkpoint // max(1, writers))
        out.append(IoPhase(phase, nbytes, PASSES * nbytes / bytes_per_s, wait, field,
                           float(getattr(cfg, field))))
    return out


def io_problems(phases: list[IoPhase]) -> list[str]:
    return [f"I/O time ({p.phase}): {p.seconds:.0f} s exceeds {p.timeout_field}={p.timeout_s:.0f} s "
            f"(raise {p.timeout_field} to at least {math.ceil(2 * p.seconds)})" for p in phases if not p.fits]


def io_warnings(phases: list[IoPhase]) -> list[str]:
    return [f"I/O time ({p.phase}): {p.seconds:.0f} s is over half of {p.timeout_field}={p.timeout_s:.0f} s"
            for p in phases if p.tight]


def reward_worker_contexts(rewards, gpu: bool) -> int:
    """Bytes of the second CUDA contexts of the rewards scored in worker processes on the rank's GPU."""
    from chunkgrpo.scoring.table import ALIASES, PACKAGE_SCORERS

    if not gpu:
        return 0
    names = [ALIASES.get(r.name.lower(), r.name.lower()) for r in rewards if not r.url]
    return CUDA_CONTEXT_BYTES * sum(1 for n in names if n in PACKAGE_SCORERS)


def backwards_per_window(cfg, sizes: list[int], fsdp: bool, branching: bool) -> int:
    """Backward passes between two optimizer steps: chunk/step methods under FSDP train whole units, a
    fixed number per forward (`grpo.policy_layout`); branching methods one per trained step when the
    update is per iteration."""
    if branching:
        from chunkgrpo.train.branching import branch_steps, update_mode

        return len(branch_steps(cfg)) if update_mode(cfg) == "per_iteration" else 1
    if not fsdp:
        return 1  # gradients are all-reduced once per step whatever the count
    units = cfg.grad_accum * max(1, int(len(sizes) * cfg.timestep_fraction))
    return math.ceil(units / max(1, cfg.policy_batch // max(sizes)))

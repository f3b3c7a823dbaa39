"""What a training method sees: one public context per iteration, and what it gives back.

Methods (`chunkgrpo.train.grpo`, `chunkgrpo.train.branching`) are plain functions
`iteration(ctx) -> IterationResult`; the trainer knows them by a table (`chunkgrpo.train.methods`)
and no method imports the trainer.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch

from chunkgrpo.chunks import ChunkPlan
from chunkgrpo.train.config import TrainConfig


class NonFiniteLossError(RuntimeError):
    """Raised when the loss or gradient becomes NaN/inf; the last good checkpoint is kept intact."""


@dataclass
class IterationContext:
    """Everything one iteration of a method needs, built by the trainer for this rank and iteration."""

    cfg: TrainConfig
    model: Any  # chunkgrpo.flux.FluxModel (transformer, velocity, decode, counter, ...)
    prompts: list[str]  # this rank's prompts for this iteration
    cond: Any  # their cached text embeddings (chunkgrpo.flux.Conditioning)
    reward_fns: dict[str, Callable]
    reward_weights: dict[str, float]
    plan: ChunkPlan  # the chunk plan: `sizes` (all 1 for step-level methods), `ranges` ([start, end) steps)
    device: torch.device
    iteration: int
    generator: torch.Generator  # seeded from (seed, iteration, rank): rollout noise, unit selection, order
    autocast: Callable[[], AbstractContextManager]  # bf16 autocast when mixed precision is on
    optimizer_step: Callable[[], dict]  # all-reduce (DDP), clip, step, zero; returns {"grad_norm": float}
    fsdp: bool = False  # FSDP-sharded: every rank must run the same number of forwards
    # FSDP: called before each backward, true only for the last before an optimizer step (gradient
    # reduce-scatter once per step: `set_requires_gradient_sync`); None = gradients reduced per step anyway
    grad_sync: Callable[[bool], None] | None = None


@dataclass
class IterationResult:
    """Metrics of one iteration (all floats, reduced across ranks by the trainer) and sample images."""

    metrics: dict[str, float]
    images: list = field(default_factory=list)  # PIL images of the last rollout (for the MLflow grid)
    prompts: list[str] = field(default_factory=list)

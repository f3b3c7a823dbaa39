"""The training methods by name: each is an iteration function over an `IterationContext` and the
number of optimizer steps one iteration makes. The trainer looks methods up here and nothing else."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from chunkgrpo.train import branching, grpo
from chunkgrpo.train.config import METHODS, TrainConfig
from chunkgrpo.train.context import IterationContext, IterationResult


@dataclass(frozen=True)
class Method:
    iteration: Callable[[IterationContext], IterationResult]
    steps_per_iteration: Callable[[TrainConfig], int]


_GRPO = Method(grpo.iteration, grpo.steps_per_iteration)
_BRANCHING = Method(branching.iteration, branching.steps_per_iteration)

TABLE: dict[str, Method] = {"chunk": _GRPO, "chunk+ws": _GRPO, "dance": _GRPO,
                            "tempflow": _BRANCHING, "granular": _BRANCHING}
assert set(TABLE) == set(METHODS), "every configurable method needs an entry"


def get_method(name: str) -> Method:
    return TABLE[name]  # TrainConfig already rejected unknown names

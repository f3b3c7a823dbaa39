"""The training methods by name: each is an iteration function over an `IterationContext` and the
number of optimizer steps one iteration makes. The trainer looks methods up here and nothing else; the
names and families are `chunkgrpo.recipes.METHOD_NAMES` / `GRPO_METHODS` / `BRANCHING_METHODS`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from chunkgrpo.recipes import BRANCHING_METHODS, GRPO_METHODS, METHOD_NAMES
from chunkgrpo.train import branching, grpo
from chunkgrpo.train.config import TrainConfig
from chunkgrpo.train.context import IterationContext, IterationResult


@dataclass(frozen=True)
class Method:
    iteration: Callable[[IterationContext], IterationResult]
    steps_per_iteration: Callable[[TrainConfig], int]


_GRPO = Method(grpo.iteration, grpo.steps_per_iteration)
_BRANCHING = Method(branching.iteration, branching.steps_per_iteration)

TABLE: dict[str, Method] = {**{m: _GRPO for m in GRPO_METHODS}, **{m: _BRANCHING for m in BRANCHING_METHODS}}
assert set(TABLE) == set(METHOD_NAMES), "every configurable method needs an entry"


def get_method(name: str) -> Method:
    return TABLE[name]  # TrainConfig already rejected unknown names

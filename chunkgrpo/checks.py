"""Debug checks that would stall an accelerator.

Validating a value that lives on a GPU (`torch.any(std <= 0)`, `float(loss)`) waits for every queued
kernel: a host sync per sampling step. Such checks run only when debug checks are on; checks on
host values (Python floats, CPU tensors) cost no sync and always run.

Turn them on with the environment variable ``CHUNKGRPO_DEBUG_CHECKS=1`` (whole process) or, for a
block of code, ``with checks.debug(True): ...`` (the trainer does this with `debug_checks=true`).
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch

_state = {"on": os.environ.get("CHUNKGRPO_DEBUG_CHECKS", "").strip().lower() not in ("", "0", "false", "no")}


def enabled() -> bool:
    """Whether host-syncing debug checks run."""
    return _state["on"]


@contextmanager
def debug(on: bool):
    """Debug checks on (or off) inside the block; the previous setting is restored afterwards."""
    before = _state["on"]
    _state["on"] = bool(on) or before
    try:
        yield
    finally:
        _state["on"] = before


def wanted(*tensors: torch.Tensor) -> bool:
    """True when checking these tensors costs no device sync (all on the CPU) or debug checks are on."""
    return _state["on"] or all(t.device.type == "cpu" for t in tensors)

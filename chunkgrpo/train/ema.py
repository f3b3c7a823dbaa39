"""Exponential moving average of the trainable weights (DanceGRPO `--use_ema`, Flow-GRPO/TempFlow EMA).

`θ_ema ← d·θ_ema + (1 − d)·θ` every `every` iterations (rollouts); with `warmup` the decay is
`min(d, (1 + n)/(10 + n))` for the n-th update (Flow-GRPO's warm-up). The shadow weights live next to
the trainable parameters (fp32, the same shards under FSDP); the exported final model is the EMA, as the
references evaluate and save it; checkpoints carry it so a resumed run continues the same average.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


class Ema:
    def __init__(self, params: list[torch.nn.Parameter], decay: float, every: int = 1, warmup: bool = False):
        self.params, self.decay, self.every, self.warmup = params, float(decay), int(every), bool(warmup)
        self.shadow = [p.detach().clone().float() for p in params]
        self.updates = 0

    def current_decay(self) -> float:
        return min(self.decay, (1 + self.updates) / (10 + self.updates)) if self.warmup else self.decay

    @torch.no_grad()
    def after_iteration(self, iterations_done: int) -> bool:
        """Update after the `iterations_done`-th iteration when it is due; True if it updated."""
        if iterations_done % self.every:
            return False
        d = self.current_decay()
        for s, p in zip(self.shadow, self.params):
            s.lerp_(p.detach().float(), 1.0 - d)  # θ_ema ← d·θ_ema + (1 − d)·θ
        self.updates += 1
        return True

    @contextmanager
    def swapped(self):
        """The parameters hold the EMA weights inside the block (export, checkpoint), the trained ones
        after."""
        with torch.no_grad():
            saved = [p.detach().clone() for p in self.params]
            for p, s in zip(self.params, self.shadow):
                p.copy_(s.to(p.dtype))
        try:
            yield
        finally:
            with torch.no_grad():
                for p, v in zip(self.params, saved):
                    p.copy_(v)

    @torch.no_grad()
    def capture(self, updates: int) -> None:
        """Take the current parameter values as the shadow (used when loading a checkpoint's EMA)."""
        self.shadow = [p.detach().clone().float() for p in self.params]
        self.updates = int(updates)

"""Noise schedules for flow-matching sampling (method.md §1).

`σ` runs from 1 (pure noise) to 0 (clean). Two schedules are used by the reference recipes:

* shift schedule (DanceGRPO / MixGRPO / G2RPO / official Chunk-GRPO): `u = linspace(1, 0, N+1)`,
  `σ = s·u / (1 + (s−1)·u)`; the transformer receives the integer timestep `int(σ·1000)`.
* FLUX dynamic shift (Flow-GRPO / TempFlow / diffusers default): `linspace(1, 1/N, N)` shifted by
  `σ' = e^μ / (e^μ + 1/σ − 1)` with μ linear in the image token count, then a final 0.

All schedules are computed in float64; callers cast as needed.
"""

from __future__ import annotations

import math

import torch

from chunkgrpo.errors import UserError


def _check_steps(num_steps: int) -> None:
    if not isinstance(num_steps, int) or num_steps < 1:
        raise UserError(f"num_steps must be a positive integer, got {num_steps!r}")


def shift_sigmas(num_steps: int, shift: float = 3.0) -> torch.Tensor:
    """σ = s·u / (1 + (s−1)·u), u = linspace(1, 0, N+1)  (method.md §1, shift schedule). Shape (N+1,)."""
    _check_steps(num_steps)
    if not shift > 0:
        raise UserError(f"shift must be > 0, got {shift!r}")
    u = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
    return shift * u / (1.0 + (shift - 1.0) * u)


def dynamic_shift_mu(
    image_seq_len: int,
    base_seq_len: int = 256,
    max_seq_len: int = 4096,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
) -> float:
    """μ linear in the image token count: 256 → 0.5, 4096 → 1.15 (diffusers FLUX default)."""
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return base_shift + slope * (image_seq_len - base_seq_len)


def dynamic_shift_sigmas(num_steps: int, image_seq_len: int, mu: float | None = None) -> torch.Tensor:
    """σ' = e^μ / (e^μ + 1/σ − 1) over σ = linspace(1, 1/N, N), then 0 appended. Shape (N+1,)."""
    _check_steps(num_steps)
    if mu is None:
        mu = dynamic_shift_mu(image_seq_len)
    s = torch.linspace(1.0, 1.0 / num_steps, num_steps, dtype=torch.float64)
    em = math.exp(mu)
    shifted = em / (em + (1.0 / s - 1.0))
    return torch.cat([shifted, torch.zeros(1, dtype=torch.float64)])


def make_sigmas(kind: str, num_steps: int, *, shift: float = 3.0, image_seq_len: int = 4096) -> torch.Tensor:
    """Schedule by name: 'shift' or 'dynamic'."""
    if kind == "shift":
        return shift_sigmas(num_steps, shift)
    if kind == "dynamic":
        return dynamic_shift_sigmas(num_steps, image_seq_len)
    raise UserError(f"unknown schedule {kind!r} (choose 'shift' or 'dynamic')")


def model_timesteps(sigmas: torch.Tensor, quantize: bool = True) -> torch.Tensor:
    """Timestep in [0, 1000] the transformer receives (FLUX divides it by 1000 again).

    quantize=True (shift-schedule recipes): `int(σ·1000)` (floor), computed from float64 σ so
    that e.g. σ = 0.3 gives 300, not 299. quantize=False (Flow-GRPO): `σ·1000` as a float.
    """
    t = sigmas.to(torch.float64) * 1000.0
    if quantize:
        # floor with a tolerance for float64 noise (0.3*1000 = 299.99999999999994)
        return torch.floor(t + 1e-6)
    return t

"""Group-relative advantages (method.md §3).

`A_i = (r_i − mean(r)) / (std(r) + 1e-8)` per prompt group (unbiased std), clipped to ±clip.
A group whose rewards are all equal gets A = 0, never NaN. Multi-reward: normalise each reward
within the group separately, then take the weighted sum (MixGRPO's advantage aggregation).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from chunkgrpo.errors import UserError


def _grouped(rewards: torch.Tensor, group_size: int, name: str) -> torch.Tensor:
    r = torch.as_tensor(rewards, dtype=torch.float64).flatten()
    if group_size < 2:
        raise UserError(f"group_size must be >= 2 for group-relative advantages, got {group_size}")
    if r.numel() % group_size:
        raise ValueError(f"{name}: {r.numel()} rewards do not split into groups of {group_size}")
    bad = (~torch.isfinite(r)).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"{name}: non-finite reward at sample(s) {bad[:8]} (values {r[bad[:8]].tolist()})")
    return r.view(-1, group_size)


def normalize_group(rewards: torch.Tensor, group_size: int, *, eps: float = 1e-8, name: str = "reward") -> torch.Tensor:
    """(r − mean) / (std_unbiased + eps) within each consecutive group; exact 0 for constant groups."""
    r = _grouped(rewards, group_size, name)
    mean = r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, unbiased=True, keepdim=True)
    adv = (r - mean) / (std + eps)
    constant = (r.max(dim=1, keepdim=True).values == r.min(dim=1, keepdim=True).values)
    adv = torch.where(constant, torch.zeros_like(adv), adv)
    return adv.flatten()


def group_advantages(rewards: torch.Tensor, group_size: int, *, clip: float = 5.0, eps: float = 1e-8) -> torch.Tensor:
    """Per-prompt normalised advantages, clipped to ±clip (float32, shape (B,))."""
    return normalize_group(rewards, group_size, eps=eps).clamp(-clip, clip).float()


def aggregate_advantages(
    rewards: Mapping[str, torch.Tensor],
    weights: Mapping[str, float],
    group_size: int,
    *,
    clip: float = 5.0,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Multi-reward: Σ_k w_k · normalise_group(r_k), then clipped to ±clip (method.md §3)."""
    if not rewards:
        raise UserError("no rewards given")
    missing = [k for k in rewards if k not in weights]
    if missing:
        raise UserError(f"no weight for reward(s) {missing}; weights given: {dict(weights)}")
    total = None
    for name, r in rewards.items():
        part = float(weights[name]) * normalize_group(r, group_size, eps=eps, name=name)
        total = part if total is None else total + part
    return total.clamp(-clip, clip).float()

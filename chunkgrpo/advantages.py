"""Group-relative advantages (method.md §3).

`A_i = (r_i − mean(r)) / (std(r) + eps)` per prompt group, clipped to ±clip. A group whose rewards are
all equal gets A = 0, never NaN. Multi-reward: normalise each reward within the group separately, then
take the weighted sum (advantage aggregation).

Reference conventions (options, defaults follow DanceGRPO / G2RPO / the Chunk-GRPO authors):
* std: ``"unbiased"`` (Bessel-corrected, + 1e-8: DanceGRPO, MixGRPO, G2RPO, Chunk-GRPO) or
  ``"population"`` (+ 1e-4: Flow-GRPO / TempFlow-GRPO per-prompt stat tracking).
* weights: used as given (DanceGRPO, G2RPO) or normalised to sum 1 (MixGRPO) — `normalize_weights`.
* clip: after the weighted sum; `clip=None` leaves the sum unclipped so a caller can add further terms
  first (G2RPO sums the per-granularity advantages and clips the total).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from chunkgrpo.errors import UserError

STD_MODES = ("unbiased", "population")


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


def normalize_group(rewards: torch.Tensor, group_size: int, *, eps: float = 1e-8, name: str = "reward",
                    std: str = "unbiased") -> torch.Tensor:
    """(r − mean) / (std + eps) within each consecutive group; exact 0 for constant groups.
    `std`: "unbiased" (n − 1) or "population" (n)."""
    if std not in STD_MODES:
        raise UserError(f"unknown advantage std {std!r} (choose one of {STD_MODES})")
    r = _grouped(rewards, group_size, name)
    mean = r.mean(dim=1, keepdim=True)
    sd = r.std(dim=1, unbiased=(std == "unbiased"), keepdim=True)
    adv = (r - mean) / (sd + eps)
    constant = (r.max(dim=1, keepdim=True).values == r.min(dim=1, keepdim=True).values)
    adv = torch.where(constant, torch.zeros_like(adv), adv)
    return adv.flatten()


def group_advantages(rewards: torch.Tensor, group_size: int, *, clip: float = 5.0, eps: float = 1e-8,
                     std: str = "unbiased") -> torch.Tensor:
    """Per-prompt normalised advantages, clipped to ±clip (float32, shape (B,))."""
    return normalize_group(rewards, group_size, eps=eps, std=std).clamp(-clip, clip).float()


def resolve_weights(weights: Mapping[str, float], normalize: bool) -> dict[str, float]:
    """Reward weights as given, or divided by their sum (MixGRPO's normalisation)."""
    w = {k: float(v) for k, v in weights.items()}
    if not normalize:
        return w
    total = sum(w.values())
    if total <= 0:
        raise UserError(f"reward weights {w} sum to {total}; normalised weighting needs a positive sum")
    return {k: v / total for k, v in w.items()}


def aggregate_advantages(
    rewards: Mapping[str, torch.Tensor],
    weights: Mapping[str, float],
    group_size: int,
    *,
    clip: float | None = 5.0,
    eps: float = 1e-8,
    std: str = "unbiased",
    normalize_weights: bool = False,
) -> torch.Tensor:
    """Multi-reward: Σ_k w_k · normalise_group(r_k), then clipped to ±clip (method.md §3).
    `clip=None`: no clip (the caller clips after adding further terms)."""
    if not rewards:
        raise UserError("no rewards given")
    missing = [k for k in rewards if k not in weights]
    if missing:
        raise UserError(f"no weight for reward(s) {missing}; weights given: {dict(weights)}")
    w = resolve_weights({k: weights[k] for k in rewards}, normalize_weights)
    total = None
    for name, r in rewards.items():
        part = w[name] * normalize_group(r, group_size, eps=eps, name=name, std=std)
        total = part if total is None else total + part
    if clip is not None:
        total = total.clamp(-clip, clip)
    return total.float()

"""The policy losses of docs/method.md §4–5: step-level GRPO and Chunk-GRPO.

* §4 step level: `log_ratio` → `clipped_surrogate` (+ `kl_k3`) → `step_policy_loss`;
* §5 chunk level: `chunk_log_ratio` (Eq. 14) → `clipped_surrogate` (+ `kl_k3`) → `chunk_policy_loss`;
* which units a sample trains (part of both losses' definition): `select_units`, with the weights of
  Eq. 15–16 for `chunk+ws` (`l1rel`, `chunk_sampling_weights`).

Log-probs are `(B, S)` step log-probs (S trainable steps). A chunk plan's `sizes` (`chunkgrpo.chunks`)
partition the S steps into consecutive chunks (`check_sizes`).

On-policy exactness: pass `logp_old=None` when no optimizer step happened since the rollout; the
log-ratio is then `logp − logp.detach()`, exactly 0 with the gradient of `logp`, so numerical
mismatch between rollout and training layouts can never clip anything.

Training does not call `chunk_policy_loss` on a whole batch (its activations would not fit): it adds the
same gradient to `.grad` window by window with `chunkgrpo.train.policy_window.window_backward`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from chunkgrpo import checks
from chunkgrpo.errors import UserError

# ----------------------------------------------------------------------------- chunk bookkeeping

def check_sizes(sizes: Sequence[int], num_steps: int | None = None) -> list[int]:
    """A chunk plan's `sizes` as a list of ints: non-empty, every chunk >= 1 step, summing to `num_steps`
    when given."""
    sizes = [int(s) for s in sizes]
    if not sizes:
        raise UserError("chunk plan is empty")
    if any(s < 1 for s in sizes):
        raise UserError(f"chunk sizes must be >= 1 (empty chunk in {sizes})")
    if num_steps is not None and sum(sizes) != num_steps:
        raise UserError(f"chunk sizes {sizes} sum to {sum(sizes)} but there are {num_steps} trainable steps")
    return sizes


def chunk_index(sizes: Sequence[int], device=None) -> torch.Tensor:
    """Chunk id of each step, shape (S,)."""
    sizes = check_sizes(sizes)
    return torch.repeat_interleave(
        torch.arange(len(sizes), device=device), torch.tensor(sizes, device=device)
    )


def chunk_mean(values: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """Mean of (B, S) values within each chunk → (B, K)."""
    sizes = check_sizes(sizes, values.shape[1])
    idx = chunk_index(sizes, device=values.device)
    out = torch.zeros(values.shape[0], len(sizes), dtype=values.dtype, device=values.device)
    out.index_add_(1, idx, values)
    return out / torch.tensor(sizes, dtype=values.dtype, device=values.device)


# ----------------------------------------------------------------------------- the surrogate

def log_ratio(logp_new: torch.Tensor, logp_old: torch.Tensor | None) -> torch.Tensor:
    """logp_new − logp_old; on-policy (logp_old=None): logp_new − logp_new.detach() (exactly 0)."""
    if logp_old is None:
        return logp_new - logp_new.detach()
    return logp_new - logp_old.detach()


def clipped_surrogate(
    ratio: torch.Tensor, adv: torch.Tensor, clip_low: float, clip_high: float
) -> torch.Tensor:
    """ℓ = max(−A·ρ, −A·clip(ρ, 1−ε_lo, 1+ε_hi))  (method.md §4, per unit)."""
    if clip_low < 0 or clip_high < 0:
        raise UserError(f"clip ranges must be >= 0, got clip_low={clip_low}, clip_high={clip_high}")
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped)


def clipped_mask(ratio: torch.Tensor, adv: torch.Tensor, clip_low: float, clip_high: float) -> torch.Tensor:
    """True where the clipped branch is strictly larger, i.e. the unit's gradient is zeroed by the clip."""
    return (-adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)) > (-adv * ratio)


def kl_k3(logp_new: torch.Tensor, logp_old: torch.Tensor) -> torch.Tensor:
    """k3 estimator exp(o − n) − 1 − (o − n) on log-probs (method.md §4)."""
    d = logp_old.detach() - logp_new
    return torch.exp(d) - 1.0 - d


def _masked_mean_per_sample(values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is None:
        return values.mean(dim=1)
    m = mask.to(values.dtype)
    n = m.sum(dim=1)
    if checks.wanted(n) and torch.any(n == 0):  # mask on a GPU: debug checks only
        raise ValueError("a sample has no trained unit (mask row all False)")
    return (values * m).sum(dim=1) / n


def step_policy_loss(logp_new, logp_old, advantages, *, clip_low: float, clip_high: float,
                     mask: torch.Tensor | None = None, kl_coef: float = 0.0) -> torch.Tensor:
    """Step-level GRPO: per-step clipped surrogate averaged over each sample's trained steps, then
    over samples (method.md §4). `mask` (B, S) selects trained steps (timestep_fraction)."""
    ratio = torch.exp(log_ratio(logp_new, logp_old))
    per_step = clipped_surrogate(ratio, advantages.view(-1, 1), clip_low, clip_high)
    if kl_coef:
        old = logp_new.detach() if logp_old is None else logp_old
        per_step = per_step + kl_coef * kl_k3(logp_new, old)
    return _masked_mean_per_sample(per_step, mask).mean()


def chunk_log_ratio(logp_new, logp_old, sizes: Sequence[int]) -> torch.Tensor:
    """Chunk log-ratio (B, K) = mean over the chunk's steps of the step log-ratios (Eq. 14)."""
    return chunk_mean(log_ratio(logp_new, logp_old), sizes)


def chunk_policy_loss(logp_new, logp_old, advantages, sizes, *, clip_low: float, clip_high: float,
                      chunk_mask: torch.Tensor | None = None, kl_coef: float = 0.0) -> torch.Tensor:
    """Chunk-GRPO loss: ρ_k = exp(mean_{t∈k}(logp_t − logp_old,t)) (geometric mean of step ratios),
    ℓ_k = max(−A·ρ_k, −A·clip(ρ_k)), averaged over each sample's trained chunks, then over samples
    (method.md §5). Sizes all 1 is step-level GRPO; one chunk is sequence-level."""
    ratio = torch.exp(chunk_log_ratio(logp_new, logp_old, sizes))
    per_chunk = clipped_surrogate(ratio, advantages.view(-1, 1), clip_low, clip_high)
    if kl_coef:
        old = logp_new.detach() if logp_old is None else logp_old
        per_chunk = per_chunk + kl_coef * kl_k3(chunk_mean(logp_new, sizes), chunk_mean(old, sizes))
    return _masked_mean_per_sample(per_chunk, chunk_mask).mean()


# ----------------------------------------------------------------------------- unit selection

def select_units(batch: int, num_units: int, fraction: float, *, generator: torch.Generator | None = None,
                 weights: torch.Tensor | None = None, device=None) -> torch.Tensor:
    """Which units (steps or chunks) each sample trains: `max(1, int(num_units·fraction))` per sample,
    uniformly (the first ones of a random permutation) or, with `weights` (B, U) ≥ 0, drawn without
    replacement with probability ∝ weight (Eq. 16). Returns a bool mask (B, U)."""
    if not 0 < fraction <= 1:
        raise UserError(f"timestep_fraction must be in (0, 1], got {fraction}")
    k = max(1, int(num_units * fraction))
    mask = torch.zeros(batch, num_units, dtype=torch.bool)
    for b in range(batch):
        if weights is None:
            chosen = torch.randperm(num_units, generator=generator)[:k]
        else:
            w = weights[b].detach().double().cpu().clamp_min(0)
            if not torch.isfinite(w).all() or w.sum() <= 0:
                w = torch.ones(num_units, dtype=torch.float64)
            chosen = torch.multinomial(w, k, replacement=False, generator=generator)
        mask[b, chosen] = True
    return mask.to(device) if device is not None else mask


def l1rel(latents: torch.Tensor) -> torch.Tensor:
    """Relative L1 of adjacent latents (Eq. 15): mean|x_{t+1} − x_t| / mean|x_t|, per sample and
    transition. latents (B, N+1, ...) → (B, N)."""
    x = latents.float()
    diff = (x[:, 1:] - x[:, :-1]).abs().flatten(2).mean(dim=2)
    norm = x[:, :-1].abs().flatten(2).mean(dim=2)
    return diff / (norm + 1e-8)


def chunk_sampling_weights(latents: torch.Tensor, sizes: Sequence[int], mode: str = "l1") -> torch.Tensor:
    """Eq. 16: per sample, chunk weight = mean L1rel of its own trajectory over the chunk's steps;
    probabilities by L1 normalisation ("l1") or softmax ("softmax"). latents (B, N+1, ...)."""
    steps = sum(check_sizes(sizes))
    w = chunk_mean(l1rel(latents)[:, :steps], sizes)
    if mode == "l1":
        return w / w.sum(dim=1, keepdim=True).clamp_min(1e-12)
    if mode == "softmax":
        return torch.softmax(w, dim=1)
    raise UserError(f"unknown chunk weighting {mode!r} (choose 'l1' or 'softmax')")

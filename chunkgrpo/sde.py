"""One sampling step of a flow-matching model, deterministic or stochastic, with its log-prob
(method.md §2). Model-agnostic: every function takes the velocity `v` as a tensor, so the maths is
testable with analytic velocity fields.

Notation: `x` latent at noise level `σ`, `v` velocity, `dt = σ_next − σ < 0`,
`x̂0 = x − σ v`, `x̂1 = x + (1 − σ) v`.

Rules:
* ``"flow"`` (Flow-GRPO, official Chunk-GRPO): `g = η·sqrt(σ / (1 − σ))` (σ_next replaces σ in the
  denominator when σ = 1), `mean = x + dt·[v + g²/(2σ)·(x + (1−σ)·v)]`, `std = g·sqrt(−dt)`.
* ``"dance"`` (DanceGRPO): the same drift with a constant `g = η`, `std = η·sqrt(−dt)`.

The log-prob is the Gaussian log-density of `x_next` under `N(mean, std²)`, computed in fp32 and
averaged (mean, not sum) over all non-batch elements.
"""

from __future__ import annotations

import math

import torch

from chunkgrpo import checks
from chunkgrpo.errors import UserError

RULES = ("flow", "dance")
_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


def _as_batch(value, x: torch.Tensor) -> torch.Tensor:
    """A scalar or per-sample (B,) σ, broadcastable against x (B, ...), in float32."""
    t = torch.as_tensor(value, dtype=torch.float32, device=x.device)
    if t.ndim == 0:
        return t
    if t.ndim != 1 or t.shape[0] != x.shape[0]:
        raise ValueError(f"sigma must be a scalar or shape ({x.shape[0]},), got {tuple(t.shape)}")
    return t.view(-1, *([1] * (x.ndim - 1)))


def _check(sigma: torch.Tensor, sigma_next: torch.Tensor, eta: float, rule: str) -> None:
    if rule not in RULES:
        raise UserError(f"unknown SDE rule {rule!r} (choose one of {RULES})")
    if not eta >= 0:
        raise UserError(f"eta must be >= 0, got {eta!r}")
    if checks.wanted(sigma, sigma_next) and torch.any(sigma_next >= sigma):  # σ on a GPU: debug checks only
        raise ValueError("sigma_next must be smaller than sigma (sampling runs from noise to data)")


def diffusion_coeff(sigma: torch.Tensor, sigma_next: torch.Tensor, eta: float, rule: str) -> torch.Tensor:
    """g: η·sqrt(σ/(1−σ)) for "flow" (σ_next in the denominator at σ = 1), η for "dance"."""
    if rule == "dance":
        return torch.full_like(sigma, float(eta))
    denom_sigma = torch.where(sigma >= 1.0, sigma_next, sigma)
    return eta * torch.sqrt(sigma / (1.0 - denom_sigma))


def step_mean_std(x, v, sigma, sigma_next, *, eta: float, rule: str):
    """Mean and std of the Gaussian transition x → x_next (fp32)."""
    x32, v32 = x.float(), v.float()
    # checked where σ was given (floats, CPU tensors: no device sync), before it moves to x's device
    _check(
        torch.as_tensor(sigma, dtype=torch.float32),
        torch.as_tensor(sigma_next, dtype=torch.float32),
        eta,
        rule,
    )
    s, sn = _as_batch(sigma, x32), _as_batch(sigma_next, x32)
    dt = sn - s
    g = diffusion_coeff(s, sn, eta, rule)
    # mean = x + dt·[v + g²/(2σ)·(x + (1−σ)·v)]   (method.md §2)
    mean = x32 + dt * (v32 + (g * g) / (2.0 * s) * (x32 + (1.0 - s) * v32))
    std = g * torch.sqrt(-dt)
    return mean, std


def gaussian_log_prob(x_next: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """mean over non-batch elements of −(x'−μ)²/(2σ²) − log σ − ½ log 2π  (method.md §2). Shape (B,)."""
    std = std.float()
    if checks.wanted(std) and torch.any(std <= 0):  # std on a GPU: debug checks only
        raise ValueError(
            "log-prob of a deterministic (std = 0) step is undefined; this step is not trainable"
        )
    lp = -((x_next.float() - mean) ** 2) / (2.0 * std * std) - torch.log(std) - _HALF_LOG_2PI
    return lp.flatten(1).mean(dim=1)


def ode_step(x: torch.Tensor, v: torch.Tensor, sigma, sigma_next) -> torch.Tensor:
    """Euler ODE step x' = x + dt·v (in x's dtype, maths in fp32)."""
    x32 = x.float()
    dt = _as_batch(sigma_next, x32) - _as_batch(sigma, x32)
    return (x32 + dt * v.float()).to(x.dtype)


def sde_step(x, v, sigma, sigma_next, *, eta: float, rule: str, noise: torch.Tensor | None = None,
             generator: torch.Generator | None = None):
    """Stochastic step x' = mean + std·ε. Returns (x_next, log_prob (B,)). η = 0 gives the ODE step
    (its log-prob is then undefined and returned as NaN). Without `noise`, ε is drawn with `generator` on
    the generator's device and moved to x's device."""
    mean, std = step_mean_std(x, v, sigma, sigma_next, eta=eta, rule=rule)
    if noise is None:
        gen_device = generator.device if generator is not None else x.device
        noise = torch.randn(x.shape, generator=generator, device=gen_device, dtype=torch.float32)
    x_next = mean + std * noise.float().to(x.device)
    if eta == 0:  # std = 0 everywhere (decided on the host: no device sync)
        return x_next.to(x.dtype), torch.full((x.shape[0],), float("nan"), device=x.device)
    return x_next.to(x.dtype), gaussian_log_prob(x_next, mean, std)


def step_log_prob(x_next, x, v, sigma, sigma_next, *, eta: float, rule: str) -> torch.Tensor:
    """Log-prob (B,) of an observed transition x → x_next under the policy's velocity v.
    Differentiable w.r.t. v (the training-time log-prob)."""
    mean, std = step_mean_std(x, v, sigma, sigma_next, eta=eta, rule=rule)
    return gaussian_log_prob(x_next.detach(), mean, std)


def step_std(sigma, sigma_next, *, eta: float, rule: str) -> torch.Tensor:
    """std_k = g_k·sqrt(−dt_k) for scalar σ's (used by TempFlow noise-aware weighting)."""
    s = torch.as_tensor(sigma, dtype=torch.float64)
    sn = torch.as_tensor(sigma_next, dtype=torch.float64)
    _check(s, sn, eta, rule)
    return diffusion_coeff(s, sn, eta, rule) * torch.sqrt(sn.neg() + s)

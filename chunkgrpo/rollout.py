"""Rollouts: a group of G samples per prompt, sampled in one batch, with per-step log-probs.

`sample_trajectory` is model-agnostic (takes `velocity_fn(x, i) -> v`); `rollout_group` binds it to
a `FluxModel`. All G samples of a prompt start from the same initial noise by default (method.md §3);
any subset of steps may be stochastic; the last transition (σ_{N−1} → 0) is always deterministic
(never trained), so the final state equals x̂0 of the last step, which is what gets decoded.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from chunkgrpo import schedules, sde
from chunkgrpo.config import Config, check_finite, option
from chunkgrpo.errors import UserError


@dataclass
class SamplingConfig(Config):
    """How trajectories are sampled (shared by profiling, training and evaluation)."""

    num_steps: int = option(17, "sampling steps N (σ has N+1 points; N−1 transitions are trainable)")
    schedule: Literal["shift", "dynamic"] = option("shift", "σ schedule: 'shift' (DanceGRPO/Chunk-GRPO) or 'dynamic' (FLUX default)")
    shift: float = option(3.0, "shift s of the shift schedule")
    quantize_timesteps: bool = option(True, "give the transformer int(σ·1000) (shift recipes) instead of σ·1000")
    eta: float = option(0.7, "SDE noise level η")
    rule: Literal["flow", "dance"] = option("flow", "SDE rule: 'flow' (Flow-GRPO, official Chunk-GRPO) or 'dance' (DanceGRPO)")
    height: int = option(720, "image height in pixels")
    width: int = option(720, "image width in pixels")
    guidance: float = option(3.5, "FLUX-dev guidance embedding value (ignored by models without guidance embeds)")
    max_sequence_length: int = option(512, "T5 tokens per prompt")
    same_noise: bool = option(True, "all G samples of a prompt start from the same initial noise")
    stochastic: str = option("all", "which steps are SDE steps: all | none | window:START:END | steps:I,J,K (0-based; the last step is always ODE)")

    def __post_init__(self) -> None:
        if self.num_steps < 2:
            raise UserError(f"num_steps must be >= 2 (one trainable step + the final ODE step), got {self.num_steps}")
        check_finite(self, "sampling.")
        if self.eta < 0:
            raise UserError(f"eta must be >= 0, got {self.eta}")
        if self.shift <= 0:
            raise UserError(f"sampling.shift must be > 0, got {self.shift}")
        if self.height <= 0 or self.width <= 0:
            raise UserError(f"height/width must be positive, got {self.height}x{self.width}")
        self.stochastic_mask()  # validates the spec

    def sigmas(self, image_seq_len: int = 4096) -> torch.Tensor:
        return schedules.make_sigmas(self.schedule, self.num_steps, shift=self.shift, image_seq_len=image_seq_len)

    def timesteps(self, sigmas: torch.Tensor) -> torch.Tensor:
        return schedules.model_timesteps(sigmas, quantize=self.quantize_timesteps)

    def stochastic_mask(self) -> torch.Tensor:
        return parse_stochastic(self.stochastic, self.num_steps)


def parse_stochastic(spec: str, num_steps: int) -> torch.Tensor:
    """(N,) bool: which transitions are SDE steps. The last one is never stochastic."""
    n_train = num_steps - 1
    mask = torch.zeros(num_steps, dtype=torch.bool)
    spec = spec.strip()
    if spec == "all":
        mask[:n_train] = True
    elif spec == "none":
        pass
    elif m := re.fullmatch(r"window:(\d+):(\d+)", spec):
        a, b = int(m.group(1)), int(m.group(2))
        if not 0 <= a < b <= n_train:
            raise UserError(f"stochastic window {spec!r} must satisfy 0 <= START < END <= {n_train}")
        mask[a:b] = True
    elif m := re.fullmatch(r"steps:([\d,\s]+)", spec):
        idx = [int(s) for s in m.group(1).split(",") if s.strip()]
        bad = [i for i in idx if not 0 <= i < n_train]
        if bad:
            raise UserError(f"stochastic steps {bad} out of range 0..{n_train - 1} (the last step is never stochastic)")
        mask[idx] = True
    else:
        raise UserError(f"unknown stochastic spec {spec!r} (use all | none | window:START:END | steps:I,J)")
    return mask


@dataclass
class Trajectory:
    """A batch of sampled trajectories.

    latents (B, N+1, L, C) float32 states x_0 (noise) … x_N; log_probs (B, N) float32 (NaN where the
    step was deterministic); stochastic (N,) bool; sigmas (N+1,) float64; timesteps (N+1,) as given
    to the model; x0 (B, L, C) the decoded prediction x̂0 of the last step.
    """

    latents: torch.Tensor
    log_probs: torch.Tensor
    stochastic: torch.Tensor
    sigmas: torch.Tensor
    timesteps: torch.Tensor
    x0: torch.Tensor
    velocities: torch.Tensor | None = None  # (B, N, L, C) when sampled with keep_velocities=True

    @property
    def num_steps(self) -> int:
        return self.sigmas.numel() - 1

    def select(self, idx) -> "Trajectory":
        return Trajectory(self.latents[idx], self.log_probs[idx], self.stochastic, self.sigmas, self.timesteps, self.x0[idx])


def sample_trajectory(
    velocity_fn: Callable[[torch.Tensor, int], torch.Tensor],
    x_init: torch.Tensor,
    sigmas: torch.Tensor,
    stochastic: torch.Tensor,
    *,
    eta: float,
    rule: str,
    generator: torch.Generator | None = None,
    timesteps: torch.Tensor | None = None,
    keep_velocities: bool = False,
) -> Trajectory:
    """Integrate from x_init along `sigmas`, SDE on stochastic steps, ODE elsewhere (no grad).
    `keep_velocities` stores every step's velocity (branching methods reuse them)."""
    N = sigmas.numel() - 1
    if stochastic.numel() != N:
        raise ValueError(f"stochastic mask has {stochastic.numel()} entries for {N} steps")
    B = x_init.shape[0]
    latents = torch.empty((B, N + 1, *x_init.shape[1:]), dtype=torch.float32, device=x_init.device)
    log_probs = torch.full((B, N), float("nan"), dtype=torch.float32, device=x_init.device)
    x = x_init.float()
    latents[:, 0] = x
    x0 = x
    vels = torch.empty((B, N, *x_init.shape[1:]), dtype=torch.float32, device=x_init.device) if keep_velocities else None
    with torch.no_grad():
        for i in range(N):
            s, sn = float(sigmas[i]), float(sigmas[i + 1])
            v = velocity_fn(x, i)
            if vels is not None:
                vels[:, i] = v
            if i == N - 1:
                x0 = x - s * v  # x̂0 of the last step; the last transition is deterministic
            if bool(stochastic[i]) and i < N - 1:
                noise = torch.randn(x.shape, generator=generator, dtype=torch.float32).to(x.device)
                x, lp = sde.sde_step(x, v, s, sn, eta=eta, rule=rule, noise=noise)
                log_probs[:, i] = lp
            else:
                x = sde.ode_step(x, v, s, sn)
            latents[:, i + 1] = x
    ts = timesteps if timesteps is not None else sigmas * 1000.0
    return Trajectory(latents, log_probs, stochastic.clone(), sigmas.clone(), ts.clone(), x0, vels)


def initial_latents(model, num_prompts: int, group_size: int, cfg: SamplingConfig, generator: torch.Generator):
    """(P·G, L, C) initial noise; shared within each group when cfg.same_noise."""
    if cfg.same_noise:
        base = model.initial_noise(num_prompts, cfg.height, cfg.width, generator)
        return base.repeat_interleave(group_size, dim=0)
    return model.initial_noise(num_prompts * group_size, cfg.height, cfg.width, generator)


def rollout_group(model, cond, group_size: int, cfg: SamplingConfig, generator: torch.Generator,
                  *, transformer=None) -> Trajectory:
    """Sample G trajectories for each of the P prompts in `cond` as one batch of P·G.

    `cond` holds one entry per prompt; sample b belongs to prompt b // G."""
    if group_size < 1:
        raise UserError(f"group_size must be >= 1, got {group_size}")
    x_init = initial_latents(model, len(cond), group_size, cfg, generator)
    cond_rep = cond.repeat_interleave(group_size)
    L = x_init.shape[1]
    sigmas = cfg.sigmas(image_seq_len=L)
    timesteps = cfg.timesteps(sigmas)
    img_ids = model.img_ids(cfg.height, cfg.width)

    def velocity_fn(x, i):
        return model.velocity(x, timesteps[i].reshape(1), cond_rep, img_ids, guidance=cfg.guidance,
                              transformer=transformer)

    return sample_trajectory(velocity_fn, x_init, sigmas, cfg.stochastic_mask(), eta=cfg.eta, rule=cfg.rule,
                             generator=generator, timesteps=timesteps)


def policy_log_probs(model, traj: Trajectory, cond_rep, steps: list[int], cfg: SamplingConfig,
                     *, samples=None, transformer=None) -> torch.Tensor:
    """Training-time log-probs of the recorded transitions at `steps` under the current policy,
    batched as one transformer call over (samples × steps). Returns (b, len(steps)) with grad."""
    idx = torch.arange(traj.latents.shape[0]) if samples is None else torch.as_tensor(samples)
    b, k = idx.numel(), len(steps)
    st = torch.as_tensor(steps)
    lat = traj.latents[idx]                 # (b, N+1, L, C)
    x, x_next = lat[:, st], lat[:, st + 1]  # (b, k, L, C) each
    flat = x.flatten(0, 1)
    sig = traj.sigmas[st].float().repeat(b)
    sig_next = traj.sigmas[st + 1].float().repeat(b)
    t = traj.timesteps[st].float().repeat(b)
    c = cond_rep.index(idx).repeat_interleave(k)
    img_ids = model.img_ids(cfg.height, cfg.width)
    v = model.velocity(flat, t, c, img_ids, guidance=cfg.guidance, transformer=transformer)
    lp = sde.step_log_prob(x_next.flatten(0, 1), flat, v, sig, sig_next, eta=cfg.eta, rule=cfg.rule)
    return lp.view(b, k)

"""Rollouts: a group of G samples per prompt, sampled in one batch, with per-step log-probs.

`sample_trajectory` is model-agnostic (takes `velocity_fn(x, i) -> v`); `rollout_group` binds it to
a `FluxModel`. All G samples of a prompt start from the same initial noise by default (method.md §3);
any subset of steps may be stochastic; the last transition (σ_{N−1} → 0) is always deterministic
(never trained), so the final state equals x̂0 of the last step, which is what gets decoded.

Shared prefix: with the same initial noise, the G samples of a prompt have identical inputs up to and
including the first stochastic step (step 0 by default). The velocity there is computed once per
prompt and broadcast, in the rollout and in training (`pair_log_probs` evaluates each distinct
transformer input once); `Trajectory.input_key` names the distinct inputs.

Rollout noise is drawn on the model's device (`device_generator`): reproducible per device type, and
on the CPU the numbers are exactly those of the iteration's CPU generator.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from chunkgrpo import checks, schedules, sde
from chunkgrpo.config import Config, check_finite, option
from chunkgrpo.errors import UserError


@dataclass
class SamplingConfig(Config):
    """How trajectories are sampled (shared by profiling, training and evaluation)."""

    num_steps: int = option(17, "sampling steps N (σ has N+1 points; N−1 transitions are trainable)")
    schedule: Literal["shift", "dynamic"] = option(
        "shift", "σ schedule: 'shift' (DanceGRPO/Chunk-GRPO) or 'dynamic' (FLUX default)"
    )
    shift: float = option(3.0, "shift s of the shift schedule")
    quantize_timesteps: bool = option(
        True, "give the transformer int(σ·1000) (shift recipes) instead of σ·1000"
    )
    eta: float = option(0.7, "SDE noise level η")
    rule: Literal["flow", "dance"] = option(
        "flow", "SDE rule: 'flow' (Flow-GRPO, official Chunk-GRPO) or 'dance' (DanceGRPO)"
    )
    height: int = option(720, "image height in pixels")
    width: int = option(720, "image width in pixels")
    guidance: float = option(
        3.5, "FLUX-dev guidance embedding value (ignored by models without guidance embeds)"
    )
    max_sequence_length: int = option(512, "T5 tokens per prompt")
    same_noise: bool = option(True, "all G samples of a prompt start from the same initial noise")
    stochastic: str = option(
        "all",
        "which steps are SDE steps: all | none | window:START:END | steps:I,J,K "
        "(0-based; the last step is always ODE)",
    )

    def __post_init__(self) -> None:
        if self.num_steps < 2:
            raise UserError(
                f"num_steps must be >= 2 (one trainable step + the final ODE step), got {self.num_steps}"
            )
        check_finite(self, "sampling.")
        if self.eta < 0:
            raise UserError(f"eta must be >= 0, got {self.eta}")
        if self.shift <= 0:
            raise UserError(f"sampling.shift must be > 0, got {self.shift}")
        if self.height <= 0 or self.width <= 0:
            raise UserError(f"height/width must be positive, got {self.height}x{self.width}")
        if not 1 <= self.max_sequence_length <= 512:
            raise UserError(f"sampling.max_sequence_length={self.max_sequence_length} must be in 1..512 "
                            "(T5 tokens per prompt; FLUX.1-dev uses 512)")
        self.stochastic_mask()  # validates the spec

    def sigmas(self, image_seq_len: int = 4096) -> torch.Tensor:
        return schedules.make_sigmas(
            self.schedule, self.num_steps, shift=self.shift, image_seq_len=image_seq_len
        )

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
            raise UserError(
                f"stochastic steps {bad} out of range 0..{n_train - 1} (the last step is never stochastic)"
            )
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
    group_size: int = 1  # rows come in groups of this many samples of one prompt (same initial noise)
    shared_steps: int = 0  # the inputs x_t of steps t < shared_steps are identical within each group

    @property
    def num_steps(self) -> int:
        return self.sigmas.numel() - 1

    def select(self, idx) -> "Trajectory":
        return Trajectory(
            self.latents[idx], self.log_probs[idx], self.stochastic, self.sigmas, self.timesteps, self.x0[idx]
        )

    def input_key(self, sample: int, step: int) -> tuple[int, int]:
        """(representative sample, step) of the transformer input of (sample, step): equal keys mean the
        same input (x_t, t, prompt), so one velocity evaluation serves them all."""
        if step < self.shared_steps:
            return (sample - sample % self.group_size, step)
        return (sample, step)


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
    group_size: int = 1,
    group_velocity_fn: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
) -> Trajectory:
    """Integrate from x_init along `sigmas`, SDE on stochastic steps, ODE elsewhere (no grad).
    `keep_velocities` stores every step's velocity (branching methods reuse them).

    Shared prefix: with `group_size` G > 1 and `group_velocity_fn`, x_init's rows come in groups of G
    identical rows; up to and including the first stochastic step the states stay identical within
    each group, so `group_velocity_fn(x_groups, i)` is called on one row per group and its velocity
    broadcast to the G rows. The SDE noise is drawn on `generator`'s device."""
    N = sigmas.numel() - 1
    if stochastic.numel() != N:
        raise ValueError(f"stochastic mask has {stochastic.numel()} entries for {N} steps")
    B = x_init.shape[0]
    shared = 0
    if group_size > 1 and group_velocity_fn is not None:
        if B % group_size:
            raise ValueError(f"batch {B} is not a multiple of group_size {group_size}")
        grouped = x_init.float().view(B // group_size, group_size, *x_init.shape[1:])
        if checks.wanted(x_init) and not torch.equal(grouped, grouped[:, :1].expand_as(grouped)):
            raise ValueError("group_velocity_fn needs identical initial noise within each group (same_noise)")
        stoch = [i for i in range(N - 1) if bool(stochastic[i])]
        shared = (stoch[0] + 1) if stoch else N  # steps 0..first stochastic step see identical inputs
    latents = torch.empty((B, N + 1, *x_init.shape[1:]), dtype=torch.float32, device=x_init.device)
    log_probs = torch.full((B, N), float("nan"), dtype=torch.float32, device=x_init.device)
    x = x_init.float()
    latents[:, 0] = x
    x0 = x
    vels = (
        torch.empty((B, N, *x_init.shape[1:]), dtype=torch.float32, device=x_init.device)
        if keep_velocities
        else None
    )
    with torch.no_grad():
        for i in range(N):
            s, sn = float(sigmas[i]), float(sigmas[i + 1])
            if i < shared:  # one evaluation per group, broadcast (the inputs are identical)
                v = group_velocity_fn(x[::group_size], i).repeat_interleave(group_size, dim=0)
            else:
                v = velocity_fn(x, i)
            if vels is not None:
                vels[:, i] = v
            if i == N - 1:
                x0 = x - s * v  # x̂0 of the last step; the last transition is deterministic
            if bool(stochastic[i]) and i < N - 1:
                x, lp = sde.sde_step(x, v, s, sn, eta=eta, rule=rule, generator=generator)
                log_probs[:, i] = lp
            else:
                x = sde.ode_step(x, v, s, sn)
            latents[:, i + 1] = x
    ts = timesteps if timesteps is not None else sigmas * 1000.0
    return Trajectory(latents, log_probs, stochastic.clone(), sigmas.clone(), ts.clone(), x0, vels,
                      group_size=group_size if shared else 1, shared_steps=shared)


def device_generator(generator: torch.Generator, device) -> torch.Generator:
    """A generator on `device` for rollout noise: `generator` itself when it already lives on that device
    type (so CPU results are those of the CPU generator), otherwise a new one on the device, seeded
    from one draw of `generator` (reproducible per device type)."""
    device = torch.device(device)
    if generator.device.type == device.type:
        return generator
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    return torch.Generator(device=device).manual_seed(seed)


def initial_latents(
    model, num_prompts: int, group_size: int, cfg: SamplingConfig, generator: torch.Generator
):
    """(P·G, L, C) initial noise; shared within each group when cfg.same_noise."""
    if cfg.same_noise:
        base = model.initial_noise(num_prompts, cfg.height, cfg.width, generator)
        return base.repeat_interleave(group_size, dim=0)
    return model.initial_noise(num_prompts * group_size, cfg.height, cfg.width, generator)


def rollout_group(model, cond, group_size: int, cfg: SamplingConfig, generator: torch.Generator,
                  *, transformer=None) -> Trajectory:
    """Sample G trajectories for each of the P prompts in `cond` as one batch of P·G.

    `cond` holds one entry per prompt; sample b belongs to prompt b // G. With `same_noise` the shared
    prefix (up to the first stochastic step) is evaluated once per prompt. Initial noise comes from
    `generator` (CPU), SDE noise from `device_generator(generator, model.device)`."""
    if group_size < 1:
        raise UserError(f"group_size must be >= 1, got {group_size}")
    x_init = initial_latents(model, len(cond), group_size, cfg, generator)
    cond_rep = cond.repeat_interleave(group_size)
    L = x_init.shape[1]
    sigmas = cfg.sigmas(image_seq_len=L)
    timesteps = cfg.timesteps(sigmas)
    img_ids = model.img_ids(cfg.height, cfg.width)

    def velocity_fn(x, i, c=cond_rep):
        return model.velocity(x, timesteps[i].reshape(1), c, img_ids, guidance=cfg.guidance,
                              transformer=transformer)

    shared = cfg.same_noise and group_size > 1
    return sample_trajectory(velocity_fn, x_init, sigmas, cfg.stochastic_mask(), eta=cfg.eta, rule=cfg.rule,
                             generator=device_generator(generator, x_init.device), timesteps=timesteps,
                             group_size=group_size if shared else 1,
                             group_velocity_fn=(lambda x, i: velocity_fn(x, i, cond)) if shared else None)


def pair_log_probs(model, traj: Trajectory, cond_rep, samples, steps, cfg: SamplingConfig,
                   *, transformer=None) -> torch.Tensor:
    """Training-time log-probs (n,) of the recorded transitions (samples[j], steps[j]) under the current
    policy, with grad: ONE transformer call over the distinct inputs among the pairs (pairs with equal
    `traj.input_key` share one evaluation, e.g. step 0 of one prompt's samples under same_noise)."""
    samples, steps = [int(b) for b in samples], [int(t) for t in steps]
    if len(samples) != len(steps) or not samples:
        raise ValueError(f"need equally many samples and steps (got {len(samples)} and {len(steps)})")
    keys = [traj.input_key(b, t) for b, t in zip(samples, steps)]
    slot: dict[tuple[int, int], int] = {}
    for k in keys:
        slot.setdefault(k, len(slot))
    uniq = list(slot)
    inv = torch.tensor([slot[k] for k in keys])
    ub, ut = torch.tensor([k[0] for k in uniq]), torch.tensor([k[1] for k in uniq])
    x = traj.latents[ub, ut]  # (u, L, C) distinct inputs
    v = model.velocity(
        x,
        traj.timesteps[ut].float(),
        cond_rep.index(ub),
        model.img_ids(cfg.height, cfg.width),
        guidance=cfg.guidance,
        transformer=transformer,
    )
    sb, st = torch.tensor(samples), torch.tensor(steps)
    if len(uniq) < len(keys):
        x, v = x[inv], v[inv]
    return sde.step_log_prob(
        traj.latents[sb, st + 1],
        x,
        v,
        traj.sigmas[st].float(),
        traj.sigmas[st + 1].float(),
        eta=cfg.eta,
        rule=cfg.rule,
    )


def policy_log_probs(model, traj: Trajectory, cond_rep, steps: list[int], cfg: SamplingConfig,
                     *, samples=None, transformer=None) -> torch.Tensor:
    """Training-time log-probs of the recorded transitions at `steps` under the current policy,
    batched as one transformer call over (samples × steps). Returns (b, len(steps)) with grad."""
    idx = (
        list(range(traj.latents.shape[0]))
        if samples is None
        else [int(b) for b in torch.as_tensor(samples).tolist()]
    )
    pairs_b = [b for b in idx for _ in steps]
    pairs_t = [int(t) for _ in idx for t in steps]
    return pair_log_probs(model, traj, cond_rep, pairs_b, pairs_t, cfg, transformer=transformer).view(
        len(idx), len(steps)
    )

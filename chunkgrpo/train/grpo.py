"""Chunk-GRPO and step-level GRPO (methods `chunk`, `chunk+ws`, `dance`): one iteration.

`_iteration` reads in the method's order (docs/method.md §3–5):

    rollout → rewards → advantages → trained units → per policy window: loss gradient, optimizer step

Per iteration and rank: P prompts × G samples are rolled out as ONE batch (N transformer calls; the
shared prefix of a same-noise group — step 0 by default — once per prompt). Each sample trains
`timestep_fraction` of its units (chunks; steps for `dance`). The samples, in a random order, form
policy windows of `grad_accum` samples with one optimizer step after each, so later windows are
slightly off-policy.

The loss is `objectives.chunk_policy_loss` (every chunk one step for `dance`: `step_policy_loss`) over a
window's samples and trained chunks. Its gradient is added window by window by the policy-window engine
(`chunkgrpo.train.policy_window.window_backward`, the same gradient in memory-sized pieces): batched
across samples up to `policy_batch` transformer inputs, each distinct input evaluated once. In the first
window the policy IS the rollout policy: the ratio is exactly 1 (`logp − logp.detach()`), no old log-prob
and no extra forward is needed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from chunkgrpo import checks
from chunkgrpo import objectives as obj
from chunkgrpo.advantages import aggregate_advantages
from chunkgrpo.rollout import Trajectory, pair_log_probs, rollout_group
from chunkgrpo.scoring.rewards import compute_rewards
from chunkgrpo.train import policy_window
from chunkgrpo.train.config import TrainConfig
from chunkgrpo.train.context import IterationContext, IterationResult, NonFiniteLossError

log = logging.getLogger(__name__)
_warned: set[str] = set()


def steps_per_iteration(cfg: TrainConfig) -> int:
    """Optimizer steps per rollout: one per `grad_accum` samples."""
    return cfg.samples_per_rank // cfg.grad_accum


def policy_layout(cfg: TrainConfig, sizes: list[int], fsdp: bool) -> dict:
    """How windows are trained: strategy, budget, fixed packing (FSDP) and whether a side gradient buffer
    may be spent (keyword arguments of `policy_window.window_backward` / `window_log_probs`)."""
    if fsdp:
        # FSDP collectives need the same forward/backward sequence on every rank: whole units, a fixed
        # number per forward (ranks train different chunks, so per-step or budget-packed counts differ)
        if cfg.chunk_backward in ("per_step", "accumulate") and "fsdp" not in _warned:
            _warned.add("fsdp")
            log.warning(
                "fsdp: chunk_backward=%s replaced by 'graph' (same gradients; every rank must make the "
                "same number of forwards)",
                cfg.chunk_backward,
            )
        return {"strategy": "graph", "budget": cfg.policy_batch,
                "units_per_forward": max(1, cfg.policy_batch // max(sizes)), "side_buffer": False}
    side = (
        cfg.lora.enabled or cfg.chunk_backward == "accumulate"
    )  # full fine-tuning: a parameter-sized buffer
    return {"strategy": cfg.chunk_backward, "budget": cfg.policy_batch, "units_per_forward": None,
            "side_buffer": side}


def iteration(ctx: IterationContext) -> IterationResult:
    with checks.debug(ctx.cfg.debug_checks):
        return _iteration(ctx)


def _iteration(ctx: IterationContext) -> IterationResult:
    timing: dict[str, float] = {}
    ctx.model.counter.reset()
    with _timed(timing, "rollout"):
        traj = rollout(ctx)
    rollout_samples = ctx.model.counter.samples
    with _timed(timing, "reward"):
        images, sample_prompts, rewards = score(ctx, traj)
        adv = advantages(ctx, rewards)
    with _timed(timing, "policy"):
        unit_mask = trained_units(ctx, traj)
        policy = train_policy(ctx, traj, adv, unit_mask)  # per window: loss gradient, optimizer step
    metrics = iteration_metrics(ctx, traj, rewards, adv, unit_mask, policy, rollout_samples, timing)
    return IterationResult(metrics, images, sample_prompts)


# ----------------------------------------------------------------------------- the steps, in order

def rollout(ctx: IterationContext) -> Trajectory:
    """P·G samples in one batch under the current policy, without grad (docs/method.md §2–3)."""
    cfg, model = ctx.cfg, ctx.model
    model.transformer.eval()
    compiled = model.compiled(cfg.compile_backend) if cfg.compile != "off" else None
    with torch.no_grad(), ctx.autocast():
        traj = rollout_group(model, ctx.cond, cfg.group_size, cfg.sampling, ctx.generator,
                             transformer=compiled)
    if not torch.isfinite(traj.log_probs[:, : cfg.trainable_steps]).all():
        raise NonFiniteLossError(f"non-finite rollout log-probs at iteration {ctx.iteration}")
    return traj


def score(ctx: IterationContext, traj: Trajectory) -> tuple[list, list[str], dict[str, torch.Tensor]]:
    """The decoded images, each sample's prompt and every reward's (B,) scores."""
    cfg = ctx.cfg
    images = ctx.model.decode(traj.x0, cfg.sampling.height, cfg.sampling.width)
    sample_prompts = [p for p in ctx.prompts for _ in range(cfg.group_size)]
    return images, sample_prompts, compute_rewards(ctx.reward_fns, images, sample_prompts)


def advantages(ctx: IterationContext, rewards: dict[str, torch.Tensor]) -> torch.Tensor:
    """Group-normalised advantages (B,), one per sample (docs/method.md §3)."""
    cfg = ctx.cfg
    return aggregate_advantages(rewards, ctx.reward_weights, cfg.group_size, clip=cfg.adv_clip,
                                std=cfg.adv_std, eps=cfg.adv_eps).to(ctx.device)


def trained_units(ctx: IterationContext, traj: Trajectory) -> torch.Tensor:
    """Which chunks each sample trains, a bool mask (B, K): uniformly, or weighted by the sample's own
    dynamics for `chunk+ws` (docs/method.md §5.2, §5.5)."""
    cfg, sizes = ctx.cfg, ctx.plan.sizes
    weighted = cfg.method == "chunk+ws"
    weights = obj.chunk_sampling_weights(traj.latents, sizes, cfg.chunk_weighting) if weighted else None
    return obj.select_units(cfg.samples_per_rank, len(sizes), cfg.timestep_fraction, generator=ctx.generator,
                            weights=weights)


@dataclass
class PolicyResult:
    """What the policy phase reports for the metrics."""

    units: list[dict] = field(default_factory=list)  # per trained unit: loss, ratio, log_ratio, clipped
    grad_norms: list[float] = field(default_factory=list)  # one per optimizer step
    min_train_samples: int = 0  # distinct trained transformer inputs, summed over windows
    split: dict = field(default_factory=lambda: {"policy_on_s": 0.0, "policy_off_s": 0.0,
                                                 "policy_on_samples": 0, "policy_off_samples": 0})


def train_policy(ctx: IterationContext, traj: Trajectory, adv: torch.Tensor,
                 unit_mask: torch.Tensor) -> PolicyResult:
    """The samples in a random order, in windows of `grad_accum`; per window the gradient of its loss,
    then one optimizer step. Window 0 is on-policy; later windows take their old log-probs from the
    rollout, or recomputed under θ_old in the training layout (`recompute_old_logp`)."""
    cfg = ctx.cfg
    order = torch.randperm(cfg.samples_per_rank, generator=ctx.generator).tolist()
    windows = [order[j:j + cfg.grad_accum] for j in range(0, len(order), cfg.grad_accum)]
    phase = PolicyPhase.start(ctx, traj, adv, unit_mask)
    result = PolicyResult()
    recomputed = None
    for w, samples in enumerate(windows):
        tw, sw = time.perf_counter(), ctx.model.counter.samples
        units, ids = phase.window_units(samples, on_policy=w == 0, recomputed=recomputed)
        result.min_train_samples += len({traj.input_key(u.sample, t) for u in units for t in u.steps})
        result.units += phase.loss_backward(units, ids)
        if cfg.recompute_old_logp and w == 0 and len(windows) > 1:
            recomputed = recompute_old_log_probs(windows[1:], phase)
        tag = "on" if w == 0 else "off"
        result.split[f"policy_{tag}_s"] += time.perf_counter() - tw
        result.split[f"policy_{tag}_samples"] += ctx.model.counter.samples - sw
        result.grad_norms.append(ctx.optimizer_step()["grad_norm"])
    return result


@dataclass
class PolicyPhase:
    """One iteration's policy phase: the rollout it trains on and how its windows are evaluated."""

    ctx: IterationContext
    traj: Trajectory
    adv: torch.Tensor  # (B,)
    unit_mask: torch.Tensor  # (B, K) bool
    cond_rep: Any  # the conditioning of every sample (each prompt's repeated G times)
    transformer: Any  # the compiled transformer for training (compile=all), else None (the model's own)
    layout: dict  # keyword arguments of window_backward / window_log_probs (`policy_layout`)
    side_buffer: bool
    params: list[torch.Tensor] | None  # the trainable parameters when a side buffer may be spent

    @classmethod
    def start(cls, ctx: IterationContext, traj: Trajectory, adv: torch.Tensor,
              unit_mask: torch.Tensor) -> PolicyPhase:
        cfg, model = ctx.cfg, ctx.model
        cond_rep = ctx.cond.repeat_interleave(cfg.group_size)
        model.transformer.train()
        transformer = model.compiled(cfg.compile_backend) if cfg.compile == "all" else None
        layout = policy_layout(cfg, ctx.plan.sizes, ctx.fsdp)
        side_buffer = layout.pop("side_buffer")
        params = [p for p in model.transformer.parameters() if p.requires_grad] if side_buffer else None
        return cls(ctx, traj, adv, unit_mask, cond_rep, transformer, layout, side_buffer, params)

    def forward(self, samples: list[int], steps: list[int]) -> torch.Tensor:
        """Log-probs (n,), with grad, of the recorded transitions (samples[j], steps[j]) under θ now."""
        with self.ctx.autocast():
            return pair_log_probs(self.ctx.model, self.traj, self.cond_rep, samples, steps,
                                  self.ctx.cfg.sampling, transformer=self.transformer)

    def window_units(self, samples: list[int], *, on_policy: bool,
                     recomputed: dict | None) -> tuple[list[policy_window.Unit], list[tuple[int, int]]]:
        """The window's trained units, each sample's weighted 1/(grad_accum · its trained chunks) (the
        means of `chunk_policy_loss`), and their (sample, chunk) ids. Old log-probs: none on-policy
        (θ = θ_old exactly: ratio 1, gradient flows), else `recomputed` or the rollout's."""
        cfg, plan = self.ctx.cfg, self.ctx.plan
        units, ids = [], []
        for b in samples:
            ks = self.unit_mask[b].nonzero().flatten().tolist()
            for k in ks:
                a, e = plan.ranges[k]
                if on_policy:
                    old = None
                elif recomputed is not None:
                    old = recomputed[(b, k)]
                else:
                    old = self.traj.log_probs[b, a:e].to(self.ctx.device)
                scale = 1.0 / (cfg.grad_accum * len(ks))
                units.append(policy_window.Unit(b, list(range(a, e)), self.adv[b], scale, old))
                ids.append((b, k))
        return units, ids

    def loss_backward(self, units: list[policy_window.Unit], ids: list[tuple[int, int]]) -> list[dict]:
        """Add to `.grad` the gradient of the window's loss: `objectives.chunk_policy_loss` over its
        samples and trained chunks (+ kl_coef·k3), by the policy-window engine. Raises on a non-finite
        unit loss (one host sync per window; the optimizer step syncs anyway)."""
        cfg = self.ctx.cfg
        out = policy_window.window_backward(
            units, self.forward, clip_low=cfg.clip_low, clip_high=cfg.clip_high, kl_coef=cfg.kl_coef,
            params=self.params, key=self.traj.input_key, skip_clipped=not self.ctx.fsdp,
            grad_sync=self.ctx.grad_sync, **self.layout)
        losses = torch.stack([o["loss"] for o in out])
        if not torch.isfinite(losses).all():
            b, k = ids[int((~torch.isfinite(losses)).nonzero()[0])]
            it = self.ctx.iteration
            raise NonFiniteLossError(f"non-finite loss at iteration {it}, sample {b}, chunk {k}")
        return out


def recompute_old_log_probs(windows: list[list[int]], phase: PolicyPhase) -> dict:
    """Old log-probs of the later windows' units under θ_old (no grad), in exactly the forwards those
    windows will make when trained (same batching and sharing, hence the same numerics)."""
    out = {}
    for samples in windows:
        # units without old log-probs: window_log_probs schedules them as the off-policy units they will be
        units, ids = phase.window_units(samples, on_policy=True, recomputed=None)
        values = policy_window.window_log_probs(units, phase.forward, key=phase.traj.input_key,
                                                side_buffer=phase.side_buffer, **phase.layout)
        out.update({ids[j]: v.float() for j, v in enumerate(values)})
    return out


# ----------------------------------------------------------------------------- metrics

def iteration_metrics(ctx: IterationContext, traj: Trajectory, rewards: dict[str, torch.Tensor],
                      adv: torch.Tensor, unit_mask: torch.Tensor, policy: PolicyResult, rollout_samples: int,
                      timing: dict[str, float]) -> dict[str, float]:
    """The iteration's metrics (floats; one host sync for the per-unit statistics)."""
    cfg, sizes, B = ctx.cfg, ctx.plan.sizes, ctx.cfg.samples_per_rank
    calls = ctx.model.counter.as_dict()
    min_train = policy.min_train_samples
    stats = policy.units
    ratio = torch.stack([o["ratio"] for o in stats]).double()
    lr_ = torch.stack([o["log_ratio"] for o in stats]).double()
    summary = torch.stack([torch.stack([o["loss"] for o in stats]).double().mean(),
                           torch.stack([o["clipped"] for o in stats]).double().mean(),
                           ratio.mean(), ratio.min(), ratio.max(),
                           (torch.exp(-lr_) - 1 + lr_).mean()]).tolist()  # k3 on each unit's log-ratio
    trained_pairs = int(sum(sizes[k] for b in range(B) for k in unit_mask[b].nonzero().flatten().tolist()))
    return {
        "reward_mean": float(torch.stack(list(rewards.values())).mean())
        if len(rewards) == 1
        else float(sum(ctx.reward_weights[k] * v.mean() for k, v in rewards.items())),
        "reward_std": float(next(iter(rewards.values())).std()),
        **{f"reward/{k}": float(v.mean()) for k, v in rewards.items()},
        "loss": summary[0],
        "clip_frac": summary[1],
        "ratio_mean": summary[2],
        "ratio_min": summary[3],
        "ratio_max": summary[4],
        "kl_k3": summary[5],
        "grad_norm": max(policy.grad_norms) if policy.grad_norms else 0.0,
        "adv_abs_mean": float(adv.abs().mean()),
        "transformer_forward": calls["transformer_forward"],
        "transformer_forward_with_grad": calls["transformer_forward_with_grad"],
        "transformer_samples": calls["transformer_samples"],
        "rollout_samples": rollout_samples,
        # the algorithm's minimum: every distinct transformer input once per θ — the rollout (a group's shared
        # prefix once per prompt) plus one forward/backward per distinct trained (sample, step) input per
        # window
        "min_transformer_samples": rollout_minimum(traj, cfg.sampling.num_steps, B) + min_train,
        # without sharing identical inputs: every sample evaluates every step in the rollout and in training
        "unshared_transformer_samples": cfg.sampling.num_steps * B + trained_pairs,
        **policy.split,
        **{f"time/{k}": v for k, v in timing.items()},
    }


def rollout_minimum(traj, num_steps: int, batch: int) -> int:
    """Distinct transformer inputs of a rollout: a group's shared prefix counts once per prompt."""
    groups = batch // traj.group_size
    return num_steps * batch - traj.shared_steps * groups * (traj.group_size - 1)


@contextmanager
def _timed(timing: dict[str, float], name: str) -> Iterator[None]:
    t0 = time.perf_counter()
    yield
    timing[name] = time.perf_counter() - t0

"""Chunk-GRPO and step-level GRPO (methods `chunk`, `chunk+ws`, `dance`): one iteration.

rollout → rewards → advantages → unit selection → accumulate → optimizer steps.

Per iteration and rank: P prompts × G samples are rolled out as ONE batch (N transformer calls);
each sample trains `timestep_fraction` of its units (chunks; steps for `dance`); an optimizer step
happens every `grad_accum` samples, so later samples of a rollout are slightly off-policy. Until the
first optimizer step of an iteration the policy IS the rollout policy, so the ratio is computed as
exactly 1 (`logp − logp.detach()`) and no old log-prob or extra forward is needed.
"""

from __future__ import annotations

import math
import time

import torch

from chunkgrpo import objectives as obj
from chunkgrpo.advantages import aggregate_advantages
from chunkgrpo.rollout import policy_log_probs, rollout_group
from chunkgrpo.train.config import TrainConfig
from chunkgrpo.train.context import IterationContext, IterationResult, NonFiniteLossError
from chunkgrpo.train.rewards import compute_rewards


def steps_per_iteration(cfg: TrainConfig) -> int:
    """Optimizer steps per rollout: one per `grad_accum` samples."""
    return cfg.samples_per_rank // cfg.grad_accum


def iteration(ctx: IterationContext) -> IterationResult:
    cfg, model, it = ctx.cfg, ctx.model, ctx.iteration
    tr = model.transformer
    timing = {"rollout": 0.0, "reward": 0.0, "policy": 0.0}
    model.counter.reset()
    gen = ctx.generator
    prompts, cond = ctx.prompts, ctx.cond
    G, B = cfg.group_size, cfg.samples_per_rank
    # ---- rollout: P·G samples in one batch ----
    t0 = time.perf_counter()
    tr.eval()
    with torch.no_grad(), ctx.autocast():
        traj = rollout_group(model, cond, G, cfg.sampling, gen)
    rollout_calls = model.counter.as_dict()
    if not torch.isfinite(traj.log_probs[:, : cfg.trainable_steps]).all():
        raise NonFiniteLossError(f"non-finite rollout log-probs at iteration {it}")
    timing["rollout"] = time.perf_counter() - t0
    # ---- rewards and advantages ----
    t0 = time.perf_counter()
    images = model.decode(traj.x0, cfg.sampling.height, cfg.sampling.width)
    sample_prompts = [p for p in prompts for _ in range(G)]
    rewards = compute_rewards(ctx.reward_fns, images, sample_prompts)
    adv = aggregate_advantages(rewards, ctx.reward_weights, G, clip=cfg.adv_clip, std=cfg.adv_std,
                               eps=cfg.adv_eps).to(ctx.device)
    timing["reward"] = time.perf_counter() - t0
    # ---- which units each sample trains ----
    t0 = time.perf_counter()
    K = len(ctx.sizes)
    weights = obj.chunk_sampling_weights(traj.latents, ctx.sizes, cfg.chunk_weighting) if cfg.method == "chunk+ws" else None
    unit_mask = obj.select_units(B, K, cfg.timestep_fraction, generator=gen, weights=weights)
    order = torch.randperm(B, generator=gen).tolist()
    cond_rep = cond.repeat_interleave(G)
    tr.train()
    stats: dict[str, list[float]] = {"loss": [], "ratio": [], "clipped": [], "kl": [], "grad_norm": []}
    stepped = False
    old_recomputed: dict[tuple[int, int], torch.Tensor] = {}
    for n, b in enumerate(order):
        units = unit_mask[b].nonzero().flatten().tolist()
        scale = 1.0 / (cfg.grad_accum * len(units))
        for k in units:
            a, e = ctx.ranges[k]
            steps = list(range(a, e))
            if not stepped:
                old = None  # θ = θ_old exactly: ratio 1, gradient flows
            elif cfg.recompute_old_logp:
                old = old_recomputed[(b, k)]
            else:
                old = traj.log_probs[b:b + 1, a:e].to(ctx.device)

            def logp_fn(st, b=b):
                with ctx.autocast():
                    return policy_log_probs(model, traj, cond_rep, st, cfg.sampling, samples=[b])

            out = obj.chunk_backward(logp_fn, steps, old, adv[b:b + 1], clip_low=cfg.clip_low,
                                     clip_high=cfg.clip_high, scale=scale, strategy=cfg.chunk_backward,
                                     always_backward=ctx.fsdp, kl_coef=cfg.kl_coef)
            loss = float(out["loss"])
            if not math.isfinite(loss):
                raise NonFiniteLossError(f"non-finite loss at iteration {it}, sample {b}, chunk {k}")
            stats["loss"].append(loss)
            stats["ratio"].append(float(out["ratio"][0]))
            stats["clipped"].append(float(out["clipped"][0]))
            lr_ = math.log(float(out["ratio"][0]))
            stats["kl"].append(math.exp(-lr_) - 1 + lr_)  # k3 on the unit's log-ratio
        if (n + 1) % cfg.grad_accum == 0:
            if cfg.recompute_old_logp and not stepped:
                old_recomputed = recompute_old_log_probs(ctx, traj, cond_rep, order[n + 1:], unit_mask)
            stats["grad_norm"].append(ctx.optimizer_step()["grad_norm"])
            stepped = True
    timing["policy"] = time.perf_counter() - t0
    calls = model.counter.as_dict()
    trained_pairs = int(sum(ctx.sizes[k] for b in range(B) for k in unit_mask[b].nonzero().flatten().tolist()))
    metrics = {
        "reward_mean": float(torch.stack(list(rewards.values())).mean()) if len(rewards) == 1 else
        float(sum(ctx.reward_weights[k] * v.mean() for k, v in rewards.items())),
        "reward_std": float(next(iter(rewards.values())).std()),
        **{f"reward/{k}": float(v.mean()) for k, v in rewards.items()},
        "loss": sum(stats["loss"]) / len(stats["loss"]),
        "clip_frac": sum(stats["clipped"]) / len(stats["clipped"]),
        "ratio_mean": sum(stats["ratio"]) / len(stats["ratio"]),
        "ratio_min": min(stats["ratio"]), "ratio_max": max(stats["ratio"]),
        "kl_k3": sum(stats["kl"]) / len(stats["kl"]),
        "grad_norm": max(stats["grad_norm"]) if stats["grad_norm"] else 0.0,
        "adv_abs_mean": float(adv.abs().mean()),
        "transformer_forward": calls["transformer_forward"],
        "transformer_forward_with_grad": calls["transformer_forward_with_grad"],
        "transformer_samples": calls["transformer_samples"],
        "rollout_samples": rollout_calls["transformer_samples"],
        # the algorithm's minimum: one rollout pass + one forward/backward per trained (sample, step)
        "min_transformer_samples": rollout_calls["transformer_samples"] + trained_pairs,
        **{f"time/{k}": v for k, v in timing.items()},
    }
    return IterationResult(metrics, images, sample_prompts)


def recompute_old_log_probs(ctx: IterationContext, traj, cond_rep, samples: list[int], unit_mask) -> dict:
    """Old log-probs of the not-yet-trained units under θ_old, in the training layout (no grad)."""
    out = {}
    with torch.no_grad():
        for b in samples:
            for k in unit_mask[b].nonzero().flatten().tolist():
                a, e = ctx.ranges[k]
                with ctx.autocast():
                    out[(b, k)] = policy_log_probs(ctx.model, traj, cond_rep, list(range(a, e)), ctx.cfg.sampling,
                                                   samples=[b]).float()
    return out

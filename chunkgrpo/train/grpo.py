"""Chunk-GRPO and step-level GRPO (methods `chunk`, `chunk+ws`, `dance`): one iteration.

rollout → rewards → advantages → unit selection → policy windows → optimizer steps.

Per iteration and rank: P prompts × G samples are rolled out as ONE batch (N transformer calls; the
shared prefix of a same-noise group — step 0 by default — once per prompt). Each sample trains
`timestep_fraction` of its units (chunks; steps for `dance`). The samples, in a random order, form
policy windows of `grad_accum` samples with one optimizer step after each, so later windows are
slightly off-policy. Within a window θ is fixed, so its units are trained together
(`objectives.window_backward`): batched across samples up to `policy_batch` transformer inputs, each
distinct input evaluated once. In the first window the policy IS the rollout policy: the ratio is
exactly 1 (`logp − logp.detach()`), no old log-prob and no extra forward is needed.
"""

from __future__ import annotations

import logging
import time

import torch

from chunkgrpo import checks
from chunkgrpo import objectives as obj
from chunkgrpo.advantages import aggregate_advantages
from chunkgrpo.rollout import pair_log_probs, rollout_group
from chunkgrpo.scoring.rewards import compute_rewards
from chunkgrpo.train.config import TrainConfig
from chunkgrpo.train.context import IterationContext, IterationResult, NonFiniteLossError

log = logging.getLogger(__name__)
_warned: set[str] = set()


def steps_per_iteration(cfg: TrainConfig) -> int:
    """Optimizer steps per rollout: one per `grad_accum` samples."""
    return cfg.samples_per_rank // cfg.grad_accum


def policy_layout(cfg: TrainConfig, sizes: list[int], fsdp: bool) -> dict:
    """How windows are trained: strategy, budget, fixed packing (FSDP) and whether a side gradient buffer
    may be spent (keyword arguments of `objectives.window_backward` / `window_log_probs`)."""
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
        traj = rollout_group(model, cond, G, cfg.sampling, gen,
                             transformer=model.compiled() if cfg.compile != "off" else None)
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
    sizes = ctx.plan.sizes
    K = len(sizes)
    weighted = cfg.method == "chunk+ws"
    weights = obj.chunk_sampling_weights(traj.latents, sizes, cfg.chunk_weighting) if weighted else None
    unit_mask = obj.select_units(B, K, cfg.timestep_fraction, generator=gen, weights=weights)
    order = torch.randperm(B, generator=gen).tolist()
    cond_rep = cond.repeat_interleave(G)
    tr.train()
    train_tr = model.compiled() if cfg.compile == "all" else None
    layout = policy_layout(cfg, sizes, ctx.fsdp)
    side_buffer = layout.pop("side_buffer")
    params = [p for p in tr.parameters() if p.requires_grad] if side_buffer else None

    def forward(samples, steps):
        with ctx.autocast():
            return pair_log_probs(model, traj, cond_rep, samples, steps, cfg.sampling, transformer=train_tr)

    def window_units(samples, w, old_recomputed):
        units, ids = [], []
        for b in samples:
            ks = unit_mask[b].nonzero().flatten().tolist()
            for k in ks:
                a, e = ctx.plan.ranges[k]
                if w == 0:
                    old = None  # θ = θ_old exactly: ratio 1, gradient flows
                elif old_recomputed is not None:
                    old = old_recomputed[(b, k)]
                else:
                    old = traj.log_probs[b, a:e].to(ctx.device)
                units.append(obj.Unit(b, list(range(a, e)), adv[b], 1.0 / (cfg.grad_accum * len(ks)), old))
                ids.append((b, k))
        return units, ids

    windows = [order[j:j + cfg.grad_accum] for j in range(0, B, cfg.grad_accum)]
    stats: list[dict] = []
    grad_norms: list[float] = []
    split = {"policy_on_s": 0.0, "policy_off_s": 0.0, "policy_on_samples": 0, "policy_off_samples": 0}
    min_train = 0
    old_recomputed = None
    for w, samples in enumerate(windows):
        tw, sw = time.perf_counter(), model.counter.samples
        units, ids = window_units(samples, w, old_recomputed)
        min_train += len({traj.input_key(u.sample, t) for u in units for t in u.steps})
        out = obj.window_backward(units, forward, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                                  kl_coef=cfg.kl_coef, params=params, key=traj.input_key,
                                  skip_clipped=not ctx.fsdp, **layout)
        losses = torch.stack([o["loss"] for o in out])
        if not torch.isfinite(losses).all():  # one host sync per window (the optimizer step syncs anyway)
            b, k = ids[int((~torch.isfinite(losses)).nonzero()[0])]
            raise NonFiniteLossError(f"non-finite loss at iteration {it}, sample {b}, chunk {k}")
        stats += out
        if cfg.recompute_old_logp and w == 0 and len(windows) > 1:
            old_recomputed = recompute_old_log_probs(
                windows[1:], window_units, forward, traj, layout, side_buffer
            )
        tag = "on" if w == 0 else "off"
        split[f"policy_{tag}_s"] += time.perf_counter() - tw
        split[f"policy_{tag}_samples"] += model.counter.samples - sw
        grad_norms.append(ctx.optimizer_step()["grad_norm"])
    timing["policy"] = time.perf_counter() - t0
    calls = model.counter.as_dict()
    ratio = torch.stack([o["ratio"] for o in stats]).double()
    lr_ = torch.stack([o["log_ratio"] for o in stats]).double()
    summary = torch.stack([torch.stack([o["loss"] for o in stats]).double().mean(),
                           torch.stack([o["clipped"] for o in stats]).double().mean(),
                           ratio.mean(), ratio.min(), ratio.max(),
                           (torch.exp(-lr_) - 1 + lr_).mean()]).tolist()  # k3 on each unit's log-ratio
    trained_pairs = int(sum(sizes[k] for b in range(B) for k in unit_mask[b].nonzero().flatten().tolist()))
    metrics = {
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
        "grad_norm": max(grad_norms) if grad_norms else 0.0,
        "adv_abs_mean": float(adv.abs().mean()),
        "transformer_forward": calls["transformer_forward"],
        "transformer_forward_with_grad": calls["transformer_forward_with_grad"],
        "transformer_samples": calls["transformer_samples"],
        "rollout_samples": rollout_calls["transformer_samples"],
        # the algorithm's minimum: every distinct transformer input once per θ — the rollout (a group's shared
        # prefix once per prompt) plus one forward/backward per distinct trained (sample, step) input per
        # window
        "min_transformer_samples": rollout_minimum(traj, cfg.sampling.num_steps, B) + min_train,
        # without sharing identical inputs: every sample evaluates every step in the rollout and in training
        "unshared_transformer_samples": cfg.sampling.num_steps * B + trained_pairs,
        **split,
        **{f"time/{k}": v for k, v in timing.items()},
    }
    return IterationResult(metrics, images, sample_prompts)


def rollout_minimum(traj, num_steps: int, batch: int) -> int:
    """Distinct transformer inputs of a rollout: a group's shared prefix counts once per prompt."""
    groups = batch // traj.group_size
    return num_steps * batch - traj.shared_steps * groups * (traj.group_size - 1)


def recompute_old_log_probs(windows, window_units, forward, traj, layout: dict, side_buffer: bool) -> dict:
    """Old log-probs of the later windows' units under θ_old (no grad), in exactly the forwards those
    windows will make when trained (same batching and sharing, hence the same numerics)."""
    out = {}
    for w, samples in enumerate(windows, start=1):
        units, ids = window_units(samples, 0, None)  # plan them as the off-policy units they will be
        values = obj.window_log_probs(units, forward, key=traj.input_key, side_buffer=side_buffer, **layout)
        out.update({ids[j]: v.float() for j, v in enumerate(values)})
    return out

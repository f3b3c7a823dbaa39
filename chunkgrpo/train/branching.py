"""Branching methods: TempFlow-GRPO (method.md §6) and Granular-GRPO (§7), on the same engine.

Per iteration and anchor (prompt × initial noise): one deterministic (ODE) anchor trajectory. For each
trained branching step k: G children take one SDE step from the anchor state x_k (one velocity call
serves all of them — the input is identical across the group), each child is finished by ODE and
scored; the child's reward is credited to step k only, and advantages are normalised per k within
the group of children.

* ``tempflow``: one ODE granularity (every remaining step); the step-k loss is weighted by
  `c·std_k`, `c = 1 / mean(std over trained steps)` (noise-aware weighting, weights average 1).
* ``granular``: each child is finished at several granularities λ (every λ-th remaining step);
  rewards are group-normalised per λ and the advantages SUMMED over λ (multi-granularity).

One optimizer step per trained k (as G2RPO). Our choice: children of step k are sampled right before
step k is trained, i.e. by the current policy, so every update is exactly on-policy (ratio 1 via
`logp − logp.detach()`), with no old log-probs to store and no ratio drift.
"""

from __future__ import annotations

import time

import torch

from chunkgrpo import objectives as obj
from chunkgrpo import sde
from chunkgrpo.advantages import aggregate_advantages
from chunkgrpo.errors import UserError
from chunkgrpo.rollout import sample_trajectory
from chunkgrpo.train.context import IterationContext, IterationResult, NonFiniteLossError
from chunkgrpo.train.rewards import compute_rewards


def branch_steps(cfg) -> list[int]:
    """Trained branching steps: configured, or the first half of the trainable steps."""
    steps = list(cfg.branch_steps) or list(range(max(1, cfg.trainable_steps // 2)))
    if cfg.sampling.eta <= 0:
        raise UserError(f"{cfg.method} needs a stochastic branching step: sampling.eta must be > 0")
    return steps


def steps_per_iteration(cfg) -> int:
    return len(branch_steps(cfg))


def completion_indices(k: int, num_steps: int, granularity: int) -> list[int]:
    """Sigma indices an ODE completion visits from σ_{k+1}: every λ-th remaining point, ending at N."""
    idx = list(range(k + 1, num_steps + 1, granularity))
    if idx[-1] != num_steps:
        idx.append(num_steps)
    return idx


def noise_weights(cfg, steps: list[int], sigmas: torch.Tensor) -> dict[int, float]:
    """TempFlow: c·std_k with c = 1 / mean(std over the trained steps)."""
    s = cfg.sampling
    std = {k: float(sde.step_std(float(sigmas[k]), float(sigmas[k + 1]), eta=s.eta, rule=s.rule)) for k in steps}
    c = len(std) / sum(std.values())
    return {k: c * v for k, v in std.items()}


def iteration(ctx: IterationContext) -> IterationResult:
    """One iteration of TempFlow-/Granular-GRPO."""
    cfg, model = ctx.cfg, ctx.model
    s = cfg.sampling
    it = ctx.iteration
    gen = ctx.generator
    model.counter.reset()
    timing = {"rollout": 0.0, "reward": 0.0, "policy": 0.0}
    prompts, cond = ctx.prompts, ctx.cond
    P, G = len(prompts), cfg.group_size
    L, _ = model.latent_shape(s.height, s.width)
    sigmas = s.sigmas(L)
    ts = s.timesteps(sigmas)
    img_ids = model.img_ids(s.height, s.width)
    steps = branch_steps(cfg)
    grans = list(cfg.granularities) if cfg.method == "granular" else [1]
    weights = noise_weights(cfg, steps, sigmas) if cfg.method == "tempflow" else {k: 1.0 for k in steps}
    cond_rep = cond.repeat_interleave(G)
    tr = model.transformer

    def vel(x, t_idx, c):
        with ctx.autocast():
            return model.velocity(x, ts[t_idx].reshape(1), c, img_ids, guidance=s.guidance)

    # ---- the deterministic anchor trajectory (shared noise per anchor) ----
    t0 = time.perf_counter()
    tr.eval()
    x_init = model.initial_noise(P, s.height, s.width, gen)
    anchor = sample_trajectory(lambda x, i: vel(x, i, cond), x_init, sigmas, torch.zeros(s.num_steps, dtype=torch.bool),
                               eta=0.0, rule=s.rule, timesteps=ts, keep_velocities=True)
    timing["rollout"] += time.perf_counter() - t0
    stats = {"loss": [], "grad_norm": [], "reward": [], "reward_std": [], "min_samples": 0}
    reward_sums: dict[str, list[float]] = {}
    for k in steps:
        # ---- G children from x_k, finished by ODE at every granularity ----
        t0 = time.perf_counter()
        tr.eval()
        x_k, v_k = anchor.latents[:, k], anchor.velocities[:, k]  # the anchor already evaluated v at x_k
        xk_rep, vk_rep = x_k.repeat_interleave(G, 0), v_k.repeat_interleave(G, 0)
        noise = torch.randn(xk_rep.shape, generator=gen, dtype=torch.float32).to(xk_rep.device)
        x_next, _ = sde.sde_step(xk_rep, vk_rep, float(sigmas[k]), float(sigmas[k + 1]), eta=s.eta, rule=s.rule, noise=noise)
        finals = {}
        for lam in grans:
            idx = completion_indices(k, s.num_steps, lam)
            sub_sig, sub_ts = sigmas[idx], ts[idx]
            done = sample_trajectory(lambda x, i, sub_ts=sub_ts: model.velocity(x, sub_ts[i].reshape(1), cond_rep, img_ids,
                                                                                 guidance=s.guidance),
                                     x_next, sub_sig, torch.zeros(len(idx) - 1, dtype=torch.bool), eta=0.0, rule=s.rule)
            finals[lam] = done.x0
        timing["rollout"] += time.perf_counter() - t0
        # ---- rewards: per granularity, normalised per group, summed over λ ----
        t0 = time.perf_counter()
        sample_prompts = [p for p in prompts for _ in range(G)]
        adv = torch.zeros(P * G)
        for lam, x0 in finals.items():
            images = model.decode(x0, s.height, s.width)
            rewards = compute_rewards(ctx.reward_fns, images, sample_prompts)
            adv = adv + aggregate_advantages(rewards, ctx.reward_weights, G, clip=cfg.adv_clip)
            if lam == grans[0]:
                for name, r in rewards.items():
                    reward_sums.setdefault(name, []).append(float(r.mean()))
                total = sum(ctx.reward_weights[n] * r for n, r in rewards.items())
                stats["reward"].append(float(total.mean()))
                stats["reward_std"].append(float(total.std()))
                last = (images, sample_prompts)
        adv = adv.to(ctx.device)
        timing["reward"] += time.perf_counter() - t0
        # ---- policy update on step k: one forward at x_k serves the whole group ----
        t0 = time.perf_counter()
        tr.train()
        with ctx.autocast():
            v = model.velocity(x_k, ts[k].reshape(1), cond, img_ids, guidance=s.guidance)
        logp = sde.step_log_prob(x_next, xk_rep, v.repeat_interleave(G, 0), float(sigmas[k]), float(sigmas[k + 1]),
                                 eta=s.eta, rule=s.rule).view(-1, 1)
        loss = weights[k] * obj.step_policy_loss(logp, None, adv, clip_low=cfg.clip_low, clip_high=cfg.clip_high)
        if not torch.isfinite(loss):
            raise NonFiniteLossError(f"non-finite loss at iteration {it}, branching step {k}")
        loss.backward()
        stats["loss"].append(float(loss.detach()))
        stats["grad_norm"].append(ctx.optimizer_step()["grad_norm"])
        stats["min_samples"] += sum(P * G * (len(completion_indices(k, s.num_steps, lam)) - 1) for lam in grans) + P
        timing["policy"] += time.perf_counter() - t0
    calls = model.counter.as_dict()
    n = len(steps)
    metrics = {
        "reward_mean": sum(stats["reward"]) / n, "reward_std": sum(stats["reward_std"]) / n,
        **{f"reward/{k}": sum(v) / len(v) for k, v in reward_sums.items()},
        "loss": sum(stats["loss"]) / n, "clip_frac": 0.0, "ratio_mean": 1.0, "ratio_min": 1.0, "ratio_max": 1.0,
        "kl_k3": 0.0, "grad_norm": max(stats["grad_norm"]), "adv_abs_mean": float(adv.abs().mean()),
        "transformer_forward": calls["transformer_forward"],
        "transformer_forward_with_grad": calls["transformer_forward_with_grad"],
        "transformer_samples": calls["transformer_samples"],
        "rollout_samples": P * s.num_steps,
        # anchor N·P + per k: the ODE completions (P·G per step and λ) + one training forward (P) for the group
        "min_transformer_samples": P * s.num_steps + stats["min_samples"],
        **{f"time/{k}": v for k, v in timing.items()},
    }
    return IterationResult(metrics, *last)

"""Branching methods: TempFlow-GRPO (method.md §6) and Granular-GRPO / G2RPO (§7), on the same engine.

Per iteration and anchor (one per prompt, its own initial noise): a deterministic (ODE) anchor path.
For each trained branching step k, in order:

1. **one policy forward at the anchor state x_k** (batch P, with grad) — it serves everything below;
2. the G children of each anchor take one SDE step from x_k with that velocity (detached):
   `x_{k+1}^(i) = μ_θ(x_k) + std_k·ε_i` (method.md §2), so they are drawn from the policy being trained;
3. the anchor advances by the ODE step with the same velocity;
4. every child is finished by ODE (no grad) at each granularity λ and scored; advantages are normalised
   per k within each group of G children;
5. the step-k loss is back-propagated through the forward of (1): `logp − logp.detach()` (ratio exactly
   1), so no old log-prob is stored and nothing is clipped by numerical mismatch.

**Exactly on-policy**: the children of step k are sampled by the velocity of the very forward that is
trained on them, after every earlier optimizer step of the iteration (`per_step`) — no stale velocity,
no ratio to correct. The autograd graph of (1) is held while the children are completed; with gradient
checkpointing that is the block inputs of P samples (FLUX 720², 512 text tokens: ≈ 0.9 GB per prompt),
and the completions themselves run without grad. The anchor state x_k is the ODE path of the policy as
it was when each earlier step was visited (`per_iteration`: θ itself, as in the references; `per_step`:
each anchor step uses the policy of that step, which the references approximate by θ_old).

Completion schedules (G2RPO): from the child at σ_{k+1} the ODE visits `σ[:k+2] ++ σ[k+2::λ]`, i.e. one
full step σ_{k+1} → σ_{k+2} (the same for every λ: computed once and shared) and then every λ-th point;
it stops one step early and returns x̂0 = x − σ·v at the last visited σ (when the stride skips σ = 0,
the image is x̂0 at the point before the last). λ = 1 is TempFlow's completion to σ = 0. All children
and all granularities of a step run as one batch per ODE step (per-sample timesteps).

* ``tempflow``: the step-k loss is weighted by `c·std_k`, `c = 1/mean(std over trained steps)` (weights
  average 1; `noise_weight_c` fixes c, TempFlow's released code uses 1.73); optional KL to the reference
  model (LoRA disabled), `β·mean((μ_θ − μ_ref)²)/(2·std_k²)` per anchor (one extra no-grad forward per k).
* ``granular``: per granularity the rewards are group-normalised, the advantages are SUMMED over λ (and
  over rewards) and the sum is clipped at ±adv_clip.

Optimizer steps (`branch_update`): ``per_step`` — one after each trained k (G2RPO); ``per_iteration`` —
the losses of all k (each divided by the number of trained k) are accumulated and one step is taken
per iteration (TempFlow's accumulation over the trained timesteps).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from chunkgrpo import objectives as obj
from chunkgrpo import sde
from chunkgrpo.advantages import aggregate_advantages
from chunkgrpo.errors import UserError
from chunkgrpo.scoring.rewards import compute_rewards
from chunkgrpo.train.context import IterationContext, IterationResult, NonFiniteLossError


def branch_steps(cfg) -> list[int]:
    """Trained branching steps: configured, or the method's reference default — TempFlow trains every
    trainable step 0..N−2, G2RPO the first half of the N steps, 0..N/2−1 (0..7 at N = 16)."""
    if cfg.sampling.eta <= 0:
        raise UserError(f"{cfg.method} needs a stochastic branching step: sampling.eta must be > 0")
    if cfg.branch_steps:
        return sorted(set(int(k) for k in cfg.branch_steps))
    if cfg.method == "tempflow":
        return list(range(cfg.trainable_steps))
    return list(range(max(1, cfg.sampling.num_steps // 2)))


def update_mode(cfg) -> str:
    """`per_step` (G2RPO) or `per_iteration` (TempFlow) — `auto` picks the method's reference."""
    if cfg.branch_update != "auto":
        return cfg.branch_update
    return "per_iteration" if cfg.method == "tempflow" else "per_step"


def steps_per_iteration(cfg) -> int:
    return len(branch_steps(cfg)) if update_mode(cfg) == "per_step" else 1


def granularities(cfg) -> list[int]:
    return list(dict.fromkeys(int(g) for g in cfg.granularities)) if cfg.method == "granular" else [1]


def completion_indices(k: int, num_steps: int, granularity: int) -> list[int]:
    """σ indices an ODE completion of a child of step k visits: `[k+1] ++ range(k+2, N+1, λ)` (G2RPO's
    `σ[:k+2] ++ σ[k+2::λ]` after the branch point). The image is x̂0 at the second-to-last entry."""
    if not 0 <= k <= num_steps - 2:
        raise ValueError(f"branching step {k} out of range 0..{num_steps - 2}")
    return [k + 1, *range(k + 2, num_steps + 1, granularity)]


def noise_weights(cfg, steps: list[int], sigmas: torch.Tensor) -> dict[int, float]:
    """TempFlow: c·std_k, c = noise_weight_c or 1 / mean(std over the trained steps)."""
    s = cfg.sampling
    std = {
        k: float(sde.step_std(float(sigmas[k]), float(sigmas[k + 1]), eta=s.eta, rule=s.rule)) for k in steps
    }
    c = cfg.noise_weight_c or len(std) / sum(std.values())
    return {k: c * v for k, v in std.items()}


def branch_advantages(
    rewards_by_lambda: dict,
    weights: dict,
    group_size: int,
    *,
    clip: float,
    std: str = "unbiased",
    eps: float = 1e-8,
) -> torch.Tensor:
    """Advantages of the children of one branching step: per granularity λ and per reward the rewards are
    normalised within each group of G children, weighted and SUMMED over rewards and λ, and the sum is
    clipped at ±clip (G2RPO clips after the sum, not each term). One λ: the usual group advantage."""
    total = None
    for rewards in rewards_by_lambda.values():
        part = aggregate_advantages(rewards, weights, group_size, clip=None, std=std, eps=eps)
        total = part if total is None else total + part
    return total.clamp(-clip, clip)


# ----------------------------------------------------------------------------- cost model

@dataclass
class Cost:
    """Transformer calls per anchor (prompt × initial noise): per-sample forwards and sequential calls."""

    sample_forwards: int
    sequential_calls: int


def engine_cost(
    num_steps: int, steps: list[int], grans: list[int], group_size: int, kl_ref: bool = False
) -> Cost:
    """What this module does per anchor: anchor steps up to the last trained k (the trained ones are the
    training forwards), one KL reference forward per k if on, and per child the completions with the
    first ODE step shared across granularities; calls = one batched call per ODE round."""
    fwd = seq = 0
    for j in range(max(steps) + 1):
        fwd += 1  # anchor / training forward at x_j (batch of one anchor)
        seq += 1
        if j not in steps:
            continue
        if kl_ref:
            fwd, seq = fwd + 1, seq + 1
        trans = {g: len(completion_indices(j, num_steps, g)) - 1 for g in grans}
        fwd += group_size * (sum(trans.values()) - (len(grans) - 1))  # the shared first step counted once
        seq += max(trans.values())
    return Cost(fwd, seq)


def g2rpo_reference_cost(num_steps: int, steps: list[int], grans: list[int], group_size: int) -> Cost:
    """G2RPO's released trainer, per prompt: a full ODE anchor (N calls, scored), then per child (batch 1)
    and k one SDE forward plus every granularity's completion, all sequential; training: one forward
    (batch 1) per k."""
    per_child = sum(1 + sum(len(completion_indices(k, num_steps, g)) - 1 for g in grans) for k in steps)
    n = num_steps + group_size * per_child + len(steps)
    return Cost(n, n)


def tempflow_reference_cost(num_steps: int, steps: list[int], group_size: int, kl_ref: bool = True) -> Cost:
    """TempFlow-GRPO's released FLUX trainer, per initial noise: the ODE main path (N calls) whose every
    step spawns K children completed by ODE in one batch of K (N − 1 − i calls at step i); training: per
    trained step one forward over the K children (+ one adapter-disabled reference forward with β > 0)."""
    completions = sum(num_steps - 1 - i for i in range(num_steps))
    train = len(steps) * (2 if kl_ref else 1)
    return Cost(num_steps + group_size * completions + group_size * train, num_steps + completions + train)


# ----------------------------------------------------------------------------- the iteration

def iteration(ctx: IterationContext) -> IterationResult:
    """One iteration of TempFlow-/Granular-GRPO."""
    cfg, model = ctx.cfg, ctx.model
    s = cfg.sampling
    it, gen = ctx.iteration, ctx.generator
    model.counter.reset()
    timing = {"rollout": 0.0, "reward": 0.0, "policy": 0.0}
    prompts, cond = ctx.prompts, ctx.cond
    P, G = len(prompts), cfg.group_size
    L, _ = model.latent_shape(s.height, s.width)
    sigmas = s.sigmas(L)
    ts = s.timesteps(sigmas)
    img_ids = model.img_ids(s.height, s.width)
    steps = branch_steps(cfg)
    grans = granularities(cfg)
    per_iteration = update_mode(cfg) == "per_iteration"
    weights = noise_weights(cfg, steps, sigmas) if cfg.method == "tempflow" else {k: 1.0 for k in steps}
    cond_rep = cond.repeat_interleave(G)
    sample_prompts = [p for p in prompts for _ in range(G)]
    tr = model.transformer
    use_kl = cfg.kl_ref_coef > 0

    def vel(x, t, c):
        with ctx.autocast():
            return model.velocity(x, t, c, img_ids, guidance=s.guidance)

    x = model.initial_noise(P, s.height, s.width, gen)  # the anchors' state x_j (one noise per anchor)
    stats = {"loss": [], "kl_ref": [], "grad_norm": [], "reward": [], "reward_std": [], "adv_abs": []}
    reward_sums: dict[str, list[float]] = {}
    last = ([], [])
    for j in range(max(steps) + 1):
        sig, sig_next = float(sigmas[j]), float(sigmas[j + 1])
        t_j = ts[j].reshape(1)
        if j not in steps:  # an untrained anchor step: no grad, batch P
            t0 = time.perf_counter()
            tr.eval()
            with torch.no_grad():
                x = sde.ode_step(x, vel(x, t_j, cond), sig, sig_next)
            timing["rollout"] += time.perf_counter() - t0
            continue
        # ---- (1) the policy forward at x_j: samples the children AND is trained on them ----
        t0 = time.perf_counter()
        tr.train()
        v = vel(x, t_j, cond)                                     # (P, L, C), with grad
        v_d = v.detach()
        x_rep, v_rep = x.repeat_interleave(G, 0), v_d.repeat_interleave(G, 0)
        noise = torch.randn(x_rep.shape, generator=gen, dtype=torch.float32).to(x_rep.device)
        children, _ = sde.sde_step(x_rep, v_rep, sig, sig_next, eta=s.eta, rule=s.rule, noise=noise)
        x_anchor_next = sde.ode_step(x, v_d, sig, sig_next)
        # ---- (4) completions: all children × granularities, one batch per ODE round ----
        tr.eval()
        with torch.no_grad():
            finals = _complete(lambda xb, tb: vel(xb, tb, _rep(cond_rep, xb.shape[0] // (P * G))),
                               children, j, sigmas, ts, s.num_steps, grans)
        timing["rollout"] += time.perf_counter() - t0
        # ---- rewards → advantages: per λ group-normalised, summed over λ, then clipped ----
        t0 = time.perf_counter()
        by_lambda = {}
        for lam in grans:
            images = model.decode(finals[lam], s.height, s.width)
            rewards = by_lambda[lam] = compute_rewards(ctx.reward_fns, images, sample_prompts)
            if lam == grans[0]:
                for name, r in rewards.items():
                    reward_sums.setdefault(name, []).append(float(r.mean()))
                total = sum(ctx.reward_weights[n] * r for n, r in rewards.items())
                stats["reward"].append(float(total.mean()))
                stats["reward_std"].append(float(total.std()))
                last = (images, sample_prompts)
        adv = branch_advantages(by_lambda, ctx.reward_weights, G, clip=cfg.adv_clip, std=cfg.adv_std,
                                eps=cfg.adv_eps).to(ctx.device)
        stats["adv_abs"].append(float(adv.abs().mean()))
        timing["reward"] += time.perf_counter() - t0
        # ---- (5) the step-j loss through the forward of (1) ----
        t0 = time.perf_counter()
        tr.train()
        logp = sde.step_log_prob(children, x_rep, v.repeat_interleave(G, 0), sig, sig_next,
                                 eta=s.eta, rule=s.rule).view(-1, 1)
        loss = weights[j] * obj.step_policy_loss(
            logp, None, adv, clip_low=cfg.clip_low, clip_high=cfg.clip_high
        )
        if use_kl:
            kl = kl_to_reference(ctx, x, v, t_j, cond, img_ids, sig, sig_next)
            loss = loss + cfg.kl_ref_coef * kl
            stats["kl_ref"].append(float(kl.detach()))
        if not torch.isfinite(loss):
            raise NonFiniteLossError(f"non-finite loss at iteration {it}, branching step {j}")
        if ctx.grad_sync is not None:  # FSDP: one reduce-scatter per optimizer step
            ctx.grad_sync(not per_iteration or j == max(steps))
        (loss / len(steps) if per_iteration else loss).backward()
        stats["loss"].append(float(loss.detach()))
        if not per_iteration:
            stats["grad_norm"].append(ctx.optimizer_step()["grad_norm"])
        x = x_anchor_next
        timing["policy"] += time.perf_counter() - t0
    if per_iteration:
        t0 = time.perf_counter()
        stats["grad_norm"].append(ctx.optimizer_step()["grad_norm"])
        timing["policy"] += time.perf_counter() - t0
    calls = model.counter.as_dict()
    n = len(steps)
    cost = engine_cost(s.num_steps, steps, grans, G, kl_ref=use_kl)
    metrics = {
        "reward_mean": sum(stats["reward"]) / n,
        "reward_std": sum(stats["reward_std"]) / n,
        **{f"reward/{k}": sum(v) / len(v) for k, v in reward_sums.items()},
        "loss": sum(stats["loss"]) / n,
        "clip_frac": 0.0,
        "ratio_mean": 1.0,
        "ratio_min": 1.0,
        "ratio_max": 1.0,
        "kl_k3": 0.0,
        "grad_norm": max(stats["grad_norm"]),
        "adv_abs_mean": sum(stats["adv_abs"]) / n,
        **({"kl_ref": sum(stats["kl_ref"]) / n} if use_kl else {}),
        "transformer_forward": calls["transformer_forward"],
        "transformer_forward_with_grad": calls["transformer_forward_with_grad"],
        "transformer_samples": calls["transformer_samples"],
        "rollout_samples": P * (max(steps) + 1),
        # the algorithm's minimum (`engine_cost`): anchor/training forwards + completions, first step shared
        "min_transformer_samples": P * cost.sample_forwards,
        **{f"time/{k}": v for k, v in timing.items()},
    }
    return IterationResult(metrics, *last)


def _rep(cond, n: int):
    """Conditioning for n stacked copies of the P·G children (one per granularity)."""
    return cond if n == 1 else type(cond).cat([cond] * n)


def _complete(vel_fn, children: torch.Tensor, k: int, sigmas, ts, num_steps: int, grans: list[int]) -> dict:
    """Finish every child by ODE at every granularity λ; returns {λ: x̂0 (B, L, C)}.

    Round 0 is the step σ_{k+1} → σ_{k+2} shared by all λ (one call for the B children); afterwards the
    still-running granularities are stacked along the batch with their own per-sample timesteps."""
    B = children.shape[0]
    sched = {g: completion_indices(k, num_steps, g) for g in grans}
    out: dict[int, torch.Tensor] = {}
    i0, i1 = sched[grans[0]][0], sched[grans[0]][1]  # k+1 → k+2, identical for every λ
    v = vel_fn(children, ts[i0].reshape(1))
    if i1 == num_steps or all(len(idx) == 2 for idx in sched.values()):
        x0 = children - float(sigmas[i0]) * v  # x̂0 at the last visited σ
        return {g: x0 for g in grans}
    shared = sde.ode_step(children, v, float(sigmas[i0]), float(sigmas[i1]))
    for g, idx in sched.items():
        if len(idx) == 2:
            out[g] = children - float(sigmas[i0]) * v
    state = {g: shared for g in grans if g not in out}
    pos = {g: 1 for g in state}  # position in sched[g] of the current state
    while state:
        active = list(state)
        xb = torch.cat([state[g] for g in active])
        tb = torch.cat([ts[sched[g][pos[g]]].reshape(1).expand(B) for g in active])
        vb = vel_fn(xb, tb).split(B)
        for g, xg, vg in zip(active, (state[g] for g in active), vb):
            a, b = sched[g][pos[g]], sched[g][pos[g] + 1]
            if pos[g] + 1 == len(sched[g]) - 1:  # the last transition: return x̂0 at σ_a
                out[g] = xg - float(sigmas[a]) * vg
                del state[g]
            else:
                state[g] = sde.ode_step(xg, vg, float(sigmas[a]), float(sigmas[b]))
                pos[g] += 1
    return out


def kl_to_reference(
    ctx: IterationContext, x, v, t, cond, img_ids, sigma: float, sigma_next: float
) -> torch.Tensor:
    """Flow-GRPO/TempFlow KL to the reference model: mean over elements of (μ_θ − μ_ref)² / (2·std²), with
    μ the step mean of the SDE rule and std = g·sqrt(−dt); the reference is the base (adapter disabled)."""
    s, model = ctx.cfg.sampling, ctx.model
    with torch.no_grad(), disabled_adapter(model.transformer), ctx.autocast():
        v_ref = model.velocity(x, t, cond, img_ids, guidance=s.guidance)
    mu, std = sde.step_mean_std(x, v, sigma, sigma_next, eta=s.eta, rule=s.rule)
    mu_ref, _ = sde.step_mean_std(x, v_ref, sigma, sigma_next, eta=s.eta, rule=s.rule)
    # D_KL(π_θ‖π_ref) of two Gaussians with equal std (TempFlow §3, Eq. 6)
    return (((mu - mu_ref) ** 2).flatten(1).mean(dim=1) / (2.0 * std.float() ** 2)).mean()


class disabled_adapter:
    """Run the transformer without its LoRA adapter (the reference policy)."""

    def __init__(self, transformer):
        self.tr = transformer

    def __enter__(self):
        self.tr.disable_adapters()

    def __exit__(self, *exc):
        self.tr.enable_adapters()

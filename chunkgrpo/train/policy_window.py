"""The policy-window engine: the gradient of `objectives.chunk_policy_loss`, in memory-sized pieces.

This module is an exact re-arrangement of `chunkgrpo.objectives.chunk_policy_loss`: it computes the same
gradient, nothing else. A policy window is the samples trained between two optimizer steps, all under one
θ. For the window's samples W (`grad_accum` of them), their trained-chunk mask M and, per trained unit
u = (sample, chunk), `scale_u = 1 / (|W| · trained units of the sample)`, `window_backward` adds to `.grad`

    ∇θ Σ_u scale_u·(ℓ_u + kl_coef·k3_u)
      = ∇θ objectives.chunk_policy_loss(logp[W], logp_old[W], A[W], sizes, chunk_mask=M[W], kl_coef=…)

(equal up to floating-point summation order; `tests/unit/train/test_policy_window.py` checks every
strategy and budget against autograd of `chunk_policy_loss`).

Why it exists: memory. `chunk_policy_loss` takes the window's log-probs as one tensor, i.e. every trained
(sample, step) transformer evaluation with its activations alive until one backward — on FLUX far more
than a GPU holds. The engine evaluates each distinct transformer input once per window (a group's shared
step-0 input once per prompt) with at most `budget` inputs' activations alive at a time. It rests on the
gradient fact of docs/method.md §5.2: ∂(ℓ_k + kl_coef·k3_k)/∂logp_t is one coefficient for every step t of
chunk k (`unit_coefficient`), so a chunk's gradient is that coefficient times Σ_t ∇logp_t and can be formed
piece by piece. The strategies (`window_backward`) differ only in how many inputs are alive at once and
how many forwards they make; docs/policy-phase.md compares them.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch

from chunkgrpo.errors import UserError
from chunkgrpo.objectives import clipped_mask, clipped_surrogate, kl_k3, log_ratio

# Every strategy computes the window's gradient exactly; they differ in how many transformer inputs are
# alive at once (memory) and how many forwards they make (time).
STRATEGIES = ("auto", "graph", "per_step", "accumulate")

KeyFn = Callable[[int, int], Hashable]  # (sample, step) -> identity of its transformer input
ForwardFn = Callable[[list[int], list[int]], torch.Tensor]  # (samples, steps) -> log-probs (n,) with grad


@dataclass
class Unit:
    """One trained unit: the consecutive `steps` (a chunk) of one `sample`, weighted by `scale` in the
    window's loss. `old` (c,) holds the old log-probs, None when θ = θ_old exactly (on-policy)."""

    sample: int
    steps: list[int]
    advantage: torch.Tensor  # 0-d
    scale: float
    old: torch.Tensor | None = None


def unit_coefficient(unit: Unit, logp: torch.Tensor | None, *, clip_low: float, clip_high: float,
                     kl_coef: float = 0.0) -> tuple[torch.Tensor, dict]:
    """The coefficient ∂[scale·(ℓ_k + kl_coef·k3_k)]/∂logp_t, the same for every step t of the unit
    (method.md §5): scale·(κ_k + kl_coef·(1 − e^{−m_k}))/c_k, with m_k the chunk log-ratio and κ_k = −A·ρ_k
    on the unclipped branch, 0 on the clipped one. `logp` (c,) are the unit's current log-probs (not
    needed on-policy, where m_k = 0 exactly). Returns (coefficient, stats), all 0-d tensors."""
    adv = unit.advantage.detach().reshape(())
    if unit.old is None:
        m = torch.zeros((), dtype=torch.float32, device=adv.device)
    else:
        m = (logp.detach() - unit.old.detach().to(logp.dtype)).mean()
    ratio = torch.exp(m)  # ρ_k = exp(mean_t(logp_t − logp_old,t))  (Eq. 14)
    clipped = clipped_mask(ratio, adv, clip_low, clip_high)
    kappa = torch.where(clipped, torch.zeros_like(ratio), -adv * ratio)
    if kl_coef and unit.old is not None:
        kappa = kappa + kl_coef * (1.0 - torch.exp(-m))  # ∂k3/∂m_k
    stats = {"loss": clipped_surrogate(ratio, adv, clip_low, clip_high), "ratio": ratio, "log_ratio": m,
             "clipped": clipped}
    return kappa * (unit.scale / len(unit.steps)), stats


def _unit_loss(unit: Unit, logp: torch.Tensor, clip_low: float, clip_high: float, kl_coef: float):
    """scale·(ℓ_k + kl_coef·k3_k) as a differentiable function of the unit's log-probs (c,)."""
    adv = unit.advantage.detach().reshape(())
    lr = log_ratio(logp, unit.old).mean()
    ratio = torch.exp(lr)
    loss = clipped_surrogate(ratio, adv, clip_low, clip_high)
    total = loss
    if kl_coef and unit.old is not None:
        total = total + kl_coef * kl_k3(logp.mean(), unit.old.mean())
    stats = {"loss": loss.detach(), "ratio": ratio.detach(), "log_ratio": lr.detach(),
             "clipped": clipped_mask(ratio.detach(), adv, clip_low, clip_high)}
    return unit.scale * total, stats


class SideGrad:
    """A gradient sum kept apart from `.grad`: `backward(y)` adds ∇y to it (the parameters' own `.grad`
    is set aside meanwhile and restored), `apply(c)` adds c·Σ to `.grad` and frees it. One extra
    gradient buffer (tiny for LoRA; a parameter copy for full fine-tuning).

    Backward hooks that reduce across ranks (torch DDP, FSDP reduce-scatter) would mix ranks' sums with
    different coefficients: use it only where gradients are reduced once per optimizer step (this
    project's `ddp`); the trainer never uses it under FSDP."""

    def __init__(self, params: Sequence[torch.Tensor]):
        self.params = list(params)
        self.buf: list[torch.Tensor | None] | None = None

    def backward(self, y: torch.Tensor) -> None:
        saved = [p.grad for p in self.params]
        for p, b in zip(self.params, self.buf or [None] * len(self.params)):
            p.grad = b
        try:
            y.backward()
        finally:
            self.buf = [p.grad for p in self.params]
            for p, g in zip(self.params, saved):
                p.grad = g

    def apply(self, coef: torch.Tensor) -> None:
        if self.buf is None:
            return
        for p, b in zip(self.params, self.buf):
            if b is None:
                continue
            b.mul_(coef.to(b.dtype))
            if p.grad is None:
                p.grad = b
            else:
                p.grad.add_(b)
        self.buf = None


@dataclass
class WindowSchedule:
    """Which forwards a window makes. Unit indices refer to the window's unit list; (i, t) = unit i, step t.

    * `weighted`: batches of (i, t) whose coefficient is known before the forward (on-policy units):
      forward with grad, backward Σ coef_i·logp.
    * `graph`: packs of whole units: forward with grad, backward of the packed units' exact loss.
    * `per_step`: no-grad batches giving the per_step units' ratios; their weighted pass follows.
    * `accumulate`: clusters of units sharing transformer inputs: (head batches of the shared (i, t),
      kept alive until the cluster's coefficients are known; per unit its own step groups, all but the
      last backward into a `SideGrad`)."""

    weighted: list[list[tuple[int, int]]]
    graph: list[list[int]]
    per_step: list[list[tuple[int, int]]]
    per_step_units: list[int]
    accumulate: list[tuple[list[list[tuple[int, int]]], list[tuple[int, list[list[int]]]]]]
    steps: dict[int, list[int]]

    def value_batches(self) -> list[list[tuple[int, int]]]:
        """The forwards whose values define off-policy ratios, in execution order (for recomputing old
        log-probs in exactly the training layout)."""
        out = [[(i, t) for i in pack for t in self.steps[i]] for pack in self.graph]
        out += self.per_step
        for heads, units in self.accumulate:
            out += heads
            out += [[(i, t) for t in g] for i, groups in units for g in groups]
        return out


def _keys(unit: Unit, key: KeyFn) -> set:
    return {key(unit.sample, t) for t in unit.steps}


def _clusters(units: Sequence[Unit], idxs: Sequence[int], key: KeyFn) -> list[list[int]]:
    """`idxs` grouped into clusters of units connected through a shared transformer input, in order."""
    parent = {i: i for i in idxs}

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict = {}
    for i in idxs:
        for k in _keys(units[i], key):
            if k in owner:
                parent[find(i)] = find(owner[k])
            else:
                owner[k] = i
    groups: dict[int, list[int]] = {}
    for i in idxs:
        groups.setdefault(find(i), []).append(i)
    return sorted(groups.values(), key=lambda g: idxs.index(g[0]))


def _pack(items: Sequence[tuple[object, set]], budget: int) -> list[list]:
    """Consecutive items into batches whose distinct inputs number ≤ budget (a bigger item goes alone)."""
    batches, cur, seen = [], [], set()
    for item, keys in items:
        if cur and len(seen | keys) > budget:
            batches.append(cur)
            cur, seen = [], set()
        cur.append(item)
        seen |= keys
    if cur:
        batches.append(cur)
    return batches


def _pack_units(units: Sequence[Unit], idxs: Sequence[int], budget: int, key: KeyFn) -> list[list[int]]:
    """Whole units packed ≤ budget distinct inputs per forward; a cluster of units sharing an input is kept
    in one pack when it fits (so the shared input is evaluated once)."""
    items = []
    for cluster in _clusters(units, idxs, key):
        keys = set().union(*(_keys(units[i], key) for i in cluster))
        if len(keys) <= budget:
            items.append((cluster, keys))
        else:
            items += [([i], _keys(units[i], key)) for i in cluster]
    return [[i for c in batch for i in c] for batch in _pack(items, budget)]


def _pair_batches(
    units: Sequence[Unit], idxs: Sequence[int], budget: int, key: KeyFn
) -> list[list[tuple[int, int]]]:
    """All (i, t) of the units, pairs with one input kept together, ≤ budget distinct inputs per batch."""
    by_key: dict = {}
    for i in idxs:
        for t in units[i].steps:
            by_key.setdefault(key(units[i].sample, t), []).append((i, t))
    groups = list(by_key.values())
    return [[p for g in groups[j:j + budget] for p in g] for j in range(0, len(groups), budget)]


def _accumulate_schedule(units: Sequence[Unit], idxs: Sequence[int], budget: int, key: KeyFn):
    clusters = []
    for cluster in _clusters(units, idxs, key):
        count: dict = {}
        for i in cluster:
            for k in _keys(units[i], key):
                count[k] = count.get(k, 0) + 1
        # a shared input is evaluated once and its graph kept until the coefficients of all its units are
        # known; only if that fits the budget next to one own step (otherwise each unit evaluates it)
        shared = {k for k, n in count.items() if n > 1}
        if len(shared) + 1 > budget:
            shared = set()
        group = max(1, budget - len(shared))
        head_pairs: dict = {}
        schedule_units = []
        for i in cluster:
            own = []
            for t in units[i].steps:
                k = key(units[i].sample, t)
                if k in shared:
                    head_pairs.setdefault(k, []).append((i, t))
                else:
                    own.append(t)
            schedule_units.append((i, [own[j:j + group] for j in range(0, len(own), group)]))
        hk = list(head_pairs.values())
        heads = [[p for grp in hk[j:j + budget] for p in grp] for j in range(0, len(hk), budget)]
        clusters.append((heads, schedule_units))
    return clusters


def schedule_window(units: Sequence[Unit], *, strategy: str = "auto", budget: int = 1,
                    key: KeyFn | None = None, units_per_forward: int | None = None, side_buffer: bool = True,
                    assume_off_policy: bool = False) -> WindowSchedule:
    """The forwards of one window (see `window_backward`). Depends only on the units' samples, steps and
    on-/off-policy status, never on values, so it can be replayed (`assume_off_policy` schedules units that
    will be off-policy when trained, for recomputing their old log-probs)."""
    if strategy not in STRATEGIES:
        raise UserError(f"unknown chunk backward strategy {strategy!r} (choose one of {STRATEGIES})")
    budget = max(1, int(budget))
    key = key or (lambda b, t: (b, t))
    all_idx = list(range(len(units)))
    order = [i for c in _clusters(units, all_idx, key) for i in c]
    known = [] if assume_off_policy else [i for i in order if units[i].old is None]
    unknown = [i for i in order if assume_off_policy or units[i].old is not None]
    schedule = WindowSchedule([], [], [], [], [], {i: list(u.steps) for i, u in enumerate(units)})
    if units_per_forward:  # fixed packing: the same forward count on every rank (FSDP)
        n = int(units_per_forward)
        schedule.graph = [order[j:j + n] for j in range(0, len(order), n)]
        return schedule
    if strategy == "graph":
        schedule.graph = _pack_units(units, order, budget, key)
        return schedule
    schedule.weighted = _pair_batches(units, known, budget, key)
    if strategy == "auto":
        fits = [i for i in unknown if len(_keys(units[i], key)) <= budget]
        schedule.graph = _pack_units(units, fits, budget, key)
        unknown = [i for i in unknown if len(_keys(units[i], key)) > budget]
        strategy = "accumulate" if side_buffer else "per_step"
    if strategy == "per_step":
        schedule.per_step = _pair_batches(units, unknown, budget, key)
        schedule.per_step_units = unknown
    else:
        schedule.accumulate = _accumulate_schedule(units, unknown, budget, key)
    return schedule


def window_backward(units: Sequence[Unit], forward: ForwardFn, *, clip_low: float, clip_high: float,
                    strategy: str = "auto", budget: int = 1, kl_coef: float = 0.0,
                    params: Sequence[torch.Tensor] | None = None, key: KeyFn | None = None,
                    units_per_forward: int | None = None, skip_clipped: bool = True,
                    grad_sync: Callable[[bool], None] | None = None) -> list[dict]:
    """Accumulate into `.grad` the gradient of Σ_u scale_u·(ℓ_u + kl_coef·k3_u) over one policy window.

    `forward(samples, steps)` runs the policy on those (sample, step) pairs as one transformer call and
    returns their log-probs (n,) with grad; `key(sample, step)` names each pair's transformer input
    (pairs with equal keys are one evaluation, e.g. step 0 of one prompt's samples). `budget` is the
    memory budget: the most transformer inputs alive in one graph.

    On-policy units (`old` None: ρ = 1 and the coefficient −A·scale/c is known before any forward) go
    through batched weighted passes: ≤ budget inputs per forward, one backward each. Off-policy units:

    * ``"graph"``: a unit's steps in one forward (a unit bigger than the budget still goes whole), whole
      units packed up to the budget, backward of their exact loss — the reference layout. (On-policy too.)
    * ``"per_step"``: a no-grad pass for the ratios (+1 forward per pair), then batched weighted passes;
      fully clipped units are skipped (one host sync per window unless `skip_clipped` is off).
    * ``"accumulate"``: the unit's steps in groups of ≤ budget: each group forwards with grad and, but the
      last, backwards Σ logp into a side buffer (`SideGrad`); after the last group the coefficient is
      known: backward coef·Σ logp and add coef·(side buffer) to `.grad` (method.md §5 gradient fact).
      No extra pass; one gradient buffer (`params`) extra. A shared input (step 0 of one prompt's units)
      is evaluated once and kept until all its units' coefficients are known (if the budget allows).
    * ``"auto"``: off-policy units that fit the budget as packed ``graph``, the others ``accumulate``
      (``per_step`` when `params` is None, i.e. no side buffer may be spent).

    `units_per_forward` forces packs of exactly that many whole units (graph), so every rank makes the
    same number of forwards and backwards (FSDP). `grad_sync(last)` is called before every backward, true
    only for the window's last (FSDP's `set_requires_gradient_sync`: one reduce-scatter per window), and
    with true once the window is done; it needs a backward count known before the first backward (no
    side buffer, `skip_clipped` off). Returns per unit {"loss", "ratio", "log_ratio", "clipped"} (0-d
    tensors, no host sync).
    """
    key = key or (lambda b, t: (b, t))
    if strategy == "accumulate" and params is None:
        raise ValueError(
            "strategy 'accumulate' needs the trainable parameters (params=...) for its side buffer"
        )
    schedule = schedule_window(units, strategy=strategy, budget=budget, key=key,
                               units_per_forward=units_per_forward, side_buffer=params is not None)
    cl = dict(clip_low=clip_low, clip_high=clip_high, kl_coef=kl_coef)
    stats: list[dict | None] = [None] * len(units)
    planned = None
    if grad_sync is not None:
        if schedule.accumulate or (schedule.per_step_units and skip_clipped):
            raise ValueError("grad_sync needs the window's backward count up front: no side buffer "
                             "(accumulate) and skip_clipped=False")
        planned = (len(schedule.weighted) + len(schedule.graph)
                   + len(_pair_batches(units, schedule.per_step_units, max(1, int(budget)), key)))
    done = 0

    def backward(y: torch.Tensor) -> None:
        nonlocal done
        done += 1
        if grad_sync is not None:
            grad_sync(done == planned)
        y.backward()

    try:

        def run(pairs: list[tuple[int, int]]) -> torch.Tensor:
            return forward([units[i].sample for i, _ in pairs], [t for _, t in pairs])

        def weighted(batches, coef: dict) -> None:
            for pairs in batches:
                lp = run(pairs)
                w = torch.stack([coef[i] for i, _ in pairs]).to(lp.dtype)
                backward((w * lp).sum())

        # on-policy: coefficients known up front
        known = {i for pairs in schedule.weighted for i, _ in pairs}
        coef = {}
        for i in known:
            coef[i], stats[i] = unit_coefficient(units[i], None, **cl)
        weighted(schedule.weighted, coef)
        # graph packs
        for pack in schedule.graph:
            lp = run([(i, t) for i in pack for t in units[i].steps])
            total, off = 0.0, 0
            for i in pack:
                c = len(units[i].steps)
                loss, stats[i] = _unit_loss(units[i], lp[off:off + c], clip_low, clip_high, kl_coef)
                total, off = total + loss, off + c
            backward(total)
        # per_step: ratio pass without grad, then weighted passes for the units that are not fully clipped
        if schedule.per_step_units:
            values: dict[tuple[int, int], torch.Tensor] = {}
            with torch.no_grad():
                for pairs in schedule.per_step:
                    lp = run(pairs)
                    values.update({p: lp[j] for j, p in enumerate(pairs)})
            for i in schedule.per_step_units:
                coef[i], stats[i] = unit_coefficient(
                    units[i], torch.stack([values[(i, t)] for t in units[i].steps]), **cl
                )
            live = schedule.per_step_units
            if skip_clipped:
                nonzero = (torch.stack([coef[i] for i in live]) != 0).tolist()  # one host sync per window
                live = [i for i, nz in zip(live, nonzero) if nz]
            weighted(_pair_batches(units, live, max(1, int(budget)), key), coef)
        # accumulate: side buffer per unit; shared inputs evaluated once per cluster
        side = SideGrad(params) if schedule.accumulate else None
        for heads, schedule_units in schedule.accumulate:
            values = {}
            head_lp = []
            for pairs in heads:
                lp = run(pairs)
                head_lp.append((pairs, lp))
                values.update({p: lp[j].detach() for j, p in enumerate(pairs)})
            for i, groups in schedule_units:
                u = units[i]
                last = None
                for g, steps in enumerate(groups):
                    lp = run([(i, t) for t in steps])
                    values.update({(i, t): lp[j].detach() for j, t in enumerate(steps)})
                    if g < len(groups) - 1:
                        side.backward(lp.sum())
                    else:
                        last = lp
                coef[i], stats[i] = unit_coefficient(u, torch.stack([values[(i, t)] for t in u.steps]), **cl)
                if last is not None:
                    backward(coef[i] * last.sum())
                side.apply(coef[i])
            if head_lp:
                backward(sum(torch.stack([coef[i] for i, _ in pairs]).to(lp.dtype).mul(lp).sum()
                             for pairs, lp in head_lp))
        return stats
    finally:
        if grad_sync is not None:
            grad_sync(True)  # the model's default again: sync on every backward outside windows


def window_log_probs(units: Sequence[Unit], forward: ForwardFn, *, strategy: str = "auto", budget: int = 1,
                     key: KeyFn | None = None, units_per_forward: int | None = None,
                     side_buffer: bool = True) -> list[torch.Tensor]:
    """Log-probs (c,) of each unit, without grad, computed in exactly the forwards `window_backward` will
    use for these units once they are off-policy (recomputed old log-probs in the training layout)."""
    schedule = schedule_window(units, strategy=strategy, budget=budget, key=key,
                               units_per_forward=units_per_forward, side_buffer=side_buffer,
                               assume_off_policy=True)
    values: dict[tuple[int, int], torch.Tensor] = {}
    with torch.no_grad():
        for pairs in schedule.value_batches():
            lp = forward([units[i].sample for i, _ in pairs], [t for _, t in pairs])
            values.update({p: lp[j] for j, p in enumerate(pairs)})
    return [torch.stack([values[(i, t)] for t in u.steps]) for i, u in enumerate(units)]

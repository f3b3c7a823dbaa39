"""The policy-window engine (`chunkgrpo.train.policy_window`) against the loss it re-arranges: every strategy,
memory budget and input sharing gives the gradient of `objectives.chunk_policy_loss` (and of a brute-force
per-unit loss), and the engine's forward counts and live inputs stay within the budget."""

import pytest
import torch

from chunkgrpo import objectives as obj
from chunkgrpo.train import policy_window as pw

# float results compared across formulas and layouts: CI runs these under every ATEN_CPU_CAPABILITY
pytestmark = pytest.mark.exactness

class StandIn:
    """A stand-in policy over (sample, step) pairs in float64: samples come in groups of G sharing the input
    of step 0 (same_noise), so `key` names distinct inputs and `forward` evaluates each once (like
    rollout.pair_log_probs). Two parameter tensors (a LoRA-like pair)."""

    def __init__(self, B=6, G=3, S=6, d=5, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.G = G
        self.feat = {}
        for b in range(B):
            for t in range(S):
                k = self.key(b, t)
                if k not in self.feat:
                    self.feat[k] = torch.randn(d, generator=g, dtype=torch.float64)
        self.y = torch.randn(B, S, d, generator=g, dtype=torch.float64)
        self.w1 = torch.nn.Parameter(0.5 * torch.randn(d, d, generator=g, dtype=torch.float64))
        self.w2 = torch.nn.Parameter(0.5 * torch.randn(d, d, generator=g, dtype=torch.float64))
        self.params = [self.w1, self.w2]
        self.calls = self.inputs = 0
        self.layout_noise = 0.0  # > 0: results depend on the call's batch size, like real kernels

    def key(self, b, t):
        return (b - b % self.G, 0) if t == 0 else (b, t)

    def forward(self, samples, steps):
        keys = [self.key(b, t) for b, t in zip(samples, steps)]
        uniq = list(dict.fromkeys(keys))
        self.calls += 1
        self.inputs += len(uniq)
        x = torch.stack([self.feat[k] for k in uniq])
        h = torch.tanh(x @ self.w1.T) @ self.w2.T  # the "transformer": once per distinct input
        h = h * (1 + self.layout_noise * len(uniq))
        h = h[[uniq.index(k) for k in keys]]
        return -0.1 * ((h - self.y[samples, steps]) ** 2).mean(-1)

    def grads(self):
        return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in self.params]

    def zero(self):
        for p in self.params:
            p.grad = None


def _units(pol, off_policy, seed=1):
    """Units of 6 samples on chunks [0,1] / [2,3,4] / [5]; old log-probs from a perturbed policy."""
    g = torch.Generator().manual_seed(seed)
    adv = torch.randn(6, generator=g, dtype=torch.float64)
    chunks = {
        0: [[0, 1], [5]],
        1: [[0, 1], [2, 3, 4]],
        2: [[2, 3, 4]],
        3: [[0, 1]],
        4: [[0, 1], [5]],
        5: [[2, 3, 4], [5]],
    }
    units = []
    for b, cs in chunks.items():
        for steps in cs:
            old = None
            if off_policy:
                with torch.no_grad():
                    old = pol.forward([b] * len(steps), steps) + 0.02 * torch.randn(
                        len(steps), generator=g, dtype=torch.float64
                    )
            units.append(pw.Unit(b, steps, adv[b], 1.0 / (6 * len(cs)), old))
    return units


def _reference(pol, units, clip, kl_coef):
    """Brute force: autograd of Σ_u scale_u·(ℓ_u + kl_coef·k3_u), every pair evaluated on its own."""
    pol.zero()
    total = 0.0
    for u in units:
        lp = pol.forward([u.sample] * len(u.steps), u.steps)
        old = lp.detach() if u.old is None else u.old
        lr = (lp - old).mean()
        ratio = torch.exp(lr)
        loss = torch.maximum(-u.advantage * ratio, -u.advantage * ratio.clamp(1 - clip, 1 + clip))
        if kl_coef and u.old is not None:
            loss = loss + kl_coef * obj.kl_k3(lp.mean(), u.old.mean())
        total = total + u.scale * loss
    total.backward()
    out = pol.grads()
    pol.zero()
    return out


SIZES = [2, 3, 1]  # the chunks of `_units`: steps [0, 1] / [2, 3, 4] / [5]


def _chunk_policy_loss_grads(pol, units, clip, kl_coef):
    """Autograd of `objectives.chunk_policy_loss` over the window: the (B, S) log-probs of every step, the
    units as the chunk mask, their old log-probs (None when every unit is on-policy)."""
    B, S = pol.y.shape[:2]
    pol.zero()
    logp = pol.forward([b for b in range(B) for _ in range(S)], [t for _ in range(B) for t in range(S)])
    logp = logp.view(B, S)
    starts = [sum(SIZES[:k]) for k in range(len(SIZES))]
    mask = torch.zeros(B, len(SIZES), dtype=torch.bool)
    adv = torch.zeros(B, dtype=torch.float64)
    old = logp.detach().clone()  # untrained chunks: ratio 1 (masked out anyway)
    for u in units:
        mask[u.sample, starts.index(u.steps[0])] = True
        adv[u.sample] = u.advantage
        if u.old is not None:
            old[u.sample, u.steps] = u.old
    on_policy = all(u.old is None for u in units)
    loss = obj.chunk_policy_loss(logp, None if on_policy else old, adv, SIZES, clip_low=clip, clip_high=clip,
                                 chunk_mask=mask, kl_coef=kl_coef)
    loss.backward()
    out = pol.grads()
    pol.zero()
    return out


@pytest.mark.parametrize("off_policy,kl_coef", [(False, 0.0), (True, 0.0), (True, 0.3)])
def test_window_strategies_give_equal_gradients(off_policy, kl_coef):
    """graph, per_step, accumulate and auto, at budgets from 1 input to everything at once, with and without
    the shared step-0 input: all equal the gradient of `objectives.chunk_policy_loss` over the window (and
    the brute-force per-unit gradient). float64: they differ only in summation order, so the tolerance is a
    few hundred ulps of the gradient's scale."""
    pol = StandIn()
    units = _units(pol, off_policy)
    clip = 0.01  # some off-policy units clipped, some not
    ref = _reference(pol, units, clip, kl_coef)
    loss_ref = _chunk_policy_loss_grads(pol, units, clip, kl_coef)
    scale = max(float(g.abs().max()) for g in ref)
    tol = 500 * torch.finfo(torch.float64).eps * scale
    for g, r in zip(loss_ref, ref):
        assert torch.allclose(g, r, rtol=0, atol=tol), float((g - r).abs().max())
    if off_policy:
        clipped = [
            bool(
                pw.unit_coefficient(
                    u, pol.forward([u.sample] * len(u.steps), u.steps), clip_low=clip, clip_high=clip
                )[1]["clipped"]
            )
            for u in units
        ]
        assert any(clipped) and not all(clipped)  # the test exercises both branches
    for strategy in pw.STRATEGIES:
        for budget in (1, 2, 3, 100):
            for shared in (True, False):
                key = pol.key if shared else (lambda b, t: (b, t))
                pol.zero()
                stats = pw.window_backward(
                    units,
                    pol.forward,
                    clip_low=clip,
                    clip_high=clip,
                    kl_coef=kl_coef,
                    strategy=strategy,
                    budget=budget,
                    params=pol.params,
                    key=key,
                )
                got = pol.grads()
                for g, r in [*zip(got, ref), *zip(got, loss_ref)]:
                    assert torch.allclose(g, r, rtol=0, atol=tol), (
                        strategy,
                        budget,
                        shared,
                        float((g - r).abs().max()),
                    )
                assert len(stats) == len(units) and all(s is not None for s in stats)
                if not off_policy:
                    assert all(float(s["ratio"]) == 1.0 for s in stats)  # exactly 1 on-policy
    assert max(float(g.abs().max()) for g in ref) > 0


def _count(pol, units, **kw):
    pol.zero()
    pol.calls = pol.inputs = 0
    pw.window_backward(units, pol.forward, clip_low=1.0, clip_high=1.0, params=pol.params, key=pol.key, **kw)
    return pol.calls, pol.inputs


def test_window_forward_counts_and_memory_budget():
    pol = StandIn()
    on, off = _units(pol, False), _units(pol, True)
    pairs = sum(len(u.steps) for u in on)  # 20 (sample, step) pairs
    distinct = len(
        {pol.key(u.sample, t) for u in on for t in u.steps}
    )  # step 0 of samples 0,1 and of 3,4 shared
    assert distinct == pairs - 2
    # on-policy: every distinct input exactly once, whatever the strategy; batches of ≤ budget inputs
    for strategy in ("auto", "per_step", "accumulate"):
        assert _count(pol, on, strategy=strategy, budget=1) == (distinct, distinct)
        assert _count(pol, on, strategy=strategy, budget=4) == (-(-distinct // 4), distinct)
    # off-policy per_step pays a second pass; accumulate and graph do not
    assert _count(pol, off, strategy="per_step", budget=1)[1] == 2 * distinct
    assert (
        _count(pol, off, strategy="accumulate", budget=1)[1] == pairs
    )  # budget 1: no shared graph kept alive
    assert _count(pol, off, strategy="accumulate", budget=2)[1] == distinct  # step 0 once per prompt
    assert _count(pol, off, strategy="graph", budget=100) == (1, distinct)
    assert _count(pol, off, strategy="auto", budget=3)[1] == distinct
    # fixed packing (FSDP): the forward count depends on the unit count only
    assert _count(pol, off, strategy="graph", units_per_forward=2)[0] == -(-len(off) // 2)


def test_window_inputs_alive_never_exceed_the_budget():
    """Track how many distinct inputs have a live graph (forwards whose backward has not run yet)."""
    pol = StandIn()
    units = _units(pol, True)
    alive, peak = [], [0]
    inner = pol.forward

    def forward(samples, steps):
        lp = inner(samples, steps)
        if not lp.requires_grad:  # per_step's ratio pass: no graph
            return lp
        n = len({pol.key(b, t) for b, t in zip(samples, steps)})
        alive.append(n)
        peak[0] = max(peak[0], sum(alive))
        lp.register_hook(lambda g, n=n: alive.remove(n))
        return lp

    for strategy, budget in (("accumulate", 1), ("accumulate", 2), ("auto", 3), ("per_step", 2)):
        alive.clear()
        peak[0] = 0
        pw.window_backward(units, forward, clip_low=1.0, clip_high=1.0, strategy=strategy, budget=budget,
                            params=pol.params, key=pol.key)
        assert 0 < peak[0] <= budget, (strategy, budget, peak[0])


def test_recomputed_old_log_probs_replay_the_training_layout():
    """Old log-probs recomputed with window_log_probs come from the very forwards training makes, so at
    θ = θ_old every off-policy ratio is exactly 1 (bitwise), for every strategy, even though the policy's
    numerics depend on the batch layout; old log-probs from another layout are not."""
    pol = StandIn()
    pol.layout_noise = 1e-9
    for strategy in pw.STRATEGIES:
        units = _units(pol, False)
        olds = pw.window_log_probs(units, pol.forward, strategy=strategy, budget=3, key=pol.key)
        for u, o in zip(units, olds):
            u.old = o
        stats = pw.window_backward(
            units,
            pol.forward,
            clip_low=0.1,
            clip_high=0.1,
            strategy=strategy,
            budget=3,
            params=pol.params,
            key=pol.key,
        )
        assert all(float(s["log_ratio"]) == 0.0 for s in stats), strategy
    # the same units with old log-probs from one forward per unit (the rollout's layout differs likewise)
    for u in units:
        with torch.no_grad():
            u.old = pol.forward([u.sample] * len(u.steps), u.steps)
    stats = pw.window_backward(units, pol.forward, clip_low=0.1, clip_high=0.1, strategy="auto", budget=3,
                                params=pol.params, key=pol.key)
    assert any(float(s["log_ratio"]) != 0.0 for s in stats)


def test_side_buffer_keeps_grad_apart():
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    (w * 3).sum().backward()  # .grad = [3, 3] from earlier units
    side = pw.SideGrad([w])
    side.backward((w ** 2).sum())  # Σ = 2w = [2, 4], kept apart
    assert torch.equal(w.grad, torch.tensor([3.0, 3.0]))
    side.backward(w.sum())  # Σ += 1
    side.apply(torch.tensor(0.5))
    assert torch.equal(w.grad, torch.tensor([3.0 + 1.5, 3.0 + 2.5]))


def test_grad_sync_only_at_the_last_backward_of_a_window():
    """grad_sync(False) before every backward but the window's last, grad_sync(True) before the last and
    again when the window is done (FSDP: one reduce-scatter per optimizer step)."""
    m = StandIn()
    adv = torch.tensor([1.0, -0.5, 0.3, -1.2, 0.8, 0.1], dtype=torch.float64)
    old = lambda b: torch.full((2,), -0.1, dtype=torch.float64)  # noqa: E731
    units = [pw.Unit(b, [1, 2], adv[b], 0.1, None if b < 2 else old(b)) for b in range(6)]
    seen, backwards = [], []
    orig = torch.Tensor.backward

    def counting(self, *a, **k):
        backwards.append(len(seen))
        return orig(self, *a, **k)

    torch.Tensor.backward = counting
    try:
        pw.window_backward(units, m.forward, clip_low=0.2, clip_high=0.2, strategy="graph", budget=2,
                           key=m.key, units_per_forward=2, skip_clipped=False, grad_sync=seen.append)
    finally:
        torch.Tensor.backward = orig
    assert len(backwards) == 3  # 6 units, 2 per forward
    assert seen == [False, False, True, True]  # the last backward syncs; the default is restored after
    assert backwards == [1, 2, 3]  # each call came right before its backward
    synced = [p.grad.clone() for p in m.params]
    for p in m.params:
        p.grad = None
    pw.window_backward(units, m.forward, clip_low=0.2, clip_high=0.2, strategy="graph", budget=2,
                       key=m.key, units_per_forward=2, skip_clipped=False)
    for a, b in zip(synced, (p.grad for p in m.params)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the gradient itself is untouched


def test_grad_sync_needs_a_known_backward_count():
    m = StandIn()
    units = [pw.Unit(b, [1, 2, 3], torch.tensor(1.0, dtype=torch.float64), 0.1,
                     torch.zeros(3, dtype=torch.float64)) for b in range(2)]
    for strategy, skip in (("accumulate", False), ("per_step", True)):
        with pytest.raises(ValueError, match="backward count"):
            pw.window_backward(units, m.forward, clip_low=0.2, clip_high=0.2, strategy=strategy, budget=1,
                               params=m.params, key=m.key, skip_clipped=skip, grad_sync=lambda last: None)
    seen = []  # per_step without skipping: counted up front (2 units × 3 steps, 1 input per forward)
    pw.window_backward(units, m.forward, clip_low=0.2, clip_high=0.2, strategy="per_step", budget=1,
                       key=m.key, skip_clipped=False, grad_sync=seen.append)
    assert seen == [False] * 5 + [True, True]

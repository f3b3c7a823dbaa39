"""TempFlow-GRPO and Granular-GRPO (chunkgrpo.train.branching) on the tiny FLUX (CPU)."""

import math

import numpy as np
import pytest
import torch

from chunkgrpo import sde
from chunkgrpo.advantages import normalize_group
from chunkgrpo.train import branching as br
from chunkgrpo.train.config import TrainConfig
from chunkgrpo.train.trainer import Trainer


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("data") / "prompts.txt"
    p.write_text("a cat on a chair\na red car\nthree apples\na bowl of fruit\n")
    return p


def _trainer(tiny_model_dir, prompts_file, out, *over):
    cfg = TrainConfig.load(
        "tiny_cpu",
        [
            f"model={tiny_model_dir}",
            f"prompts={prompts_file}",
            f"output_dir={out}",
            "progress=false",
            "checkpoint.every=0",
            "checkpoint.resume=false",
            "tracking.image_every=0",
            *over,
        ],
    )
    t = Trainer(cfg)
    t.setup()
    return t


class Recorder:
    """Wraps FluxModel.velocity and the optimizer step: every call's input, timestep, grad mode and output,
    with None marking each optimizer step."""

    def __init__(self, t: Trainer):
        self.calls, self.orig = [], t.model.velocity
        step = t._optimizer_step

        def velocity(x, ts, cond, ids, **kw):
            out = self.orig(x, ts, cond, ids, **kw)
            self.calls.append(
                (x.detach().clone(), ts.detach().clone(), torch.is_grad_enabled(), out.detach().clone())
            )
            return out

        def optimizer_step():
            self.calls.append(None)
            return step()

        t.model.velocity, t._optimizer_step = velocity, optimizer_step


def test_children_after_an_update_are_drawn_from_the_current_policy(tiny_model_dir, prompts_file, tmp_path):
    """After the optimizer step at k0 = 0, the G children of k1 = 2 must be distributed as
    N(μ(x_k1, v_current), std²), not N(μ(x_k1, v_stale), std²) with the velocity from before the update.
    The update is made large (lr 1, small η) so the two means are far apart in units of std/√G."""
    G, k1 = 16, 2
    t = _trainer(tiny_model_dir, prompts_file, tmp_path, "method=tempflow", "branch_steps=[0,2]",
                 "branch_update=per_step", f"group_size={G}", "lr=1.0", "sampling.eta=0.1", "max_steps=2")
    rec = Recorder(t)
    init = {n: p.detach().clone() for n, p in t.model.transformer.named_parameters() if p.requires_grad}
    t.iteration()
    assert t.opt_step == 2
    s = t.cfg.sampling
    sig = s.sigmas(t.model.latent_shape(s.height, s.width)[0])
    ts = s.timesteps(sig)
    calls = rec.calls
    # the training forward at x_k1 (with grad): its input is the anchor state, its output the current velocity
    gi = next(i for i, c in enumerate(calls) if c and c[2] and float(c[1][0]) == float(ts[k1]))
    x_k, v_cur = calls[gi][0], calls[gi][3]
    P = x_k.shape[0]
    # the children of k1: input of the first completion call at σ_{k1+1} after the first optimizer step
    first_update = calls.index(None)
    children = next(c[0] for c in calls[first_update:]
                    if c and not c[2] and c[0].shape[0] == P * G and float(c[1][0]) == float(ts[k1 + 1]))
    # the stale velocity: the policy before the iteration's first update, at the same state
    with torch.no_grad():
        for n, p in t.model.transformer.named_parameters():
            if n in init:
                p.copy_(init[n])
        v_stale = rec.orig(
            x_k, ts[k1].reshape(1), t.embeds.get(t.stream.batch(0, 0)), t.model.img_ids(s.height, s.width)
        )
    t.close()
    mu_cur, std = sde.step_mean_std(x_k, v_cur, float(sig[k1]), float(sig[k1 + 1]), eta=s.eta, rule=s.rule)
    mu_stale, _ = sde.step_mean_std(x_k, v_stale, float(sig[k1]), float(sig[k1 + 1]), eta=s.eta, rule=s.rule)
    ch = children.view(P, G, *children.shape[1:])

    def mean_sq_z(mu):  # E ≈ 1 when the children are N(mu, std²): G·(group mean of the standardised noise)²
        return float((((ch - mu[:, None]) / std).mean(1) ** 2).mean() * G)

    separation = float((((mu_cur - mu_stale) / std) ** 2).mean() * G)
    assert separation > 10, f"the update is too small to tell the policies apart ({separation:.2f})"
    assert mean_sq_z(mu_cur) < 1.5, "children are not distributed by the current policy's velocity"
    assert mean_sq_z(mu_stale) > 5


@pytest.mark.parametrize("method,extra,updates", [
    ("tempflow", ["branch_steps=[0,2,3]", "lora.rank=4", "kl_ref_coef=0.004"], 1),  # per_iteration (auto)
    ("granular", ["branch_steps=[1,3]", "granularities=[1,2,3]"], 2),               # per_step (auto)
])
def test_branching_trains_at_the_minimum_number_of_transformer_calls(
    tiny_model_dir, prompts_file, tmp_path, method, extra, updates
):
    t = _trainer(
        tiny_model_dir, prompts_file, tmp_path, f"method={method}", "group_size=4", "max_steps=2", *extra
    )
    cfg = t.cfg
    steps, grans = br.branch_steps(cfg), br.granularities(cfg)
    assert t.steps_per_iteration == updates
    before = {n: p.detach().clone() for n, p in t.model.transformer.named_parameters() if p.requires_grad}
    m = t.iteration()
    assert t.opt_step == updates
    assert any(
        not torch.equal(before[n], p.detach())
        for n, p in t.model.transformer.named_parameters()
        if n in before
    )
    cost = br.engine_cost(cfg.sampling.num_steps, steps, grans, cfg.group_size, kl_ref=cfg.kl_ref_coef > 0)
    P = cfg.prompts_per_rank
    # counted by the model's call counter, not by the method
    assert m["transformer_samples"] == P * cost.sample_forwards == m["min_transformer_samples"]
    assert (
        m["transformer_forward"] == cost.sequential_calls
    )  # all children and granularities batched per round
    assert m["transformer_forward_with_grad"] == len(steps)  # one forward per k serves sampling and training
    assert m["ratio_mean"] == 1.0 and math.isfinite(m["loss"])
    if method == "tempflow":
        assert m["kl_ref"] >= 0.0
    t.close()


def test_cost_model_at_flux_scale_against_the_references():
    # G2RPO's released recipe: 16 steps, k = 0..7, λ ∈ {1, 2}, G = 12
    ours = br.engine_cost(16, list(range(8)), [1, 2], 12)
    ref = br.g2rpo_reference_cost(16, list(range(8)), [1, 2], 12)
    # sampling 16 + 12·(8 + 92 + 48) = 1792, then 8 batch-1 training forwards; all sequential
    assert ref.sample_forwards == 1792 + 8 and ref.sequential_calls == 1800
    # anchor/training forwards 8 + 12·(92 + 48 − 8 shared first steps)
    assert ours.sample_forwards == 8 + 12 * (92 + 48 - 8) == 1592
    assert ours.sequential_calls == sum(16 - k for k in range(8)) == 100
    # TempFlow's released FLUX recipe: 10 steps, steps 0..8 trained, K = 6, β > 0
    t_ref = br.tempflow_reference_cost(10, list(range(9)), 6)
    t_ours = br.engine_cost(10, list(range(9)), [1], 6, kl_ref=True)
    assert t_ref.sample_forwards == 10 + 6 * 45 + 6 * 18 and t_ours.sample_forwards == 9 + 9 + 6 * 45


def _g2rpo_completion(x, v_fn, sigmas, k, lam):
    """G2RPO's completion written the reference's way: schedule σ[:k+2] ++ σ[k+2::λ], ODE over the
    transitions after the branch point, return x̂0 of the last transition."""
    sched = torch.cat([sigmas[:k + 2], sigmas[k + 2::lam]])
    x0 = None
    for i in range(k + 1, len(sched) - 1):
        v = v_fn(x, sched[i])
        x0 = x - sched[i] * v
        x = x + (sched[i + 1] - sched[i]) * v
    return x0


@pytest.mark.parametrize("k", [0, 1, 4, 6])
def test_completion_schedule_and_shared_first_step_match_g2rpo(k):
    N = 8
    sigmas = (
        torch.linspace(1, 0, N + 1, dtype=torch.float64)
        * 3
        / (1 + 2 * torch.linspace(1, 0, N + 1, dtype=torch.float64))
    )
    ts = sigmas * 1000
    assert br.completion_indices(1, 16, 2) == [2, 3, 5, 7, 9, 11, 13, 15]  # ends at σ15: x̂0 at σ13
    assert br.completion_indices(0, 16, 2)[-1] == 16 and br.completion_indices(3, 8, 2) == [4, 5, 7]
    w = torch.randn(4, 3, dtype=torch.float64)

    def v_fn(x, s):  # an analytic velocity field that depends on the state and the noise level
        return torch.tanh(x @ w[:3]) * (1 + float(s))

    x = torch.randn(5, 2, 3, dtype=torch.float64)
    calls = []

    def batched(xb, tb):
        calls.append(xb.shape[0])
        return torch.cat(
            [v_fn(xb[i : i + 1], tb[i if tb.numel() > 1 else 0] / 1000) for i in range(xb.shape[0])]
        )

    out = br._complete(batched, x, k, sigmas, ts, N, [1, 2, 3])
    for lam in (1, 2, 3):
        assert torch.allclose(out[lam], _g2rpo_completion(x, v_fn, sigmas, k, lam), atol=1e-12), lam
    # the step σ_{k+1} → σ_{k+2} is computed once for all granularities
    n = {g: len(br.completion_indices(k, N, g)) - 1 for g in (1, 2, 3)}
    assert calls[0] == 5 and sum(calls) == 5 * (sum(n.values()) - 2) and len(calls) == max(n.values())


def test_granular_advantages_are_summed_over_granularities_and_rewards_then_clipped():
    G = 4
    hps = {1: torch.tensor([0.0, 0.0, 0.0, 1.0]), 2: torch.tensor([0.0, 0.0, 0.0, 1.0])}
    clip = {1: torch.tensor([0.0, 0.0, 0.0, 3.0]), 2: torch.tensor([0.0, 0.0, 0.0, 2.0])}
    by_lambda = {g: {"hps": hps[g], "clip": clip[g]} for g in (1, 2)}
    adv = br.branch_advantages(by_lambda, {"hps": 1.0, "clip": 1.0}, G, clip=5.0)
    terms = [normalize_group(r, G) for g in (1, 2) for r in (hps[g], clip[g])]
    raw = sum(terms)
    assert float(raw[3]) == pytest.approx(6.0)  # each term 1.5: no term reaches the clip, the sum does
    assert torch.allclose(adv, raw.clamp(-5, 5).float(), atol=1e-6)
    assert float(adv[3]) == pytest.approx(5.0)
    per_term_clip = sum(t.clamp(-5, 5) for t in terms)  # the old behaviour: clip each term
    assert float(per_term_clip[3]) > 5.0


def test_tempflow_normaliser_is_population_std_plus_1e_4():
    r = torch.tensor([0.2, 0.5, 0.9, 0.4, 0.1, 0.3])
    adv = br.branch_advantages({1: {"pick": r}}, {"pick": 1.0}, 6, clip=5.0, std="population", eps=1e-4)
    a = r.numpy().astype(np.float64)
    expect = (a - a.mean()) / (a.std() + 1e-4)  # numpy std = population
    assert np.allclose(adv.numpy(), expect, atol=1e-6)
    const = br.branch_advantages({1: {"pick": torch.full((6,), 0.7)}}, {"pick": 1.0}, 6, clip=5.0,
                                 std="population", eps=1e-4)
    assert torch.equal(const, torch.zeros(6))


def test_tempflow_kl_to_the_reference_model(tiny_model_dir, prompts_file, tmp_path):
    """β·KL with KL = mean((μ_θ − μ_ref)²)/(2 std²) = (−dt)/2·(1/g + g(1−σ)/(2σ))²·mean((v_θ − v_ref)²)
    (TempFlow Eq. 6); zero while the LoRA adapter is at its zero init, positive after it moves; the reference
    forward runs with the adapter disabled."""
    t = _trainer(
        tiny_model_dir, prompts_file, tmp_path, "method=tempflow", "kl_ref_coef=0.004", "max_steps=1"
    )
    ctx = t.context()
    s, model = t.cfg.sampling, t.model
    sig = s.sigmas(model.latent_shape(s.height, s.width)[0])
    ts = s.timesteps(sig)
    k = 2
    x = model.initial_noise(1, s.height, s.width, torch.Generator().manual_seed(0))
    ids = model.img_ids(s.height, s.width)
    cond = ctx.cond
    v = model.velocity(x, ts[k].reshape(1), cond, ids)
    kl0 = br.kl_to_reference(ctx, x, v, ts[k].reshape(1), cond, ids, float(sig[k]), float(sig[k + 1]))
    assert float(kl0.detach()) == 0.0
    with torch.no_grad():
        for n, p in model.transformer.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    v = model.velocity(x, ts[k].reshape(1), cond, ids)
    kl = br.kl_to_reference(ctx, x, v, ts[k].reshape(1), cond, ids, float(sig[k]), float(sig[k + 1]))
    model.transformer.disable_adapters()
    v_ref = model.velocity(x, ts[k].reshape(1), cond, ids)
    model.transformer.enable_adapters()
    sg, sn = float(sig[k]), float(sig[k + 1])
    g = float(sde.diffusion_coeff(torch.tensor(sg), torch.tensor(sn), s.eta, s.rule))
    closed = (
        (sg - sn) / 2 * (1 / g + g * (1 - sg) / (2 * sg)) ** 2 * float(((v.detach() - v_ref) ** 2).mean())
    )
    assert float(kl.detach()) > 0 and float(kl.detach()) == pytest.approx(closed, rel=1e-4)
    kl.backward()  # differentiable in θ (the KL term trains)
    assert any(
        p.grad is not None and p.grad.abs().sum() > 0
        for p in model.transformer.parameters()
        if p.requires_grad
    )
    t.close()


def test_defaults_follow_the_references():
    base = ["model=m", "prompts=p"]
    tf = TrainConfig.load("tiny_cpu", [*base, "method=tempflow", "sampling.num_steps=10"])
    assert (
        br.branch_steps(tf) == list(range(9)) and br.update_mode(tf) == "per_iteration"
    )  # all trainable steps
    assert br.steps_per_iteration(tf) == 1
    gr = TrainConfig.load("tiny_cpu", [*base, "method=granular", "sampling.num_steps=16"])
    assert br.branch_steps(gr) == list(range(8)) and br.update_mode(gr) == "per_step"  # 0..7 at 16 steps
    assert br.steps_per_iteration(gr) == 8
    w = br.noise_weights(tf, list(range(9)), tf.sampling.sigmas())
    assert sum(w.values()) / 9 == pytest.approx(1.0)  # c = 1/mean(std): weights average 1
    assert min(w[0], w[1]) > 2 * max(w[7], w[8])  # high-noise steps weigh more
    fixed = br.noise_weights(tf.replace(noise_weight_c=1.73), [0, 1], tf.sampling.sigmas())
    std0 = float(
        sde.step_std(
            float(tf.sampling.sigmas()[0]),
            float(tf.sampling.sigmas()[1]),
            eta=tf.sampling.eta,
            rule=tf.sampling.rule,
        )
    )
    assert fixed[0] == pytest.approx(1.73 * std0)

import pytest
import torch

from chunkgrpo import sde
from chunkgrpo.errors import UserError
from chunkgrpo.rollout import (
    SamplingConfig,
    parse_stochastic,
    policy_log_probs,
    rollout_group,
    sample_trajectory,
)
from chunkgrpo.schedules import shift_sigmas
from tests.cpu_kernels import tol

# float results compared across formulas and layouts: CI runs these under every ATEN_CPU_CAPABILITY
pytestmark = pytest.mark.exactness

TINY = dict(num_steps=6, height=64, width=64, max_sequence_length=16)


def test_parse_stochastic_variants():
    assert parse_stochastic("all", 5).tolist() == [True, True, True, True, False]
    assert parse_stochastic("none", 5).tolist() == [False] * 5
    assert parse_stochastic("window:1:3", 5).tolist() == [False, True, True, False, False]
    assert parse_stochastic("steps:0,3", 5).tolist() == [True, False, False, True, False]
    with pytest.raises(UserError, match="out of range"):
        parse_stochastic("steps:4", 5)
    with pytest.raises(UserError, match="unknown stochastic"):
        parse_stochastic("half", 5)


def test_sample_trajectory_with_analytic_field_records_states_and_logps():
    sig = shift_sigmas(5)
    x0 = torch.randn(3, 4, 2)
    v_const = torch.ones(3, 4, 2)
    calls = []

    def vf(x, i):
        calls.append(i)
        return v_const

    mask = parse_stochastic("window:1:3", 5)
    tr = sample_trajectory(
        vf, x0, sig, mask, eta=0.5, rule="flow", generator=torch.Generator().manual_seed(0)
    )
    assert calls == [0, 1, 2, 3, 4]  # exactly one velocity call per step
    assert tr.latents.shape == (3, 6, 4, 2)
    assert torch.isnan(tr.log_probs[:, [0, 3, 4]]).all() and torch.isfinite(tr.log_probs[:, 1:3]).all()
    # ODE step 0 is exact Euler; the recorded log-prob of step 1 is the density of the recorded transition
    torch.testing.assert_close(
        tr.latents[:, 1], x0 + (sig[1] - sig[0]).float() * v_const, **tol(torch.float32)
    )
    lp = sde.step_log_prob(
        tr.latents[:, 2], tr.latents[:, 1], v_const, float(sig[1]), float(sig[2]), eta=0.5, rule="flow"
    )
    torch.testing.assert_close(lp, tr.log_probs[:, 1], **tol(torch.float32))
    # decoded image = x̂0 of the last step, equal to the final ODE state
    torch.testing.assert_close(
        tr.x0, tr.latents[:, -2] - sig[-2].float() * v_const, **tol(torch.float32, ulps=10)
    )
    torch.testing.assert_close(tr.x0, tr.latents[:, -1], **tol(torch.float32, ulps=10))


def test_group_rollout_on_tiny_flux_one_batch_shared_noise(tiny_model):
    cfg = SamplingConfig(**TINY)
    cond = tiny_model.encode_prompts(["a cat", "a red car"], 16)
    tiny_model.counter.reset()
    tr = rollout_group(tiny_model, cond, 3, cfg, torch.Generator().manual_seed(0))
    # one transformer call per step for the whole group batch (not G sequential runs); step 0 sees the same
    # input for the 3 samples of a prompt (same noise): evaluated once per prompt
    assert tiny_model.counter.forward == cfg.num_steps
    assert tiny_model.counter.samples == cfg.num_steps * 6 - 2 * (3 - 1)
    assert (tr.group_size, tr.shared_steps) == (3, 1)
    # exact: the group's initial noise is one tensor repeated
    assert torch.equal(tr.latents[0, 0], tr.latents[2, 0]) and not torch.equal(
        tr.latents[0, 0], tr.latents[3, 0]
    )
    assert not torch.equal(tr.latents[0, 1], tr.latents[1, 1])  # SDE noise differs within the group
    assert torch.isfinite(tr.log_probs[:, :-1]).all()
    # training-layout log-probs of the unchanged policy reproduce the rollout's. Another batch layout (6·3
    # vs 6 samples) runs other kernels; the velocity's fp32 rounding is amplified by 1/std² in the log-prob:
    # ~1000 ulp
    lp = policy_log_probs(tiny_model, tr, cond.repeat_interleave(3), [0, 2, 4], cfg)
    torch.testing.assert_close(lp, tr.log_probs[:, [0, 2, 4]], **tol(torch.float32, ulps=1000))
    images = tiny_model.decode(tr.x0, 64, 64)
    assert len(images) == 6 and images[0].size == (64, 64)


def test_independent_noise_option(tiny_model):
    cfg = SamplingConfig(**TINY, same_noise=False)
    cond = tiny_model.encode_prompts(["a cat"], 16)
    tr = rollout_group(tiny_model, cond, 2, cfg, torch.Generator().manual_seed(0))
    assert not torch.equal(tr.latents[0, 0], tr.latents[1, 0])


def test_sampling_config_validation():
    with pytest.raises(UserError, match="num_steps"):
        SamplingConfig(num_steps=1)
    with pytest.raises(UserError, match="window"):
        SamplingConfig(num_steps=4, stochastic="window:2:9")


# fp32 transformer outputs computed at different batch sizes may differ in the last bits (CPU GEMM blocking
# differs between AVX2 and AVX-512 builds and batch shapes); trajectories compound that over the steps.
FP32_LAYOUT_TOL = 1e3 * torch.finfo(torch.float32).eps


def test_shared_prefix_once_per_prompt_matches_the_full_batch(tiny_model):
    """Shared prefix (steps 0..first stochastic step) evaluated once per prompt: the same trajectory as
    evaluating every sample, up to the fp32 batch-layout tolerance."""
    cfg = SamplingConfig(**TINY, stochastic="window:2:4")
    cond = tiny_model.encode_prompts(["a cat", "a red car"], 16)
    tiny_model.counter.reset()
    shared = rollout_group(tiny_model, cond, 3, cfg, torch.Generator().manual_seed(5))
    assert shared.shared_steps == 3  # steps 0, 1 (ODE) and 2 (the first SDE step) have identical inputs
    assert tiny_model.counter.samples == cfg.num_steps * 6 - 3 * 2 * (3 - 1)
    # reference: the same sampling with every row evaluated (no group velocity)
    from chunkgrpo.rollout import device_generator, initial_latents

    gen = torch.Generator().manual_seed(5)
    x_init = initial_latents(tiny_model, 2, 3, cfg, gen)
    sig = cfg.sigmas(x_init.shape[1])
    ts = cfg.timesteps(sig)
    cond_rep, ids = cond.repeat_interleave(3), tiny_model.img_ids(64, 64)
    full = sample_trajectory(
        lambda x, i: tiny_model.velocity(x, ts[i].reshape(1), cond_rep, ids, guidance=cfg.guidance),
        x_init,
        sig,
        cfg.stochastic_mask(),
        eta=cfg.eta,
        rule=cfg.rule,
        generator=device_generator(gen, "cpu"),
        timesteps=ts,
    )
    assert full.shared_steps == 0
    scale = float(full.latents.abs().max())
    assert torch.allclose(shared.latents, full.latents, rtol=0, atol=FP32_LAYOUT_TOL * scale)
    assert torch.equal(shared.latents[0, 2], shared.latents[2, 2])  # x_0, x_1, x_2 identical within the group
    assert not torch.equal(shared.latents[0, 3], shared.latents[1, 3])  # the SDE step 2 → 3 differs


def test_pair_log_probs_evaluate_each_distinct_input_once(tiny_model):
    from chunkgrpo.rollout import pair_log_probs

    cfg = SamplingConfig(**TINY)
    cond = tiny_model.encode_prompts(["a cat", "a red car"], 16)
    tr = rollout_group(tiny_model, cond, 3, cfg, torch.Generator().manual_seed(1))
    cond_rep = cond.repeat_interleave(3)
    samples, steps = [0, 1, 2, 4, 0, 5], [0, 0, 0, 0, 3, 1]  # step 0: samples 0-2 share one input, 4 another
    tiny_model.counter.reset()
    lp = pair_log_probs(tiny_model, tr, cond_rep, samples, steps, cfg)
    assert (tiny_model.counter.forward, tiny_model.counter.samples) == (1, 4)
    assert torch.allclose(lp, tr.log_probs[samples, steps], rtol=0, atol=1e-4)
    unshared = tr.select(slice(None))  # no group structure: every pair its own input
    tiny_model.counter.reset()
    lp_full = pair_log_probs(tiny_model, unshared, cond_rep, samples, steps, cfg)
    assert tiny_model.counter.samples == 6
    assert torch.allclose(lp, lp_full, rtol=0, atol=FP32_LAYOUT_TOL * float(lp.abs().max()))
    assert len(set(lp[:3].tolist())) == 3  # one velocity, but each sample's own transition x_0 → x_1


def test_rollout_noise_generator_stays_on_the_cpu_generator():
    from chunkgrpo.rollout import device_generator

    g = torch.Generator().manual_seed(3)
    assert device_generator(g, "cpu") is g  # CPU results: exactly the iteration generator's numbers


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA device (rollout noise drawn on the GPU)")
def test_rollout_noise_on_the_device_is_reproducible():
    from chunkgrpo.rollout import device_generator

    draws = []
    for _ in range(2):
        g = device_generator(torch.Generator().manual_seed(3), "cuda")
        assert g.device.type == "cuda"
        draws.append(
            sde.sde_step(
                torch.zeros(2, 4, device="cuda"),
                torch.zeros(2, 4, device="cuda"),
                0.8,
                0.6,
                eta=0.7,
                rule="flow",
                generator=g,
            )[0]
        )
    assert torch.equal(draws[0], draws[1])

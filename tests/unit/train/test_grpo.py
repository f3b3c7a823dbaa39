"""The GRPO iteration's policy phase (`chunkgrpo.train.grpo`) on the tiny FLUX: every chunk-backward
strategy, batching budget and the shared step-0 input give the same gradients, on-policy (first window) and
off-policy (second window) with a KL term."""

import dataclasses

import pytest
import torch

from chunkgrpo.train import grpo
from chunkgrpo.train.config import TrainConfig
from chunkgrpo.train.trainer import Trainer

# The configurations differ in batch layout (1 to 8 transformer inputs per call, shared inputs evaluated
# once or per sample). fp32 CPU kernels at different batch shapes can differ in the last bits (GEMM
# blocking differs between AVX2 and AVX-512 builds), and those differences pass through the transformer,
# its backward and the sums over units: allow 2000 fp32 ulps of the gradient's scale (≈2.4e-4 relative).
FP32_LAYOUT_TOL = 2000 * torch.finfo(torch.float32).eps
CLIP = 0.002  # the perturbation below moves chunk ratios by ~1e-3..1e-2: some units clip, some do not


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("data") / "prompts.txt"
    p.write_text("a cat on a chair\na red car\nthree apples\na bowl of fruit\n")
    return p


@pytest.fixture(scope="module")
def trainer(tiny_model_dir, prompts_file, tmp_path_factory):
    cfg = TrainConfig.load(
        "tiny_cpu",
        [
            f"model={tiny_model_dir}",
            f"prompts={prompts_file}",
            f"output_dir={tmp_path_factory.mktemp('run')}",
            "progress=false",
            "group_size=4",
            "prompts_per_rank=2",
            "grad_accum=4",
            "timestep_fraction=0.67",
            "kl_coef=0.1",
            f"clip_low={CLIP}",
            f"clip_high={CLIP}",
            "checkpoint.resume=false",
        ],
    )
    t = Trainer(cfg)
    t.setup()
    yield t
    t.close()


def _window_grads(t, monkeypatch, strategy, budget, share=True, compile="off", step=0.15, **cfg_overrides):
    """One iteration (2 windows of 4 samples) from the same θ and seed; returns each window's gradient."""
    params = [p for p in t.model.transformer.parameters() if p.requires_grad]
    start = [p.detach().clone() for p in params]
    g = torch.Generator().manual_seed(7)
    delta = [step * torch.randn(p.shape, generator=g) for p in params]
    grads = []

    def optimizer_step():
        # capture this window's gradient, then move θ by a FIXED amount (the same in every configuration),
        # so the next window is off-policy under a bitwise-identical θ
        grads.append([p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in params])
        with torch.no_grad():
            for p, d in zip(params, delta):
                p.add_(d)
                p.grad = None
        return {"grad_norm": 0.0}

    if not share:  # train without sharing step 0's input across a prompt's samples (the rollout is unchanged)
        real = grpo.rollout_group

        def unshared(*a, **k):
            traj = real(*a, **k)
            traj.shared_steps = 0
            return traj

        monkeypatch.setattr(grpo, "rollout_group", unshared)
    ratios = []
    real_wb = grpo.policy_window.window_backward

    def recording(*a, **k):
        out = real_wb(*a, **k)
        ratios.extend(float(o["ratio"]) for o in out)
        return out

    monkeypatch.setattr(grpo.policy_window, "window_backward", recording)
    ctx = t.context()
    cfg = dataclasses.replace(t.cfg, chunk_backward=strategy, policy_batch=budget, compile=compile,
                              **cfg_overrides)
    m = grpo.iteration(dataclasses.replace(ctx, cfg=cfg, optimizer_step=optimizer_step)).metrics
    monkeypatch.undo()
    with torch.no_grad():
        for p, s0 in zip(params, start):
            p.copy_(s0)
    assert len(grads) == 2
    # layout noise (~1e-6) must not decide a clip: every ratio is clear of the clip boundaries
    clip = t.cfg.clip_low
    assert min(abs(abs(r - 1) - clip) for r in ratios) > clip / 20, (
        "test data: a chunk ratio sits on a clip boundary"
    )
    return grads, m


@pytest.mark.exactness  # cross-layout tolerance: CI re-runs it under every CPU capability
def test_gradients_equal_across_strategies_budgets_and_sharing(trainer, monkeypatch):
    ref, m_ref = _window_grads(trainer, monkeypatch, "per_step", 1, share=False)
    assert (
        0 < m_ref["clip_frac"] < 0.5 and m_ref["ratio_min"] < 1 - CLIP
    )  # off-policy: clipped and unclipped units
    assert m_ref["kl_k3"] > 0
    cases = [("graph", 1, True), ("graph", 64, True), ("accumulate", 1, True), ("accumulate", 3, True),
             ("auto", 3, True), ("auto", 64, True), ("auto", 3, False), ("per_step", 1, True)]
    for strategy, budget, share in cases:
        got, m = _window_grads(trainer, monkeypatch, strategy, budget, share=share)
        for w in range(2):  # window 0 on-policy, window 1 off-policy (with KL)
            scale = max(float(g.abs().max()) for g in ref[w])
            assert scale > 0
            worst = max(float((a - b).abs().max()) for a, b in zip(got[w], ref[w]))
            assert worst <= FP32_LAYOUT_TOL * scale, (strategy, budget, share, w, worst / scale)
        assert m["clip_frac"] == m_ref["clip_frac"]
        if share:
            # the minimum number of transformer evaluations (every distinct input once per θ) when the budget
            # lets a prompt's units share step 0's input: accumulate keeps it alive from budget 2, graph and
            # auto pack it whole at budget 64; per_step pays its no-grad ratio pass on top
            assert m["transformer_samples"] >= m["min_transformer_samples"]
            if budget == 64 or (strategy == "accumulate" and budget > 1):
                assert m["transformer_samples"] == m["min_transformer_samples"], (strategy, budget)
        if strategy != "per_step":
            assert m["policy_off_samples"] < m_ref["policy_off_samples"]  # no ratio pass
    # per_step off-policy pays one no-grad pass over the window's inputs
    assert m_ref["policy_off_samples"] > m_ref["policy_on_samples"]


@pytest.mark.integration  # torch.compile: minutes of compilation on a small CPU
def test_compiled_transformer_trains_lora_like_eager(trainer, monkeypatch):
    """compile=all: the rollout and the LoRA training forwards/backwards run through torch.compile; the two
    windows' gradients (on- and off-policy, θ updated in between) match eager execution.

    The backend is `aot_eager_decomp_partition`: the graphs dynamo captures, AOTAutograd's joint graph with
    inductor's decompositions and partitioner, run without generated kernels. What this test protects (one
    graph per grad mode, gradients through the captured graphs) is decided there; inductor's code generator
    on CPU writes C++ that the GPUs never run (they get Triton kernels) and costs ~70 CPU-s of compilation on
    a machine without a warm inductor cache."""
    from torch._dynamo.utils import counters

    ref, m_ref = _window_grads(trainer, monkeypatch, "auto", 4)
    trainer.model.counter.reset()
    counters.clear()
    got, m = _window_grads(trainer, monkeypatch, "auto", 4, compile="all",
                           compile_backend="aot_eager_decomp_partition")
    # really compiled, once per grad mode (rollout, training) for every batch (FluxModel.compiled): a batch
    # sliced from a larger tensor compiled the rollout a second time (flux._not_a_view)
    assert trainer.model._compiled is not None and counters["stats"]["unique_graphs"] == 2, counters["stats"]
    for w in range(2):
        scale = max(float(g.abs().max()) for g in ref[w])
        worst = max(float((a - b).abs().max()) for a, b in zip(got[w], ref[w]))
        assert worst <= FP32_LAYOUT_TOL * scale, (w, worst / scale)
    assert m["clip_frac"] == m_ref["clip_frac"] and m["transformer_samples"] == m_ref["transformer_samples"]


@pytest.mark.exactness
def test_full_finetuning_with_gradient_checkpointing(
    tiny_model_dir, prompts_file, tmp_path_factory, monkeypatch
):
    """Full fine-tuning (the side buffer is a parameter copy: `auto` uses per_step beyond the budget, an
    explicit `accumulate` still may) with activation checkpointing recomputing each block in backward."""
    cfg = TrainConfig.load(
        "tiny_cpu",
        [
            f"model={tiny_model_dir}",
            f"prompts={prompts_file}",
            f"output_dir={tmp_path_factory.mktemp('full')}",
            "progress=false",
            "group_size=4",
            "prompts_per_rank=2",
            "grad_accum=4",
            "timestep_fraction=0.67",
            "kl_coef=0.1",
            "clip_low=2e-4",
            "clip_high=2e-4",
            "lora.enabled=false",
            "gradient_checkpointing=true",
            "checkpoint.resume=false",
        ],
    )
    t = Trainer(cfg)
    t.setup()
    assert grpo.policy_layout(cfg, t.plan.sizes, False)["side_buffer"] is False
    ref, m_ref = _window_grads(t, monkeypatch, "per_step", 1, step=0.003)
    assert 0 < m_ref["clip_frac"] < 0.5, m_ref["clip_frac"]  # clipped and unclipped off-policy units
    for strategy, budget in (("accumulate", 1), ("auto", 2)):
        got, _ = _window_grads(t, monkeypatch, strategy, budget, step=0.003)
        for w in range(2):
            scale = max(float(g.abs().max()) for g in ref[w])
            worst = max(float((a - b).abs().max()) for a, b in zip(got[w], ref[w]))
            assert 0 < scale and worst <= FP32_LAYOUT_TOL * scale, (strategy, w, worst / scale)
    t.close()

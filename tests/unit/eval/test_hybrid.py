"""Hybrid inference on the tiny FLUX: which weights run at which step, one transformer for LoRA,
same noise per seed, and the schedule equals the stock diffusers FLUX pipeline."""

import gc
import json

import pytest
import torch

from chunkgrpo.errors import UserError
from chunkgrpo.eval.hybrid import HybridConfig, HybridSampler, load_trained, noise_for_seeds
from tests.cpu_kernels import tol

PROMPTS = ["a photo of a cat", "a red car by the sea", "a bowl of fruit"]
CFG = HybridConfig(num_steps=6, trained_steps=4, height=64, width=64, max_sequence_length=16)


def make_lora_dir(base_dir, out, *, rank=4, alpha=8.0, seed=0):
    """A non-zero LoRA adapter saved like the trainer exports it (no peft metadata in the file)."""
    from diffusers import FluxPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from chunkgrpo.flux import load_flux

    tr = load_flux(base_dir, with_text_encoders=False, with_vae=False).transformer
    tr.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    g = torch.Generator().manual_seed(seed)
    for n, p in tr.named_parameters():
        if "lora_B" in n:
            p.data = torch.randn(p.shape, generator=g) * 0.5
    out.mkdir(parents=True, exist_ok=True)
    FluxPipeline.save_lora_weights(out, transformer_lora_layers=get_peft_model_state_dict(tr))
    (out / "chunkgrpo_model.json").write_text(
        json.dumps(
            {
                "kind": "lora",
                "base_model": str(base_dir),
                "method": "chunk",
                "lora": {"rank": rank, "alpha": alpha},
            }
        )
    )
    return out


def make_full_dir(base_dir, out):
    from chunkgrpo.flux import load_flux

    tr = load_flux(base_dir, with_text_encoders=False, with_vae=False).transformer
    with torch.no_grad():
        for p in tr.parameters():
            p.add_(0.05 * torch.randn_like(p))
    tr.save_pretrained(out / "transformer")
    (out / "chunkgrpo_model.json").write_text(json.dumps({"kind": "full", "base_model": str(base_dir)}))
    return out


@pytest.fixture(scope="module")
def lora_dir(tiny_model_dir, tmp_path_factory):
    return make_lora_dir(tiny_model_dir, tmp_path_factory.mktemp("lora") / "final")


def _n_flux_transformers():
    from diffusers import FluxTransformer2DModel

    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, FluxTransformer2DModel))


def _record_calls(transformer, layer):
    """Forward hook: per call, (adapter enabled per the peft layer itself, input, output)."""
    rec = []

    def hook(module, args, kwargs, output):
        rec.append((not layer.disable_adapters, kwargs["hidden_states"].clone(), output[0].clone()))

    return rec, transformer.register_forward_hook(hook, with_kwargs=True)


@pytest.mark.exactness
def test_lora_hybrid_first_k_trained_last_base(tiny_model_dir, tiny_model, lora_dir):
    before = _n_flux_transformers()
    sampler = HybridSampler.load(tiny_model_dir, str(lora_dir))
    assert _n_flux_transformers() - before == 1, "LoRA hybrid inference must hold exactly one transformer"
    assert len(sampler.transformers()) == 1 and sampler.transformers()[0] is sampler.model.pipe.transformer
    layer = sampler._layers[0]
    assert layer.scaling[sampler.adapter_name] == pytest.approx(2.0)  # alpha/rank restored from the metadata

    probe_log = []
    sampler.probe = lambda step, phase, tr: probe_log.append((step, phase, sampler.adapter_enabled()))
    cond = sampler.model.encode_prompts(PROMPTS[:2], CFG.max_sequence_length)
    x_init = noise_for_seeds(sampler.model, [1, 2], CFG.height, CFG.width)

    rec, handle = _record_calls(sampler.model.transformer, layer)
    try:
        x0_hybrid = sampler.sample_latents(cond, x_init, CFG, "hybrid")
        hybrid_calls = list(rec)
        rec.clear()
        x0_base = sampler.sample_latents(cond, x_init, CFG, "base")
        base_calls = list(rec)
    finally:
        handle.remove()

    K, N = CFG.trained_steps, CFG.num_steps
    assert [c[0] for c in hybrid_calls] == [True] * K + [False] * (N - K)
    assert [c[0] for c in base_calls] == [False] * N
    assert probe_log[:N] == [(i, "trained" if i < K else "base", i < K) for i in range(N)]
    assert sampler.calls == {"trained": K, "base": 2 * N - K}
    # step 0 sees the same input in both runs (the same x_init tensor): the trained weights give a different
    # velocity ...
    assert torch.equal(hybrid_calls[0][1], base_calls[0][1])
    assert not torch.allclose(hybrid_calls[0][2], base_calls[0][2], atol=1e-4)
    assert not torch.allclose(x0_hybrid, x0_base, atol=1e-4)
    # ... and every step >= K is exactly the pristine base model (a separate instance without adapters)
    img_ids = tiny_model.img_ids(CFG.height, CFG.width)
    ts = CFG.timesteps(CFG.sigmas(x_init.shape[1]))
    with torch.no_grad():
        for i, (_, x_in, out) in enumerate(hybrid_calls):
            ref = tiny_model.transformer(hidden_states=x_in, timestep=(ts[i] / 1000).float().expand(2),
                                         guidance=None, pooled_projections=cond.pooled,
                                         encoder_hidden_states=cond.prompt_embeds, txt_ids=cond.text_ids,
                                         img_ids=img_ids, return_dict=False)[0]
            if i < K:
                assert not torch.allclose(ref, out, atol=1e-4), f"step {i} should use the trained weights"
            else:
                # another module instance (PEFT-wrapped, adapter off) on the same batch: fp32 tolerance
                torch.testing.assert_close(ref, out, **tol(torch.float32))


@pytest.mark.exactness
def test_same_seed_same_noise_and_batch_invariance(tiny_model_dir, lora_dir):
    from tests.cpu_kernels import PIXEL_TOL

    sampler = HybridSampler.load(tiny_model_dir, lora_dir)
    seeds = [7, 8, 9]
    a = sampler.generate_modes(PROMPTS, seeds, CFG, ("hybrid", "base"), batch_size=3)
    b = sampler.generate_modes(PROMPTS, seeds, CFG, ("hybrid", "base"), batch_size=1)
    import numpy as np

    def max_diff(x, y):
        return np.abs(np.asarray(x, dtype=int) - np.asarray(y, dtype=int)).max()

    for m in ("hybrid", "base"):
        assert len(a[m]) == 3 and a[m][0].size == (64, 64)
        for x, y in zip(a[m], b[m]):
            # batch 3 vs batch 1 runs other kernels: the float latents agree to rounding, so a pixel may land
            # one uint8 level apart, never more
            assert max_diff(x, y) <= PIXEL_TOL
    assert np.asarray(a["hybrid"][0]).tolist() != np.asarray(a["base"][0]).tolist()
    # trained_steps = 0 is the base model: the same computation in the same layout (batch 1, adapter off at
    # every step) as the batch-1 base image, hence bit-exact; against the batch-3 image within one level
    cfg0 = CFG.replace(trained_steps=0)
    z = sampler.generate(PROMPTS[:1], seeds[:1], cfg0, "hybrid", batch_size=1)
    assert np.array_equal(np.asarray(z[0]), np.asarray(b["base"][0]))
    assert max_diff(z[0], a["base"][0]) <= PIXEL_TOL
    assert sampler.trace == [(i, "base") for i in range(CFG.num_steps)]


@pytest.mark.exactness
def test_base_schedule_matches_diffusers_pipeline(tiny_model_dir):
    """Base-only sampling with schedule=dynamic == FluxPipeline with FLUX.1-dev's scheduler config."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    sampler = HybridSampler.load(tiny_model_dir)
    pipe = sampler.model.pipe
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
        max_image_seq_len=4096)
    x_init = noise_for_seeds(sampler.model, [3], CFG.height, CFG.width)
    cond = sampler.model.encode_prompts(PROMPTS[:1], CFG.max_sequence_length)
    ours = sampler.sample_latents(cond, x_init, CFG, "base")
    ref = pipe(prompt_embeds=cond.prompt_embeds, pooled_prompt_embeds=cond.pooled, latents=x_init.clone(),
               num_inference_steps=CFG.num_steps, guidance_scale=CFG.guidance, height=CFG.height,
               width=CFG.width, output_type="latent").images
    # another implementation of the same Euler steps (diffusers' scheduler): the fp32 rounding of each step
    # accumulates over N steps, so allow ~1000 ulp
    torch.testing.assert_close(ours, ref.float(), **tol(torch.float32, ulps=1000))


def test_full_finetune_two_transformers(tiny_model_dir, tmp_path):
    full = make_full_dir(tiny_model_dir, tmp_path / "full")
    t = load_trained(tmp_path / "full")
    assert t.kind == "full" and t.base_model == str(tiny_model_dir)
    sampler = HybridSampler.load(tiny_model_dir, t, offload=True)  # offload is a no-op on CPU
    base_tr, trained_tr = sampler.transformers()
    assert base_tr is not trained_tr
    used = []
    sampler.probe = lambda step, phase, tr: used.append(tr)
    sampler.generate(PROMPTS[:1], [0], CFG, "hybrid")
    K = CFG.trained_steps
    assert all(u is trained_tr for u in used[:K]) and all(u is base_tr for u in used[K:])
    assert sampler.switches == 2
    assert full.exists()


def test_load_trained_resolution_and_errors(tmp_path, lora_dir):
    out = tmp_path / "run"
    (out / "final").mkdir(parents=True)
    for f in lora_dir.iterdir():
        (out / "final" / f.name).write_bytes(f.read_bytes())
    t = load_trained(out)  # a training output_dir resolves to its final/
    assert t.kind == "lora" and t.path == out / "final" and t.lora_scale == pytest.approx(2.0)
    with pytest.raises(UserError, match="does not exist"):
        load_trained(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="not a trained model folder"):
        load_trained(tmp_path / "empty")
    with pytest.raises(UserError, match="trained_steps"):
        HybridConfig(num_steps=10, trained_steps=11)

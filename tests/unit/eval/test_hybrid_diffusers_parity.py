"""The evaluation image of a seed is the image stock diffusers gives for that seed: `FluxPipeline` with the
exported LoRA loaded by `load_lora_weights` and `generator=torch.Generator().manual_seed(seed)` (trained
weights at every step), the same pipeline with the LoRA switched off from step K on through
`callback_on_step_end` (hybrid inference), and with the LoRA off (base). docs/diffusers.md is the recipe."""

import numpy as np
import pytest
import torch

from chunkgrpo.eval.hybrid import HybridConfig, HybridSampler, noise_for_seeds
from tests.cpu_kernels import PIXEL_TOL, tol

PROMPT = "a red car by the sea"
SEED = 42
CFG = HybridConfig(num_steps=6, trained_steps=4, height=64, width=64, max_sequence_length=16)
RANK, ALPHA = 4, 8.0  # scale alpha/rank = 2: the file's adapter metadata has to reach diffusers


def export_lora(base_dir, out, seed=0):
    """A non-zero LoRA adapter written the way `Trainer.export` writes it: `FluxPipeline.save_lora_weights`
    with the adapter metadata (rank, alpha, targets), plus chunkgrpo_model.json."""
    import json

    from diffusers import FluxPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from chunkgrpo.flux import load_flux

    targets = ["to_q", "to_k", "to_v", "to_out.0"]
    tr = load_flux(base_dir, with_text_encoders=False, with_vae=False).transformer
    tr.add_adapter(LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets))
    g = torch.Generator().manual_seed(seed)
    for n, p in tr.named_parameters():
        if "lora_B" in n:
            p.data = torch.randn(p.shape, generator=g) * 0.5
    out.mkdir(parents=True, exist_ok=True)
    FluxPipeline.save_lora_weights(
        out, transformer_lora_layers=get_peft_model_state_dict(tr),
        transformer_lora_adapter_metadata={"r": RANK, "lora_alpha": ALPHA, "target_modules": targets,
                                           "lora_dropout": 0.0})
    meta = {"kind": "lora", "base_model": str(base_dir), "lora": {"rank": RANK, "alpha": ALPHA}}
    (out / "chunkgrpo_model.json").write_text(json.dumps(meta))
    return out


@pytest.fixture(scope="module")
def lora_dir(tiny_model_dir, tmp_path_factory):
    return export_lora(tiny_model_dir, tmp_path_factory.mktemp("export") / "final")


@pytest.fixture(scope="module")
def stock_pipe(tiny_model_dir, lora_dir):
    """Plain diffusers: the pipeline folder, FLUX.1-dev's scheduler settings (the tiny folder ships a static
    shift), the exported LoRA loaded as any diffusers LoRA."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    pipe = FluxPipeline.from_pretrained(tiny_model_dir, dtype=torch.float32)
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
        max_image_seq_len=4096)
    pipe.load_lora_weights(lora_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _stock(pipe, steps_with_lora: int, output_type: str = "pil"):
    """The stock pipeline's image for SEED with the LoRA on for the first `steps_with_lora` steps."""

    def lora_off_from_step_k(p, i, t, kwargs):
        if i == steps_with_lora - 1:  # called after step i: steps K..N-1 run without the LoRA
            p.disable_lora()
        return kwargs

    if steps_with_lora == 0:
        pipe.disable_lora()
    try:
        return pipe(PROMPT, generator=torch.Generator().manual_seed(SEED), num_inference_steps=CFG.num_steps,
                    guidance_scale=CFG.guidance, height=CFG.height, width=CFG.width,
                    max_sequence_length=CFG.max_sequence_length, callback_on_step_end=lora_off_from_step_k,
                    output_type=output_type).images[0]
    finally:
        pipe.enable_lora()


def _max_diff(a, b) -> int:
    return int(np.abs(np.asarray(a, dtype=int) - np.asarray(b, dtype=int)).max())


@pytest.mark.exactness
def test_the_evaluation_noise_is_the_pipelines_noise(tiny_model_dir, stock_pipe):
    """Bit-exact: the same seed gives the same initial noise as FluxPipeline.prepare_latents."""
    sampler = HybridSampler.load(tiny_model_dir)
    ours = noise_for_seeds(sampler.model, [SEED, 7], CFG.height, CFG.width)
    C = stock_pipe.transformer.config.in_channels // 4
    for row, seed in enumerate((SEED, 7)):
        ref, _ = stock_pipe.prepare_latents(1, C, CFG.height, CFG.width, torch.float32, torch.device("cpu"),
                                            torch.Generator().manual_seed(seed))
        assert torch.equal(ours[row:row + 1], ref)
    # training's rollout stream is another draw (drawn packed): evaluation does not take it
    packed = sampler.model.initial_noise(1, CFG.height, CFG.width, torch.Generator().manual_seed(SEED))
    assert packed.shape == ours[:1].shape and not torch.equal(packed, ours[:1])


@pytest.mark.exactness
@pytest.mark.parametrize("mode", ["trained", "hybrid", "base"])
def test_evaluation_image_equals_stock_diffusers_with_the_exported_lora(tiny_model_dir, lora_dir, stock_pipe,
                                                                          mode):
    sampler = HybridSampler.load(tiny_model_dir, str(lora_dir))
    K = {"trained": CFG.num_steps, "hybrid": CFG.trained_steps, "base": 0}[mode]
    ours = sampler.generate([PROMPT], [SEED], CFG, mode)[0]
    ref = _stock(stock_pipe, K)
    assert ours.size == ref.size == (CFG.width, CFG.height)
    # two implementations of the same Euler steps (fp32 rounding differs), decoded to uint8
    assert _max_diff(ours, ref) <= PIXEL_TOL, mode
    # the latents agree to fp32 rounding accumulated over N steps
    cond = sampler.model.encode_prompts([PROMPT], CFG.max_sequence_length)
    x_init = noise_for_seeds(sampler.model, [SEED], CFG.height, CFG.width)
    x0 = sampler.sample_latents(cond, x_init, CFG, mode)
    lat = _stock(stock_pipe, K, output_type="latent")
    torch.testing.assert_close(x0[0], lat.float(), **tol(torch.float32, ulps=1000))


@pytest.mark.exactness
def test_the_modes_differ_so_the_comparison_has_teeth(stock_pipe):
    """Trained, hybrid and base are three different images: matching each one is a real constraint."""
    trained, hybrid, base = (_stock(stock_pipe, k) for k in (CFG.num_steps, CFG.trained_steps, 0))
    assert _max_diff(trained, base) > 8 and _max_diff(hybrid, base) > PIXEL_TOL
    assert _max_diff(trained, hybrid) > PIXEL_TOL


@pytest.mark.exactness
def test_hybrid_by_adapter_weight_equals_hybrid_by_disable_lora(stock_pipe):
    """docs/diffusers.md's variant for several adapters: the adapter's weight set to 0 from step K on."""
    name = stock_pipe.get_active_adapters()[0]
    K = CFG.trained_steps

    def weight_zero_from_step_k(p, i, t, kwargs):
        if i == K - 1:
            p.set_adapters([name], adapter_weights=[0.0])
        return kwargs

    try:
        image = stock_pipe(PROMPT, generator=torch.Generator().manual_seed(SEED),
                           num_inference_steps=CFG.num_steps, guidance_scale=CFG.guidance, height=CFG.height,
                           width=CFG.width, max_sequence_length=CFG.max_sequence_length,
                           callback_on_step_end=weight_zero_from_step_k).images[0]
    finally:
        stock_pipe.set_adapters([name], adapter_weights=[1.0])
    assert _max_diff(image, _stock(stock_pipe, K)) <= PIXEL_TOL
    assert _max_diff(image, _stock(stock_pipe, CFG.num_steps)) > PIXEL_TOL

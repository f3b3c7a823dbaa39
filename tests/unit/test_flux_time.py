"""The value FLUX's time and guidance embeddings receive: exact fp32 `int(σ·1000)/1000` (and guidance),
under bf16 autocast and with bf16 base weights (the LoRA path). The distributed (DDP / FSDP bf16) case is
tests/integration/test_timestep_dist.py."""

import pytest
import torch

from chunkgrpo.flux import load_flux


@pytest.fixture(scope="module")
def guidance_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny FLUX with a guidance embedding (as FLUX.1-dev has)."""
    import shutil

    from diffusers import FluxTransformer2DModel

    out = tmp_path_factory.mktemp("m") / "tiny-guidance"
    shutil.copytree(tiny_model_dir, out)
    tr = FluxTransformer2DModel.from_pretrained(out / "transformer")
    torch.manual_seed(0)
    FluxTransformer2DModel.from_config({**tr.config, "guidance_embeds": True}).save_pretrained(
        out / "transformer"
    )
    return out


def _seen(model, t: float, guidance: float, autocast: bool):
    seen = []
    h = model.transformer.time_text_embed.time_proj.register_forward_pre_hook(
        lambda m, a: seen.append(a[0].clone())
    )
    cond = model.encode_prompts(["a cat"], 16)
    x = torch.randn(1, *model.latent_shape(64, 64), generator=torch.Generator().manual_seed(0))
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.no_grad()
    with torch.no_grad(), ctx:
        model.velocity(
            x, torch.tensor([t], dtype=torch.float64), cond, model.img_ids(64, 64), guidance=guidance
        )
    h.remove()
    return seen


@pytest.mark.parametrize("dtype,autocast", [(torch.bfloat16, True), (torch.bfloat16, False),
                                            (torch.float32, True)])
def test_time_and_guidance_embeddings_see_exact_fp32_values(guidance_model_dir, dtype, autocast):
    model = load_flux(guidance_model_dir, dtype=dtype)
    for t in (979.0, 906.0, 771.0, 1000.0, 166.0):
        seen = _seen(model, t, 3.7, autocast)
        expect = (torch.tensor(t, dtype=torch.float64) / 1000).float() * 1000
        assert seen[0].dtype == torch.float32 and torch.equal(seen[0], expect.expand(1)), (t, seen[0])
        assert seen[1].dtype == torch.float32 and torch.equal(seen[1], (torch.tensor(3.7) * 1000).expand(1))


def test_without_the_fix_diffusers_would_round_to_bf16(tiny_model_dir):
    """What the embedding gets when the transformer is called directly under bf16 autocast: 979 → 980."""
    model = load_flux(tiny_model_dir)
    seen = []
    model.transformer.time_text_embed.time_proj.register_forward_pre_hook(
        lambda m, a: seen.append(a[0].clone())
    )
    cond = model.encode_prompts(["a cat"], 16)
    x = torch.randn(1, *model.latent_shape(64, 64))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model.transformer(hidden_states=x, timestep=torch.tensor([0.979]), guidance=None,
                          pooled_projections=cond.pooled, encoder_hidden_states=cond.prompt_embeds,
                          txt_ids=cond.text_ids, img_ids=model.img_ids(64, 64), return_dict=False)
        model.velocity(x, torch.tensor([979.0]), cond, model.img_ids(64, 64))
    assert seen[0].dtype == torch.bfloat16 and float(seen[0]) == 980.0
    assert seen[1].dtype == torch.float32 and float(seen[1]) == 979.0


def test_trainer_lora_bf16_path_single_process(tiny_model_dir, tmp_path):
    from tests.timestep_probe import probe

    (tmp_path / "p.txt").write_text("a cat\n")
    out = probe([f"model={tiny_model_dir}", f"prompts={tmp_path / 'p.txt'}", f"output_dir={tmp_path / 'o'}",
                 "mixed_precision=bf16", "progress=false", "checkpoint.resume=false"])
    assert out["bf16"] and out["base_dtype"] == "torch.bfloat16"
    assert all(r["exact"] and r["dtype"] == "torch.float32" for r in out["rows"]), out["rows"]

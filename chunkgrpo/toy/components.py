"""The toy model's FLUX parts: the closed-form VAE, word tokenizers built from the world's vocabulary, the
small CLIP/T5 encoders and transformer (`build_components`), and the pixel/latent conversions.

See `chunkgrpo.toy.model` for what the VAE's closed form does.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from chunkgrpo.toy.config import ToyModelConfig

_K, _B = 1000.0, 20.0  # GroupNorm trick: constant channel magnitude, SiLU offset


def build_vae(mean: list[float], std: list[float]):
    """An `AutoencoderKL` whose encoder is z = (x − mean) / std per channel and whose decoder is its
    inverse, in closed form (see the module docstring)."""
    import torch
    from diffusers import AutoencoderKL

    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        latent_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(12, 12),
        layers_per_block=1,
        norm_num_groups=3,
        sample_size=32,
        scaling_factor=1.0,
        shift_factor=0.0,
        force_upcast=False,
        use_quant_conv=False,
        use_post_quant_conv=False,
        mid_block_add_attention=False,
    )
    m = torch.tensor(mean, dtype=torch.float32)
    s = torch.tensor(std, dtype=torch.float32)
    with torch.no_grad():
        for p in vae.parameters():
            p.zero_()
        for name, mod in vae.named_modules():  # zero residual branches: every ResNet block is the identity
            if name.endswith("conv2"):
                mod.weight.zero_()
                mod.bias.zero_()
            if isinstance(mod, torch.nn.GroupNorm):  # unused norms stay well-defined
                mod.weight.fill_(1.0)

        def lift(conv, scale, offset):
            """in channel c → (scale_c·x_c + offset_c, −(…), K, −K) in group c."""
            for c in range(3):
                conv.weight[4 * c, c, 1, 1] = scale[c]
                conv.weight[4 * c + 1, c, 1, 1] = -scale[c]
                conv.bias[4 * c] = offset[c]
                conv.bias[4 * c + 1] = -offset[c]
                conv.bias[4 * c + 2] = _K
                conv.bias[4 * c + 3] = -_K

        def linear_norm_out(norm, conv_out, n_out, scale, offset):
            sigma = _K / math.sqrt(2.0)
            norm.weight.zero_()
            norm.bias.zero_()
            for c in range(3):
                norm.weight[4 * c] = sigma
                norm.bias[4 * c] = _B
            for c in range(n_out):
                src = c % 3
                conv_out.weight[c, 4 * src, 1, 1] = scale[src] if c < 3 else 0.0
                conv_out.bias[c] = (
                    (offset[src] - _B * scale[src]) if c < 3 else -30.0
                )  # logvar: deterministic

        enc, dec = vae.encoder, vae.decoder
        # the one resolution change: encoder 2×2 mean (stride-2 conv on the right/bottom-padded input),
        # decoder nearest ×2 (its conv the identity) — exact on the world's 2×2-pixel cells
        down, up = enc.down_blocks[0].downsamplers[0].conv, dec.up_blocks[0].upsamplers[0].conv
        for ch in range(12):
            down.weight[ch, ch, :2, :2] = 0.25
            up.weight[ch, ch, 1, 1] = 1.0
        # encoder: pixels x → (x − m)/s
        lift(enc.conv_in, torch.ones(3), torch.zeros(3))
        linear_norm_out(enc.conv_norm_out, enc.conv_out, 6, 1.0 / s, -m / s)
        # decoder: z → z·s + m
        lift(dec.conv_in, torch.ones(3), torch.zeros(3))
        linear_norm_out(dec.conv_norm_out, dec.conv_out, 3, s, m)
    return vae


def word_t5_tokenizer(corpus: list[str]):
    """A T5 (Unigram) tokenizer whose pieces are the corpus' whole words (+ characters as a fallback),
    so every toy caption is one token per word."""
    from transformers import T5TokenizerFast

    words = sorted({w for line in corpus for w in line.lower().split()})
    chars = sorted({c for w in words for c in w})
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    vocab += [("\u2581" + w, -1.0) for w in words]
    vocab += [(c, -10.0) for c in chars] + [("\u2581" + c, -10.0) for c in chars if c not in words]
    return T5TokenizerFast(vocab=vocab, extra_ids=0, model_max_length=512)


def build_components(cfg: ToyModelConfig, tmp: Path):
    """(pipeline with random transformer, tokenizers trained on the world's vocabulary)."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from chunkgrpo.testing.tiny import build_clip_tokenizer
    from chunkgrpo.toy.world import corpus

    torch.manual_seed(cfg.seed)
    text = corpus()
    tokenizer = build_clip_tokenizer(tmp / "clip-tok", corpus=text, max_merges=400)
    tokenizer.model_max_length = (
        16  # FluxPipeline pads CLIP input to this (the longest caption: 11 words + 2)
    )
    tokenizer_2 = word_t5_tokenizer(text)
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=cfg.clip_dim,
            intermediate_size=2 * cfg.clip_dim,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=16,
            projection_dim=cfg.clip_dim,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    text_encoder_2 = T5EncoderModel(
        T5Config(
            vocab_size=len(tokenizer_2),
            d_model=cfg.text_dim,
            d_kv=16,
            d_ff=2 * cfg.text_dim,
            num_layers=2,
            num_heads=4,
            dropout_rate=0.0,
            pad_token_id=0,
            eos_token_id=1,
            decoder_start_token_id=0,
        )
    )
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=12, num_layers=cfg.layers, num_single_layers=cfg.single_layers,
        attention_head_dim=cfg.head_dim, num_attention_heads=cfg.heads, joint_attention_dim=cfg.text_dim,
        pooled_projection_dim=cfg.clip_dim, guidance_embeds=False, axes_dims_rope=cfg.rope_axes)
    vae = build_vae([0.0, 0.0, 0.0], [1.0, 1.0, 1.0])  # statistics set once the scenes are rendered
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=cfg.shift),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def pixels(images: np.ndarray):
    """(n, H, W, 3) uint8 → (n, 3, H, W) float in [-1, 1] (the pipeline's image normalisation)."""
    import torch

    return torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1.0


def encode_images(pipe, images: np.ndarray):
    """Rendered scenes → packed latents (n, L, 12) through the VAE."""
    import torch

    with torch.no_grad():
        x = pixels(images)
        lat = pipe.vae.encode(x).latent_dist.mode()
        lat = (lat - pipe.vae.config.shift_factor) * pipe.vae.config.scaling_factor
        n, c, h, w = lat.shape
        return pipe._pack_latents(lat, n, c, h, w)

"""The toy base model: a small FLUX (real diffusers/transformers classes) pretrained on toy scenes.

    folder = build_toy_model("models/toy", ToyModelConfig())      # `chunkgrpo toy-model --out DIR`

The folder is a diffusers `FluxPipeline` folder that `chunkgrpo.flux.load_flux` loads unchanged:

* **VAE** — `AutoencoderKL` with two blocks (latent 16×16×3 for a 32×32 image, 64 transformer tokens),
  weights set in closed form so that encode(x) = (mean over each 2×2 cell − m) / s per RGB channel and
  decode is its inverse followed by nearest ×2 up-sampling: exact on the world's 2×2-pixel cells
  (cell-space flow matching through the real class). Residual branches are zeroed (the ResNet blocks are
  identities) and the final GroupNorm+SiLU is made linear: each group holds (x, −x, K, −K), so its mean
  is 0 and its std ≈ K/√2 independent of x (relative error x²/2K² < 1e-6 for K = 1000), and a bias of +20
  puts the SiLU in its linear regime (error < 1e-7). Round trip error < 1/255 (tested).
* **Text encoders** — small CLIP and T5 trained jointly with the transformer during pretraining
  (`train_text`; frozen afterwards, like any FLUX's), tokenizers built locally from the world's
  vocabulary (one token per word).
* **Transformer** — `FluxTransformer2DModel` (default ~0.5 M parameters), pretrained by rectified
  flow matching (x_σ = (1−σ)x₀ + σε, target v = ε − x₀, σ = shift₃(u), u ~ U(0,1)) on category-balanced
  training scenes for a fixed number of optimizer steps, with an EMA of the weights saved.

Deliberately small and short: 3000 steps of 32 scenes with 2 threads (about 4.5 minutes on 2 quiet cores)
give a model that draws recognisable single objects (held-out accuracy ≈ 0.6) and is weak at counting,
positions and colour attribution (≈ 0.0–0.2), which leaves room for RL.

Caching: the content hash covers the config and the source of `world.py` and this module;
`build_toy_model` returns at once when `out` already holds that hash, copies from
`<cache>/toy-models/<hash>` when another call built it, and refuses to overwrite a non-empty folder that
is not a toy model.

Size note: one room (~690 lines) on purpose: the content hash (`model_key`) covers the source of this
module, so everything that determines the model's weights - the closed-form VAE, the components, the
pretraining loop, the folder it writes - lives here and a code change anywhere in it rebuilds the model;
the evaluation helpers (`generate`, `accuracy`, `heldout_error`, `samples_grid`) are small and exist for
the statistics the build records (the ablation reuses `accuracy`).
"""

from __future__ import annotations

import ast
import copy
import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from chunkgrpo.config import Config, option
from chunkgrpo.errors import UserError

log = logging.getLogger(__name__)

META_FILE = "toy_model.json"
FORMAT = "chunkgrpo.toy-model/v1"
_K, _B = 1000.0, 20.0  # GroupNorm trick: constant channel magnitude, SiLU offset
RL_PER_CATEGORY = 24  # prompts per GenEval category in toy/train_prompts.txt


@dataclass
class ToyModelConfig(Config):
    """The toy base model: architecture, pretraining and the sampling used to measure it."""

    seed: int = option(0, "world seed (split, scenes) and weight-initialisation seed")
    size: int = option(32, "image size in pixels (square)")
    layers: int = option(2, "FLUX double-stream blocks")
    single_layers: int = option(2, "FLUX single-stream blocks")
    heads: int = option(4, "attention heads")
    head_dim: int = option(16, "attention head dimension (model width = heads × head_dim)")
    text_dim: int = option(64, "T5 width = the transformer's joint attention dimension")
    clip_dim: int = option(32, "CLIP width = pooled projection dimension")
    max_sequence_length: int = option(12, "T5 tokens per caption (the longest toy caption has 11 incl. </s>)")
    steps: int = option(3000, "pretraining optimizer steps")
    batch_size: int = option(32, "scenes per optimizer step")
    lr: float = option(2e-3, "AdamW peak learning rate (linear warm-up, cosine decay to 10 %)")
    warmup: int = option(50, "warm-up steps")
    ema: float = option(0.995, "EMA decay of the saved weights (0 = save the raw weights)")
    shift: float = option(3.0, "σ shift of the training-time noise levels (as the sampling schedule)")
    train_text: bool = option(
        True, "train the text encoders jointly (then frozen like any FLUX's); false = random features"
    )
    pool: int = option(16384, "distinct training scenes rendered (reused across epochs)")
    threads: int = option(
        2, "torch threads while pretraining (0 = torch's default; 1 is robust on a busy machine)"
    )
    sample_steps: int = option(10, "ODE steps used for the samples grid and the base accuracy")
    eval_per_category: int = option(
        16,
        "held-out prompts per category written to toy/heldout_metadata.jsonl (the "
        "demo's evaluation set) and used for the recorded base accuracy (0 = skip)",
    )
    eval_samples: int = option(4, "images per held-out prompt for the recorded base accuracy")

    def __post_init__(self) -> None:
        if self.size % 4 or self.size < 24:
            raise UserError(
                f"size={self.size} must be a multiple of 4 >= 24 (2×2-pixel cells, 2×2 latent patches)"
            )
        for name in (
            "layers",
            "heads",
            "head_dim",
            "text_dim",
            "clip_dim",
            "batch_size",
            "pool",
            "sample_steps",
        ):
            if getattr(self, name) < 1:
                raise UserError(f"{name}={getattr(self, name)} must be >= 1")
        if self.head_dim % 8:
            raise UserError(f"head_dim={self.head_dim} must be a multiple of 8 (rotary axes split it)")
        for name in ("single_layers", "steps", "warmup", "threads", "eval_per_category", "eval_samples"):
            if getattr(self, name) < 0:
                raise UserError(f"{name}={getattr(self, name)} must be >= 0")
        if not 0 <= self.ema < 1:
            raise UserError(f"ema={self.ema} must be in [0, 1)")
        if self.lr <= 0:
            raise UserError(f"lr={self.lr} must be > 0")

    @property
    def rope_axes(self) -> list[int]:
        a = self.head_dim // 4
        b = (self.head_dim - a) // 2
        return [a, b, self.head_dim - a - b]


def code_fingerprint(path: Path) -> str:
    """The code of a module as the model build sees it: its syntax tree without docstrings, line numbers or
    comments (`ast.dump`), so moving imports' layout, rewrapping comments or reformatting a statement keeps
    the key, while any change to what runs (a constant, an expression, an imported name) changes it."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree, include_attributes=False)


def model_key(cfg: ToyModelConfig) -> str:
    """Content hash: the config and the code that determines the model (the world and this module, by
    `code_fingerprint`: docstrings, comments and layout do not count)."""
    h = hashlib.sha256(json.dumps(cfg.to_dict(), sort_keys=True).encode())
    for f in (Path(__file__).parent / "world.py", Path(__file__)):
        h.update(f.name.encode())
        h.update(code_fingerprint(f).encode())
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------------------------------
# components


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


# --------------------------------------------------------------------------------------------------
# pretraining


def pretrain(pipe, cfg: ToyModelConfig, *, progress: bool = True) -> dict:
    """Flow-matching pretraining of `pipe.transformer` on the world's training scenes (in place)."""
    import torch

    from chunkgrpo.progress import progress_bar
    from chunkgrpo.toy.world import World

    t_start, c_start = time.perf_counter(), time.process_time()
    threads_before = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        world = World(cfg.seed, cfg.size)
        n = min(cfg.pool, max(cfg.steps * cfg.batch_size, cfg.batch_size))
        scenes = world.sample(n, "train", seed=cfg.seed)
        images = np.stack([s.render() for s in scenes])
        x = pixels(images)
        mean = x.mean(dim=(0, 2, 3)).tolist()
        std = x.std(dim=(0, 2, 3)).clamp_min(1e-3).tolist()
        pipe.vae = build_vae(mean, std)
        pipe.register_modules(vae=pipe.vae)
        latents = torch.cat([encode_images(pipe, images[i:i + 1024]) for i in range(0, n, 1024)])
        captions = sorted({s.prompt for s in scenes})
        cap_index = {c: i for i, c in enumerate(captions)}
        cap_of = torch.tensor([cap_index[s.prompt] for s in scenes])
        # token ids exactly as FluxPipeline.encode_prompt makes them (T5: max_sequence_length, CLIP: 77)
        t5_ids = pipe.tokenizer_2(captions, padding="max_length", max_length=cfg.max_sequence_length,
                                  truncation=True, return_tensors="pt").input_ids
        clip_ids = pipe.tokenizer(captions, padding="max_length", max_length=pipe.tokenizer_max_length,
                                  truncation=True, return_tensors="pt").input_ids
        t5, clip = pipe.text_encoder_2, pipe.text_encoder

        def encode(c):
            """(T5 sequence, CLIP pooled) of captions `c`, with grad when the encoders train."""
            return t5(t5_ids[c], output_hidden_states=False)[0], clip(
                clip_ids[c], output_hidden_states=False
            ).pooler_output

        T = t5_ids.shape[1]
        txt_ids = torch.zeros(T, 3)
        h = w = cfg.size // pipe.vae_scale_factor // 2  # packed token grid
        img_ids = pipe._prepare_latent_image_ids(1, h, w, "cpu", torch.float32)
        if img_ids.shape[0] != latents.shape[1]:
            raise RuntimeError(f"{img_ids.shape[0]} image ids for {latents.shape[1]} latent tokens")
        t_data = time.perf_counter() - t_start

        tr = pipe.transformer
        modules = [tr, t5, clip] if cfg.train_text else [tr]
        for mod in (tr, t5, clip):
            mod.train(mod in modules).requires_grad_(mod in modules)
        params = [p for mod in modules for p in mod.parameters()]
        opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)

        def lr_at(step):  # linear warm-up, cosine decay to 10 %
            if step < cfg.warmup:
                return (step + 1) / cfg.warmup
            p = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
        ema = [copy.deepcopy(mod).requires_grad_(False) for mod in modules] if cfg.ema > 0 else None
        gen = torch.Generator().manual_seed(cfg.seed + 1)
        losses = []
        bar = progress_bar(range(cfg.steps), desc="pretrain toy model", disable=not progress)
        for step in bar:
            idx = torch.randint(0, n, (cfg.batch_size,), generator=gen)
            x0 = latents[idx]
            u = torch.rand(cfg.batch_size, generator=gen)
            sigma = cfg.shift * u / (1 + (cfg.shift - 1) * u)  # the shift schedule's σ(u)
            eps = torch.randn(x0.shape, generator=gen)
            s = sigma[:, None, None]
            xt = (1 - s) * x0 + s * eps  # rectified flow interpolation
            target = eps - x0  # v = dx/dσ
            c = cap_of[idx]
            with torch.set_grad_enabled(cfg.train_text):
                embeds, pooled = encode(c)
            v = tr(hidden_states=xt, timestep=sigma, pooled_projections=pooled, encoder_hidden_states=embeds,
                   txt_ids=txt_ids, img_ids=img_ids, return_dict=False)[0]
            loss = torch.nn.functional.mse_loss(v, target)
            if not torch.isfinite(loss):
                raise RuntimeError(f"non-finite pretraining loss at step {step}")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            if ema is not None:
                with torch.no_grad():
                    d = min(cfg.ema, (1 + step) / (10 + step))
                    for e, mod in zip(ema, modules):
                        for pe, p in zip(e.parameters(), mod.parameters()):
                            pe.lerp_(p, 1 - d)
            losses.append(float(loss.detach()))
            if step % 20 == 0:
                bar.set_postfix(loss=f"{np.mean(losses[-50:]):.4f}")
        if ema is not None:
            for e, mod in zip(ema, modules):
                mod.load_state_dict(e.state_dict())
        for mod in (tr, t5, clip):
            mod.eval().requires_grad_(False)
        return {
            "steps": cfg.steps,
            "scenes": n,
            "captions": len(captions),
            "threads": torch.get_num_threads(),
            "data_s": round(t_data, 2),
            "wall_s": round(time.perf_counter() - t_start, 2),
            "cpu_s": round(time.process_time() - c_start, 2),
            "loss_first": float(np.mean(losses[:20])) if losses else None,
            "loss_last": float(np.mean(losses[-50:])) if losses else None,
            "latent_mean": mean,
            "latent_std": std,
            "loadavg": list(os.getloadavg()),
        }
    finally:
        torch.set_num_threads(threads_before)


# --------------------------------------------------------------------------------------------------
# sampling and accuracy


def sampling_config(cfg: ToyModelConfig | None = None, steps: int | None = None, size: int = 32):
    """The ODE sampling the toy model is measured with (shift schedule, like the training presets)."""
    from chunkgrpo.rollout import SamplingConfig

    c = cfg or ToyModelConfig()
    return SamplingConfig(
        num_steps=steps or c.sample_steps,
        schedule="shift",
        shift=c.shift,
        stochastic="none",
        eta=0.0,
        height=c.size if cfg else size,
        width=c.size if cfg else size,
        max_sequence_length=c.max_sequence_length,
    )


def generate(model, prompts: list[str], seeds: list[int], sampling, batch_size: int = 64) -> list:
    """One image per (prompt, seed) with the ODE sampler of the engine (`rollout.sample_trajectory`)."""
    import torch

    from chunkgrpo.rollout import sample_trajectory

    out = []
    L, _ = model.latent_shape(sampling.height, sampling.width)
    sigmas = sampling.sigmas(image_seq_len=L)
    ts = sampling.timesteps(sigmas)
    img_ids = model.img_ids(sampling.height, sampling.width)
    for i in range(0, len(prompts), batch_size):
        ps, ss = prompts[i:i + batch_size], seeds[i:i + batch_size]
        cond = model.encode_prompts(ps, sampling.max_sequence_length)
        x = torch.cat(
            [
                model.initial_noise(1, sampling.height, sampling.width, torch.Generator().manual_seed(s))
                for s in ss
            ]
        )
        traj = sample_trajectory(
            lambda z, j: model.velocity(z, ts[j].reshape(1), cond, img_ids, guidance=sampling.guidance),
            x,
            sigmas,
            torch.zeros(sampling.num_steps, dtype=torch.bool),
            eta=0.0,
            rule="flow",
            timesteps=ts,
        )
        out += model.decode(traj.x0, sampling.height, sampling.width)
    return out


def accuracy(model, metadata: list[dict], samples: int, sampling, seed: int = 42) -> dict:
    """GenEval summary (per category + overall) of `samples` images per prompt with the exact detector."""
    from chunkgrpo.eval.geneval import summarize
    from chunkgrpo.toy.detector import ToyColorClassifier, ToyDetector, partial_credit, score

    det, cf = ToyDetector(), ToyColorClassifier()
    prompts = [md["prompt"] for md in metadata for _ in range(samples)]
    seeds = [seed + k for _ in metadata for k in range(samples)]
    images = generate(model, prompts, seeds, sampling)
    mds = [md for md in metadata for _ in range(samples)]
    records = [score(im, md, det, cf) for im, md in zip(images, mds)]
    out = summarize(records, det)
    # the reward's dense partial credit (`toy_geneval dense=true`), mean over the same images
    out["partial"] = float(np.mean([partial_credit(im, md, det, cf) for im, md in zip(images, mds)]))
    return out


def heldout_error(model, world, n: int = 48, seed: int = 0, sigmas=(0.3, 0.6, 0.9),
                  max_sequence_length: int = 12) -> float:
    """Mean squared pixel error of the one-step clean-image prediction x̂₀ = x_σ − σ·v_θ(x_σ, σ, c) on `n`
    held-out scenes (captions never seen in training), fixed noise, at the given σ (rectified flow:
    x_σ = (1−σ)x₀ + σε). Pixels in [-1, 1], so models with different latent statistics compare."""
    import torch

    scenes = world.sample(n, "heldout", seed=seed)
    images = np.stack([s.render() for s in scenes])
    target = pixels(images)
    x0 = encode_images(model.pipe, images)
    size = images.shape[1]
    cond = model.encode_prompts([s.prompt for s in scenes], max_sequence_length)
    img_ids = model.img_ids(size, size)
    gen = torch.Generator().manual_seed(seed)
    vae = model.pipe.vae
    errs = []
    with torch.no_grad():
        for sigma in sigmas:
            eps = torch.randn(x0.shape, generator=gen)
            xt = (1 - sigma) * x0 + sigma * eps  # rectified flow interpolation
            v = model.velocity(xt, torch.full((n,), sigma * 1000.0), cond, img_ids)
            lat = model.pipe._unpack_latents(xt - sigma * v, size, size, model.vae_scale_factor)
            lat = lat / vae.config.scaling_factor + vae.config.shift_factor
            errs.append(float(((vae.decode(lat).sample - target) ** 2).mean()))
    return float(np.mean(errs))


def samples_grid(model, world, sampling, path: Path, seed: int = 7) -> Path:
    """A grid PNG: per category two held-out prompts × three seeds, real scenes in the first column."""
    from PIL import Image, ImageDraw

    rows = [md for md in world.eval_prompts(2, "heldout")]
    prompts = [md["prompt"] for md in rows for _ in range(3)]
    seeds = [seed + k for _ in rows for k in range(3)]
    images = generate(model, prompts, seeds, sampling)
    rng = np.random.default_rng(seed)
    scale, label_w = 3, 330
    cell = world.size * scale
    grid = Image.new("RGB", (label_w + 4 * (cell + 4), len(rows) * (cell + 4) + 18), "white")
    draw = ImageDraw.Draw(grid)
    draw.text((4, 2), "prompt (held-out)", fill="black")
    draw.text((label_w, 2), "real scene", fill="black")
    draw.text((label_w + cell + 4, 2), "samples (3 seeds)", fill="black")
    for r, md in enumerate(rows):
        y = 18 + r * (cell + 4)
        draw.text((4, y + cell // 2 - 6), f"[{md['tag']}] {md['prompt'][11:]}", fill="black")
        real = world.scene(md, rng).image()
        grid.paste(real.resize((cell, cell), Image.NEAREST), (label_w, y))
        for k in range(3):
            grid.paste(
                images[3 * r + k].resize((cell, cell), Image.NEAREST), (label_w + (k + 1) * (cell + 4), y)
            )
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path)
    return path


# --------------------------------------------------------------------------------------------------
# the folder


def read_meta(path: str | os.PathLike) -> dict | None:
    f = Path(path) / META_FILE
    if not f.exists():
        return None
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError:
        return None


def _cache_root(cache_dir: str | os.PathLike | None) -> Path:
    from chunkgrpo.store.cache import cache_root

    return cache_root(cache_dir) / "toy-models"


def _build(cfg: ToyModelConfig, out: Path, key: str, progress: bool) -> None:
    """Pretrain and write the folder `out` (which must not exist)."""
    with tempfile.TemporaryDirectory() as tmp:
        pipe = build_components(cfg, Path(tmp))
        stats = pretrain(pipe, cfg, progress=progress)
        write_folder(pipe, cfg, out, key, stats)


def write_folder(pipe, cfg: ToyModelConfig, out: Path, key: str, stats: dict) -> None:
    """Save the pretrained pipeline as a toy model folder: the diffusers folder, the world's prompt files,
    the samples grid and `toy_model.json` (with the base model's held-out accuracy)."""
    import torch

    from chunkgrpo.flux import FluxModel, quiet_library_progress
    from chunkgrpo.toy.world import World, write_metadata, write_prompts

    quiet_library_progress()
    pipe.save_pretrained(out)
    world = World(cfg.seed, cfg.size)
    data = out / "toy"
    train = world.prompts("train")
    heldout = world.eval_prompts(cfg.eval_per_category or 16, "heldout")
    write_metadata(heldout, data / "heldout_metadata.jsonl")
    write_prompts([md["prompt"] for md in heldout], data / "heldout_prompts.txt")
    write_metadata(
        world.eval_prompts(cfg.eval_per_category or 16, "train"), data / "train_eval_metadata.jsonl"
    )
    write_metadata(
        [md for mds in world.prompts("heldout").values() for md in mds], data / "heldout_all.jsonl"
    )
    # RL training prompts, category-balanced: RL_PER_CATEGORY per category (a fixed sample of the large
    # categories, the small ones repeated), so no category dominates the policy gradient
    rl = []
    rng = np.random.default_rng(cfg.seed)
    for mds in train.values():
        if len(mds) >= RL_PER_CATEGORY:
            rl += [
                mds[i]["prompt"] for i in sorted(rng.choice(len(mds), size=RL_PER_CATEGORY, replace=False))
            ]
        else:
            rl += [mds[i % len(mds)]["prompt"] for i in range(RL_PER_CATEGORY)]
    write_prompts(rl, data / "train_prompts.txt")
    (data / "split.json").write_text(json.dumps(world.split.to_dict(), indent=1))
    pipe_dtype = torch.float32
    model = FluxModel(pipe, device=torch.device("cpu"), dtype=pipe_dtype, source=str(out), path=str(out))
    sampling = sampling_config(cfg)
    samples_grid(model, world, sampling, out / "samples.png")
    base = None
    if cfg.eval_per_category and cfg.eval_samples:
        t0 = time.perf_counter()
        base = accuracy(
            model, world.eval_prompts(cfg.eval_per_category, "heldout"), cfg.eval_samples, sampling
        )
        base = {
            "overall": base["overall"],
            "partial": base["partial"],
            "tasks": {k: v["score"] for k, v in base["tasks"].items()},
            "n_images": base["n_images"],
            "sampling": sampling.to_dict(),
            "eval_s": round(time.perf_counter() - t0, 2),
        }
    stats["heldout_error"] = heldout_error(model, world, max_sequence_length=cfg.max_sequence_length)
    meta = {
        "format": FORMAT,
        "key": key,
        "config": cfg.to_dict(),
        "pretraining": stats,
        "base_accuracy": base,
        "files": {
            "train_prompts": "toy/train_prompts.txt",
            "heldout_metadata": "toy/heldout_metadata.jsonl",
            "heldout_prompts": "toy/heldout_prompts.txt",
            "train_eval_metadata": "toy/train_eval_metadata.jsonl",
            "samples": "samples.png",
        },
    }
    (out / META_FILE).write_text(json.dumps(meta, indent=1))


def build_toy_model(out: str | os.PathLike, cfg: ToyModelConfig | None = None, *, cache_dir=None,
                    progress: bool = True) -> Path:
    """The pretrained toy model folder at `out` (see the module docstring for the cache rules)."""
    cfg = cfg or ToyModelConfig()
    out = Path(out).expanduser()
    key = model_key(cfg)
    meta = read_meta(out)
    if meta is not None and meta.get("key") == key:
        return out
    if out.exists() and (not out.is_dir() or (meta is None and any(out.iterdir()))):
        raise UserError(
            f"--out {str(out)!r} exists and is not a toy model folder; choose an empty or new folder"
        )
    cached = _cache_root(cache_dir) / key
    if read_meta(cached) is None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=cached.parent))
        try:
            shutil.rmtree(staging)
            _build(cfg, staging, key, progress)
            if read_meta(cached) is None:  # another process may have finished first
                if cached.exists():
                    shutil.rmtree(cached)
                staging.rename(cached)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(cached, staging)
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
    return out

"""Sampling the toy model and measuring it: the ODE sampling it is measured with, GenEval accuracy with the
exact detector, the held-out one-step error, the samples grid its folder holds."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from chunkgrpo.toy.components import encode_images, pixels
from chunkgrpo.toy.config import ToyModelConfig


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

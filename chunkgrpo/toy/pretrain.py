"""Flow-matching pretraining of the toy model's transformer (and text encoders) on the world's scenes."""

from __future__ import annotations

import copy
import math
import os
import time

import numpy as np

from chunkgrpo.toy.components import build_vae, encode_images, pixels
from chunkgrpo.toy.config import ToyModelConfig


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

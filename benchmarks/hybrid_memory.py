"""Hybrid inference memory/time: LoRA adapter toggling (one transformer) vs two transformer copies.

    .venv/bin/python benchmarks/hybrid_memory.py                   # tiny + mid on CPU
    .venv/bin/python benchmarks/hybrid_memory.py --sizes mid --device cuda --batch 4 --res 512

Each variant runs in a fresh subprocess so its peak memory is its own:
- toggle:     the base transformer + the LoRA adapter loaded into it; `HybridSampler` enables the
              adapter for steps < K and disables it after (what `chunkgrpo evaluate` does).
- two_copies: the base transformer + a deep copy with the LoRA fused into it (MixGRPO's
              DualFluxPipeline way: one full trained transformer next to the base one).
Reported: transformer parameters, peak RSS above the post-import baseline (CPU) or
torch.cuda.max_memory_allocated (GPU), seconds per hybrid sampling run, and whether the two
variants give the same latents (they must, up to fusion rounding).
Text encoders and the VAE are not loaded (random prompt embeddings): only the transformer side differs.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _rss_mb() -> float:
    with open("/proc/self/status") as fp:
        for line in fp:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def prepare(size: str, root: Path, rank: int, alpha: float) -> tuple[Path, Path]:
    """A `size` tiny-FLUX folder and a random non-zero LoRA for it (cached under root)."""
    import torch

    from chunkgrpo.testing.tiny import build_tiny_flux

    model = root / f"flux-{size}"
    if not (model / "model_index.json").exists():
        build_tiny_flux(model, size=size)
    lora = root / f"lora-{size}-r{rank}"
    if not (lora / "pytorch_lora_weights.safetensors").exists():
        from diffusers import FluxPipeline
        from peft import LoraConfig
        from peft.utils import get_peft_model_state_dict

        from chunkgrpo.flux import load_flux

        tr = load_flux(model, with_text_encoders=False, with_vae=False).transformer
        tr.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, target_modules=[
            "to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]))
        g = torch.Generator().manual_seed(0)
        for n, p in tr.named_parameters():
            if "lora_B" in n:
                p.data = torch.randn(p.shape, generator=g) * 0.02
        lora.mkdir(parents=True, exist_ok=True)
        FluxPipeline.save_lora_weights(lora, transformer_lora_layers=get_peft_model_state_dict(tr))
        (lora / "chunkgrpo_model.json").write_text(json.dumps(
            {"kind": "lora", "base_model": str(model), "lora": {"rank": rank, "alpha": alpha}}))
    return model, lora


def child(args) -> dict:
    """One variant in this process; prints a JSON line."""
    import diffusers  # noqa: F401  (imports count towards the baseline, not the variant)
    import peft  # noqa: F401
    import torch
    from diffusers import FluxPipeline, FluxTransformer2DModel  # noqa: F401

    from chunkgrpo.eval.hybrid import HybridConfig, HybridSampler, load_trained
    from chunkgrpo.flux import PromptEmbeds, load_flux

    torch.manual_seed(0)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    base_rss = _rss_mb()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    model = load_flux(args.model, device=device, dtype=dtype, with_text_encoders=False, with_vae=False)
    trained = load_trained(args.lora)
    if args.variant == "toggle":
        sampler = HybridSampler(model, trained)
    else:
        import copy

        sampler = HybridSampler(model, None)
        second = copy.deepcopy(model.transformer)
        second.load_lora_adapter(str(trained.path), prefix="transformer", adapter_name="t",
                                 weight_name="pytorch_lora_weights.safetensors")
        from peft.tuners.tuners_utils import BaseTunerLayer

        for m in second.modules():
            if isinstance(m, BaseTunerLayer):
                m.scaling["t"] = trained.lora_scale
        second.fuse_lora(lora_scale=1.0)
        second.unload_lora()
        second.requires_grad_(False)
        trained_tr = second

        def activate(phase, _base=model.transformer):
            return trained_tr if phase == "trained" else _base

        sampler.activate = activate
    load_s = time.perf_counter() - t0
    load_rss = _rss_mb() - base_rss
    cfg = HybridConfig(
        num_steps=args.steps,
        trained_steps=args.trained_steps,
        height=args.res,
        width=args.res,
        max_sequence_length=args.txt_len,
    )
    L, C = model.latent_shape(args.res, args.res)
    tcfg = model.transformer.config
    g = torch.Generator().manual_seed(1)
    cond = PromptEmbeds(
        torch.randn(args.batch, args.txt_len, tcfg.joint_attention_dim, generator=g).to(device, dtype),
        torch.randn(args.batch, tcfg.pooled_projection_dim, generator=g).to(device, dtype),
        torch.zeros(args.txt_len, 3, device=device, dtype=dtype),
    )
    x = torch.randn(args.batch, L, C, generator=g).to(device)
    sampler.sample_latents(cond, x, cfg, "hybrid")  # warm-up
    t1 = time.perf_counter()
    for _ in range(args.repeats):
        x0 = sampler.sample_latents(cond, x, cfg, "hybrid")
    if device.type == "cuda":
        torch.cuda.synchronize()
    sample_s = (time.perf_counter() - t1) / args.repeats
    n_params = sum(p.numel() for n, p in model.transformer.named_parameters() if "lora_" not in n)
    storages = {}
    for tr in {
        id(m): m for m in (model.transformer, sampler.activate("trained"), sampler.activate("base"))
    }.values():
        for t in list(tr.parameters()) + list(tr.buffers()):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    out = {"variant": args.variant, "size": args.size, "device": str(device),
           "transformer_params_M": round(n_params / 1e6, 2),
           "transformers_in_memory": 1 if args.variant == "toggle" else 2,
           "weights_mb": round(sum(storages.values()) / 2**20, 1),
           "load_s": round(load_s, 3), "rss_after_load_mb": round(load_rss, 1),
           "peak_rss_mb": round(_peak_rss_mb() - base_rss, 1), "sample_s": round(sample_s, 4),
           "x0_checksum": float(x0.double().abs().mean())}
    if device.type == "cuda":
        out["cuda_max_allocated_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    print("RESULT " + json.dumps(out), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="tiny,mid")
    p.add_argument("--device", default="cpu")
    p.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "chunkgrpo-bench"))
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--alpha", type=float, default=64.0)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--trained-steps", type=int, default=6)
    p.add_argument("--res", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--txt-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", help="also write the results to this file")
    # child mode
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--size", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--lora", help=argparse.SUPPRESS)
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.child:
        child(args)
        return
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    results = []
    for size in args.sizes.split(","):
        model, lora = prepare(size, root, args.rank, args.alpha)
        for variant in ("toggle", "two_copies"):
            cmd = [
                sys.executable,
                __file__,
                "--child",
                "--variant",
                variant,
                "--size",
                size,
                "--model",
                str(model),
                "--lora",
                str(lora),
                "--device",
                args.device,
                "--steps",
                str(args.steps),
                "--trained-steps",
                str(args.trained_steps),
                "--res",
                str(args.res),
                "--batch",
                str(args.batch),
                "--txt-len",
                str(args.txt_len),
                "--repeats",
                str(args.repeats),
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if proc.returncode or line is None:
                sys.exit(f"{size}/{variant} failed:\n{proc.stderr[-3000:]}")
            results.append(json.loads(line[7:]))
    cols = [
        "size",
        "variant",
        "transformer_params_M",
        "transformers_in_memory",
        "weights_mb",
        "rss_after_load_mb",
        "peak_rss_mb",
        "cuda_max_allocated_mb",
        "load_s",
        "sample_s",
    ]
    print(
        f"hybrid sampling: {args.steps} steps ({args.trained_steps} trained), {args.res}², "
        f"batch {args.batch}, "
        f"LoRA rank {args.rank}, device {args.device}"
    )
    print(" | ".join(cols))
    for r in results:
        print(" | ".join(str(r.get(c, "-")) for c in cols))
    for size in args.sizes.split(","):
        t, c = (
            next(r for r in results if r["size"] == size and r["variant"] == v)
            for v in ("toggle", "two_copies")
        )
        key = "cuda_max_allocated_mb" if "cuda_max_allocated_mb" in t else "peak_rss_mb"
        rel = abs(t["x0_checksum"] - c["x0_checksum"]) / max(abs(c["x0_checksum"]), 1e-12)
        print(
            f"{size}: toggle holds {t['weights_mb']:.1f} MB of weights "
            f"vs two copies {c['weights_mb']:.1f} MB; "
            f"{key} {t[key]:.1f} MB vs {c[key]:.1f} MB; "
            f"time {t['sample_s']:.3f}s vs {c['sample_s']:.3f}s; outputs agree to {rel:.1e} (relative)"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

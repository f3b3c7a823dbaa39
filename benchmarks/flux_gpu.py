"""FLUX.1-dev at its real size on one GPU: one LoRA iteration of the `chunk_grpo_flux` recipe shape.

    python benchmarks/flux_gpu.py --device cuda --json flux_gpu.json          # on an H100 / H200
    python benchmarks/flux_gpu.py --size tiny --device cpu --res 64 --steps 5 --group-size 3   # CPU check

What it builds: FLUX.1-dev's transformer (19 double- and 38 single-stream blocks, 11.9 B parameters,
the published config) with random weights, **constructed on the GPU in bf16** (writing and re-reading
24 GB of random weights would cost a minute of GPU time and measure the disk, not the engine). The other
components come from a one-block folder of the same widths (`chunkgrpo.testing.tiny`, `layers=(1, 1)`):
two-layer T5/CLIP encoders at T5-XXL's and CLIP-L's widths (dropped after the prompt embeddings are
cached, as in training) and a one-layer-per-block VAE. The reward is `brightness` (no reward model), so
every number below is the engine's own.

What it prints (one JSON object; every stage also prints a line as soon as it is done, so a run cut short
keeps what it finished):

1. `flops`: transformer FLOPs per sample, counted by `torch.utils.flop_counter` on one real forward
   (no grad) and one forward + backward (LoRA, gradient checkpointing as the recipe: the recomputed
   forward included, so MFU below is a hardware-FLOP utilisation).
2. `group_batch`: the group-in-one-batch speedup, DanceGRPO-style batch-1 sampling against the engine's
   `rollout_group` (one batch of G, the shared first step once), both over `--speedup-steps` steps.
3. `iteration`: one timed training iteration (after the stages above warmed cuBLAS and the allocator):
   rollout, reward and policy seconds, per sample, the transformer sample-evaluations, MFU of the rollout
   and of the policy phase against `--peak-tflops` (default: the card's dense bf16 peak).
4. `memory`: `torch.cuda.max_memory_allocated` of the iteration against `chunkgrpo.capacity`'s
   prediction for the same configuration (the rollout, decode and policy phases; resident = what was
   allocated before the iteration).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPTS = ["a cat on a chair", "a red car", "three apples", "a bowl of fruit"]
# dense bf16 peak, TFLOP/s (the vendors' spec sheets; SXM parts)
PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "H800": 989.4, "A100": 312.0}


def log(stage: str, payload: dict) -> None:
    print(f"STAGE {stage} {json.dumps(payload)}", flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def full_transformer_config(folder: Path, size: str) -> dict:
    """The folder's transformer config with the size's real block counts (FLUX.1-dev's for `flux`)."""
    from chunkgrpo.testing.tiny import SIZES

    cfg = json.loads((folder / "transformer" / "config.json").read_text())
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_")}
    cfg["num_layers"] = SIZES[size]["num_layers"]
    cfg["num_single_layers"] = SIZES[size]["num_single_layers"]
    if size == "flux":
        from chunkgrpo.capacity.arch import FLUX_DEV

        differ = {k: (cfg.get(k), v) for k, v in FLUX_DEV["transformer"].items()
                  if not k.startswith("_") and cfg.get(k) != v}
        if differ:
            raise SystemExit(f"the flux transformer config differs from FLUX.1-dev's: {differ}")
    return cfg


def build_on_device(cfg: dict, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The transformer constructed on `device` in `dtype` (random init there; nothing on the host)."""
    from diffusers import FluxTransformer2DModel

    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            tr = FluxTransformer2DModel.from_config(cfg)
    finally:
        torch.set_default_dtype(old)
    tr.requires_grad_(False)
    return tr.eval()


def install_loader(full_cfg: dict) -> dict:
    """Make `load_flux` put the full-size transformer (built on the device) into the pipeline it loads."""
    import chunkgrpo.flux as F

    real = F.load_flux
    info: dict = {}

    def load(*a, **k):
        m = real(*a, **k)
        t0 = time.perf_counter()
        big = build_on_device(full_cfg, m.device, m.dtype)
        sync(m.device)
        info["build_s"] = round(time.perf_counter() - t0, 2)
        info["params"] = sum(p.numel() for p in big.parameters())
        m.pipe.transformer = big
        m.transformer = big
        return m

    F.load_flux = load
    return info


def count_flops(t, cond1, res: int, backward: bool) -> dict:
    """FLOPs of one sample: a no-grad forward, and a forward + backward as the policy phase runs it."""
    from torch.utils.flop_counter import FlopCounterMode

    model, s = t.model, t.cfg.sampling
    x = model.initial_noise(1, res, res, torch.Generator().manual_seed(0)).to(model.device)
    ts = torch.tensor([500.0], device=model.device)
    img_ids = model.img_ids(res, res)
    with FlopCounterMode(display=False) as fc, torch.no_grad(), t._autocast():
        model.velocity(x, ts, cond1, img_ids, guidance=s.guidance)
    fwd = fc.get_total_flops()
    if not backward:
        return {"forward": fwd}
    with FlopCounterMode(display=False) as fc, t._autocast():
        v = model.velocity(x, ts, cond1, img_ids, guidance=s.guidance)
        v.float().square().mean().backward()
    train = fc.get_total_flops()
    t.optimizer.zero_grad(set_to_none=True)
    return {"forward": fwd, "forward_backward": train, "tokens": x.shape[1] + s.max_sequence_length,
            "gradient_checkpointing": t.cfg.gradient_checkpointing}


def group_batch_speedup(t, cond1, G: int, steps: int, reps: int) -> dict:
    """Batch-1 sampling of G trajectories (DanceGRPO) vs one `rollout_group` batch of G."""
    import dataclasses

    from chunkgrpo.rollout import rollout_group

    model, dev = t.model, t.model.device
    s = dataclasses.replace(t.cfg.sampling, num_steps=steps)

    def timed(fn) -> float:
        best = float("inf")
        for _ in range(reps):
            sync(dev)
            t0 = time.perf_counter()
            fn()
            sync(dev)
            best = min(best, time.perf_counter() - t0)
        return best

    def batch1():
        for g in range(G):
            rollout_group(model, cond1, 1, s, torch.Generator().manual_seed(g))

    def grouped():
        rollout_group(model, cond1, G, s, torch.Generator().manual_seed(0))

    def counted(fn) -> tuple[float, dict]:
        before = model.counter.as_dict()
        best = timed(fn)
        after = model.counter.as_dict()
        per_rep = {k: (after[k] - before[k]) // reps for k in ("transformer_forward", "transformer_samples")}
        return best, per_rep

    with torch.no_grad(), t._autocast():
        grouped()  # warm-up (kernels for both batch sizes)
        batch1()
        b1, b1_calls = counted(batch1)
        grp, grp_calls = counted(grouped)
    return {"group_size": G, "steps": steps, "batch1_s": round(b1, 4), "group_s": round(grp, 4),
            "speedup": round(b1 / grp, 3), "batch1_calls": b1_calls, "group_calls": grp_calls,
            "reps": reps, "timing": "best of reps"}


def peak_tflops(device: torch.device, given: float) -> float:
    if given:
        return given
    if device.type != "cuda":
        return 0.0
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), 0.0)


def measure_iteration(t, device, args, full, folder, result) -> None:
    """One timed training iteration, then the capacity plan's prediction for it."""
    from chunkgrpo.capacity.arch import ModelArch
    from chunkgrpo.capacity.plan import capacity_plan
    from chunkgrpo.capacity.pool import local_pool

    cfg = t.cfg
    P, G = cfg.prompts_per_rank, cfg.group_size
    resident = 0
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        resident = torch.cuda.memory_allocated()
    t.model.counter.reset()
    t0 = time.perf_counter()
    m = t.iteration()
    sync(device)
    wall = time.perf_counter() - t0
    B = P * G
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
    log("iteration_raw", {"wall_s": wall, **{k: v for k, v in m.items() if isinstance(v, (int, float))}})
    flops = result.get("flops") or count_flops(t, t.embeds.get(PROMPTS[:1]), args.res, backward=False)
    # LoRA + checkpointing: forward, input gradients (≈ one forward) and the recomputed forward
    fwd, fb = flops["forward"], flops.get("forward_backward", 3 * flops["forward"])
    result["policy_flops_basis"] = "counted" if "forward_backward" in flops else "3 x forward (estimate)"
    trained = m.get("policy_on_samples", 0) + m.get("policy_off_samples", 0)
    roll_evals = m.get("rollout_samples", 0)
    pk = peak_tflops(device, args.peak_tflops)
    it = {
        "wall_s": round(wall, 3),
        "rollout_s": round(m["time/rollout"], 3),
        "reward_s": round(m["time/reward"], 3),
        "policy_s": round(m["time/policy"], 3),
        "samples": B,
        "rollout_s_per_sample": round(m["time/rollout"] / B, 4),
        "policy_s_per_sample": round(m["time/policy"] / B, 4),
        "rollout_sample_evals": roll_evals,
        "policy_trained_inputs": trained,
        "transformer_sample_evals": m.get("transformer_samples"),
        "algorithm_minimum_sample_evals": m.get("min_transformer_samples"),
        "rollout_tflops_per_s": round(fwd * roll_evals / m["time/rollout"] / 1e12, 1),
        "policy_tflops_per_s": round(fb * trained / m["time/policy"] / 1e12, 1) if trained else None,
        "peak_tflops": pk,
    }
    if pk:
        it["rollout_mfu"] = round(it["rollout_tflops_per_s"] / pk, 3)
        if it["policy_tflops_per_s"] is not None:
            it["policy_hfu"] = round(it["policy_tflops_per_s"] / pk, 3)
    result["iteration"] = it
    result["metrics_finite"] = all(v == v for v in m.values() if isinstance(v, float))
    log("iteration", it)

    arch = ModelArch.from_folder(folder)
    arch.transformer = {k: v for k, v in full.items()}
    pool = local_pool(gpu_memory=torch.cuda.get_device_properties(device).total_memory
                      if device.type == "cuda" else 0)
    plan = capacity_plan(cfg, pool, device="cuda", arch=arch, prompts=len(PROMPTS))
    phases = {i.what: i.need for i in plan.items if i.resource == "GPU memory per rank"}
    gpu_phases = {k: v for k, v in phases.items() if k.split()[0] in ("rollout", "decode", "policy")}
    predicted = max(gpu_phases.values())
    result["memory"] = {
        "resident_before_iteration_gib": round(resident / 2**30, 2) if device.type == "cuda" else None,
        "measured_peak_gib": round(peak / 2**30, 2),
        "predicted_gib": {k: round(v / 2**30, 2) for k, v in phases.items()},
        "predicted_peak_gib": round(predicted / 2**30, 2),
        "measured_over_predicted": round(peak / predicted, 3) if peak else None,
    }
    log("memory", result["memory"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="flux", choices=["tiny", "mid", "flux"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--res", type=int, default=720)
    ap.add_argument("--steps", type=int, default=17, help="sampling steps (the recipe's 17)")
    ap.add_argument("--group-size", type=int, default=12, help="G (the recipe's 12)")
    ap.add_argument("--prompts-per-rank", type=int, default=1,
                    help="prompts per rank (the recipe's 2; 1 halves the GPU time, per-sample numbers equal)")
    ap.add_argument("--speedup-steps", type=int, default=3)
    ap.add_argument("--speedup-reps", type=int, default=2)
    ap.add_argument("--peak-tflops", type=float, default=0.0)
    ap.add_argument("--stages", default="iteration,flops,group_batch",
                    help="what to measure, in this order (run them as separate processes to keep a CUDA "
                         "fault in one from losing the others)")
    ap.add_argument("--json", help="also write the result here")
    ap.add_argument("overrides", nargs="*", help="more TrainConfig overrides")
    args = ap.parse_args()

    from chunkgrpo.testing.tiny import build_tiny_flux
    from chunkgrpo.train.config import TrainConfig
    from chunkgrpo.train.trainer import Trainer

    device = torch.device(args.device)
    result: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "size": args.size}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        t0 = time.perf_counter()
        folder = build_tiny_flux(tmp / "model", size=args.size, layers=(1, 1))
        result["folder_s"] = round(time.perf_counter() - t0, 2)
        full = full_transformer_config(folder, args.size)
        built = install_loader(full)
        prompts = tmp / "prompts.txt"
        prompts.write_text("\n".join(PROMPTS) + "\n")
        G, P = args.group_size, args.prompts_per_rank
        over = [
            f"model={folder}", f"prompts={prompts}", f"output_dir={tmp / 'run'}", f"device={args.device}",
            "progress=false", "checkpoint.every=0", "checkpoint.resume=false", "tracking.image_every=0",
            "lora.enabled=true", "distributed=ddp", "rewards=[{name: brightness, weight: 1.0}]",
            f"sampling.height={args.res}", f"sampling.width={args.res}", f"sampling.num_steps={args.steps}",
            f"group_size={G}", f"prompts_per_rank={P}", f"grad_accum={max(1, P * G // 2)}",
            "max_iterations=2", *args.overrides,
        ]
        if args.steps != 17:  # the recipe's [2,3,4,7] needs 16 trainable steps
            over.append("chunks=uniform:2")
        cfg = TrainConfig.load("chunk_grpo_flux", over)
        result["config"] = {"res": args.res, "steps": cfg.sampling.num_steps, "chunks": cfg.chunks,
                            "group_size": G, "prompts_per_rank": P, "grad_accum": cfg.grad_accum,
                            "lora_rank": cfg.lora.rank, "gradient_checkpointing": cfg.gradient_checkpointing,
                            "chunk_backward": cfg.chunk_backward, "policy_batch": cfg.policy_batch}
        t = Trainer(cfg)
        t0 = time.perf_counter()
        t.setup()
        sync(device)
        result["setup"] = {"s": round(time.perf_counter() - t0, 2), **built,
                           "trainable": sum(p.numel() for p in t.trainable)}
        log("setup", result["setup"])
        cond1 = t.embeds.get(PROMPTS[:1])

        for stage in args.stages.split(","):
            if stage == "flops":
                result["flops"] = count_flops(t, cond1, args.res, backward=True)
                log("flops", result["flops"])
            elif stage == "group_batch":
                result["group_batch"] = group_batch_speedup(t, cond1, G, args.speedup_steps,
                                                            args.speedup_reps)
                log("group_batch", result["group_batch"])
            elif stage == "iteration":
                measure_iteration(t, device, args, full, folder, result)
            else:
                raise SystemExit(f"unknown stage {stage!r}")
        t.close()
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    from chunkgrpo import startup

    startup.fewer_full_collections()  # as the entry points: fewer full collections while it loads
    sys.exit(main())

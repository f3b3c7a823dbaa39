"""Per-optimizer-step cost of GRPO training: transformer calls vs the algorithm's minimum, wall-time
split (rollout / reward / policy update / other), peak memory, and the rollout-vs-training ratio drift.

  python benchmarks/step_cost.py --size tiny                 # tiny FLUX, CPU
  python benchmarks/step_cost.py --size mid --res 256        # ~37 M-parameter FLUX config, CPU
  python benchmarks/step_cost.py --size flux --res 720 --device cuda   # FLUX.1-dev-sized, random weights (GPU)
  python benchmarks/step_cost.py --method granular           # branching cost vs G2RPO's / TempFlow's released code
  python benchmarks/step_cost.py --method tempflow sampling.num_steps=10 group_size=6

--method tempflow|granular: per anchor (prompt × initial noise), the per-sample transformer forwards and
the sequential model calls this engine made (measured by the call counter) against the reference
implementations' counts for the same settings, and for the FLUX recipe of the method's preset
(G2RPO: 16 steps, k = 0..7, λ ∈ {1, 2}, G = 12: 1,792 sampling + 8 training forwards, all sequential).

"Minimum": one batched rollout pass over N steps for the P·G samples, plus exactly one forward and
backward per trained (sample, step) pair. Drift: max |logp_train − logp_rollout| at θ = θ_old, with
the old log-prob taken from the batched rollout ("rollout") or recomputed in the training layout
("recomputed"), in fp32 and under bf16 autocast.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

from chunkgrpo.rollout import policy_log_probs, rollout_group  # noqa: E402
from chunkgrpo.tiny import build_tiny_flux  # noqa: E402
from chunkgrpo.train.config import TrainConfig  # noqa: E402
from chunkgrpo.train.trainer import Trainer  # noqa: E402

PROMPTS = ["a cat on a chair", "a red car", "three apples", "a bowl of fruit", "a dog in the park", "a city at night"]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure_drift(t: Trainer, dtype_ctx) -> dict:
    """Rollout (batched P·G) log-probs vs training-layout (one sample, one chunk) log-probs, θ = θ_old."""
    cfg, model = t.cfg, t.model
    prompts = t.stream.batch(0, 0)
    cond = t.embeds.get(prompts)
    gen = torch.Generator().manual_seed(123)
    with torch.no_grad(), dtype_ctx():
        traj = rollout_group(model, cond, cfg.group_size, cfg.sampling, gen)
        cond_rep = cond.repeat_interleave(cfg.group_size)
        worst_rollout, worst_recomputed = 0.0, 0.0
        for b in range(traj.latents.shape[0]):
            for a, e in t.ranges:
                steps = list(range(a, e))
                train = policy_log_probs(model, traj, cond_rep, steps, cfg.sampling, samples=[b]).float()
                again = policy_log_probs(model, traj, cond_rep, steps, cfg.sampling, samples=[b]).float()
                worst_rollout = max(worst_rollout, float((train - traj.log_probs[b, a:e]).abs().max()))
                worst_recomputed = max(worst_recomputed, float((train - again).abs().max()))
    return {"max_abs_log_ratio_vs_rollout": worst_rollout, "max_abs_log_ratio_vs_recomputed": worst_recomputed}


def branching_report(cfg: TrainConfig, rows: list[dict]) -> dict:
    """Per anchor: measured calls vs this engine's formula vs the reference implementation's, for the run's
    settings and for the FLUX recipe of the method's preset."""
    from chunkgrpo.train import branching as br

    def compare(c: TrainConfig) -> dict:
        steps, grans, G, N = br.branch_steps(c), br.granularities(c), c.group_size, c.sampling.num_steps
        ours = br.engine_cost(N, steps, grans, G, kl_ref=c.kl_ref_coef > 0)
        ref = (br.g2rpo_reference_cost(N, steps, grans, G) if c.method == "granular"
               else br.tempflow_reference_cost(N, steps, G, kl_ref=c.kl_ref_coef > 0))
        return {"settings": {"num_steps": N, "branch_steps": steps, "granularities": grans, "group_size": G,
                             "kl_ref": c.kl_ref_coef > 0},
                "engine": {"per_sample_forwards": ours.sample_forwards, "sequential_calls": ours.sequential_calls},
                "reference": {"per_sample_forwards": ref.sample_forwards, "sequential_calls": ref.sequential_calls},
                "forwards_saved_pct": round(100 * (1 - ours.sample_forwards / ref.sample_forwards), 1),
                "sequential_ratio": round(ref.sequential_calls / ours.sequential_calls, 1)}

    P = cfg.prompts_per_rank
    run = compare(cfg)
    run["measured"] = {"per_sample_forwards": sum(r["transformer_samples"] for r in rows) / len(rows) / P,
                       "sequential_calls": sum(r["transformer_forward"] for r in rows) / len(rows)}
    flux = TrainConfig.load(f"{cfg.method}_grpo_flux")
    return {"run": run, "flux_recipe": {"preset": f"{cfg.method}_grpo_flux", **compare(flux)}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="tiny", choices=["tiny", "mid", "flux"])
    ap.add_argument("--res", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps to time")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--method", choices=["tempflow", "granular"], default=None,
                    help="branching method: report its transformer calls against the reference implementations")
    ap.add_argument("overrides", nargs="*", help="TrainConfig overrides (e.g. method=dance chunk_backward=graph)")
    args = ap.parse_args()
    preset = f"{args.method}_grpo_tiny_cpu" if args.method else "tiny_cpu"
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        t0 = time.perf_counter()
        model_dir = build_tiny_flux(tmp / "model", size=args.size)
        build_s = time.perf_counter() - t0
        prompts = tmp / "prompts.txt"
        prompts.write_text("\n".join(PROMPTS) + "\n")
        over = [f"model={model_dir}", f"prompts={prompts}", f"output_dir={tmp / 'run'}", "progress=false",
                f"sampling.height={args.res}", f"sampling.width={args.res}", f"device={args.device}",
                "checkpoint.every=0", "checkpoint.resume=false", "tracking.image_every=0", *args.overrides]
        cfg = TrainConfig.load(preset, over)
        t = Trainer(cfg)
        t.setup()
        params = sum(p.numel() for p in t.model.transformer.parameters())
        trainable = sum(p.numel() for p in t.trainable)
        rows = []
        cuda = args.device.startswith("cuda")
        while t.opt_step < args.steps:
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            t_it = time.perf_counter()
            m = t.iteration()
            t.iteration_idx += 1
            m["time/iteration"] = time.perf_counter() - t_it
            m["peak_mem_mb"] = torch.cuda.max_memory_allocated() / 2**20 if cuda else peak_rss_mb()
            rows.append(m)
        per_step = max(1, t.steps_per_iteration)
        keys = ("rollout", "reward", "policy")
        split = {k: sum(r[f"time/{k}"] for r in rows) / len(rows) / per_step for k in keys}
        total = sum(r["time/iteration"] for r in rows) / len(rows) / per_step
        split["other"] = total - sum(split.values())
        from contextlib import nullcontext

        if args.method:  # branching: exactly on-policy (ratio 1 by construction), no rollout/training drift
            drift, branching = None, branching_report(cfg, rows)
        else:
            drift = {"fp32": measure_drift(t, nullcontext)}
            dev_type = "cuda" if cuda else "cpu"
            drift["bf16_autocast"] = measure_drift(t, lambda: torch.autocast(dev_type, dtype=torch.bfloat16))
            branching = None
        t.close()
    res = {
        "size": args.size, "resolution": args.res, "device": args.device, "method": cfg.method,
        "chunk_backward": cfg.chunk_backward, "transformer_params": params, "trainable_params": trainable,
        "samples_per_rollout": cfg.samples_per_rank, "num_steps": cfg.sampling.num_steps,
        "chunk_sizes": t.sizes, "optimizer_steps_per_rollout": per_step, "model_build_s": round(build_s, 2),
        "per_optimizer_step": {
            "transformer_forward_calls": sum(r["transformer_forward"] for r in rows) / len(rows) / per_step,
            "transformer_sample_evals": sum(r["transformer_samples"] for r in rows) / len(rows) / per_step,
            "algorithm_minimum_sample_evals": sum(r["min_transformer_samples"] for r in rows) / len(rows) / per_step,
            "wall_s": round(total, 4), "split_s": {k: round(v, 4) for k, v in split.items()},
            "split_pct": {k: round(100 * v / total, 1) for k, v in split.items()},
        },
        "peak_memory_mb": round(max(r["peak_mem_mb"] for r in rows), 1),
        "peak_memory_kind": "torch.cuda.max_memory_allocated" if cuda else "process max RSS",
        "ratio_drift_at_theta_old": drift,
    }
    if branching:
        res["branching_calls_per_anchor"] = branching
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Cost of GRPO training per policy window, chunk-backward strategies side by side: wall time,
transformer sample-evaluations and peak memory of the on-policy window (θ = θ_old) and of the
off-policy window (after an optimizer step), plus the iteration split and the algorithm's minimum.

  python benchmarks/step_cost.py --size tiny                       # per_step | graph | accumulate | auto
  python benchmarks/step_cost.py --size mid --res 256 --paper-chunks
  python benchmarks/step_cost.py --rows per_step:1,auto:7 --size mid --res 256 compile=rollout
  python benchmarks/step_cost.py --size flux --res 720 --device cuda --paper-chunks   # FLUX.1-dev-sized, GPU
  python benchmarks/step_cost.py --method granular      # branching cost vs G2RPO's / TempFlow's released code
  python benchmarks/step_cost.py --method tempflow sampling.num_steps=10 group_size=6

--method tempflow|granular: per anchor (prompt × initial noise), the per-sample transformer forwards and
the sequential model calls this engine made (measured by the call counter) against the reference
implementations' counts for the same settings, and for the FLUX recipe of the method's preset
(G2RPO: 16 steps, k = 0..7, λ ∈ {1, 2}, G = 12: 1,792 sampling + 8 training forwards, all sequential).

A row is `strategy:policy_batch` (`chunk_backward`, and the memory budget in transformer inputs per
training graph). Each row runs in its own process, so peak memory is that row's: the growth of the
process's resident set (CPU; `/proc` high-water mark reset before each window) or of
`torch.cuda.max_memory_allocated` (GPU) while the window trains, over what was resident before it.
Every iteration has two windows (grad_accum = half the samples): the first on-policy, the second
off-policy. "Minimum": every distinct transformer input once per θ — one rollout pass (a group's
shared step 0 once per prompt) plus one forward and backward per distinct trained (sample, step).
`--drift` adds max |logp_train − logp_rollout| at θ = θ_old (fp32 and bf16 autocast).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch

PROMPTS = [
    "a cat on a chair",
    "a red car",
    "three apples",
    "a bowl of fruit",
    "a dog in the park",
    "a city at night",
]
DEFAULT_ROWS = "per_step:1,graph:1,accumulate:1,auto:4"
PAPER = ["sampling.num_steps=17", "chunks=sizes:2,3,4,7"]  # the paper's plan (chunk of 7 steps)


# ----------------------------------------------------------------------------- memory probes

def _status_kb(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


class WindowMemory:
    """Peak extra memory of each policy window (MB over what was resident when the window began)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.peaks: list[float] = []

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            Path("/proc/self/clear_refs").write_text("5")  # reset the resident-set high-water mark
            self.base = _status_kb("VmRSS") * 1024

    def stop(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
        else:
            peak = _status_kb("VmHWM") * 1024
        self.peaks.append((peak - self.base) / 2**20)

    @property
    def kind(self) -> str:
        return (
            "torch.cuda.max_memory_allocated growth" if self.cuda else "process resident-set (VmHWM) growth"
        )


# ----------------------------------------------------------------------------- one configuration

def measure_drift(t, dtype_ctx) -> dict:
    """Rollout (batched P·G) log-probs vs training-layout (one sample, one chunk) log-probs, θ = θ_old."""
    from chunkgrpo.rollout import policy_log_probs, rollout_group

    cfg, model = t.cfg, t.model
    prompts = t.stream.batch(0, 0)
    cond = t.embeds.get(prompts)
    gen = torch.Generator().manual_seed(123)
    with torch.no_grad(), dtype_ctx():
        traj = rollout_group(model, cond, cfg.group_size, cfg.sampling, gen)
        cond_rep = cond.repeat_interleave(cfg.group_size)
        worst_rollout, worst_recomputed = 0.0, 0.0
        for b in range(traj.latents.shape[0]):
            for a, e in t.plan.ranges:
                steps = list(range(a, e))
                train = policy_log_probs(model, traj, cond_rep, steps, cfg.sampling, samples=[b]).float()
                again = policy_log_probs(model, traj, cond_rep, steps, cfg.sampling, samples=[b]).float()
                worst_rollout = max(worst_rollout, float((train - traj.log_probs[b, a:e]).abs().max()))
                worst_recomputed = max(worst_recomputed, float((train - again).abs().max()))
    return {
        "max_abs_log_ratio_vs_rollout": worst_rollout,
        "max_abs_log_ratio_vs_recomputed": worst_recomputed,
    }


def run_config(size: str, res: int, iterations: int, device: str, overrides: list[str], drift: bool,
               warmup: int = 1, threads: int = 0) -> dict:
    """Train `warmup` + `iterations` iterations of one configuration; per-window cost and the split."""
    if threads:
        torch.set_num_threads(threads)
    from chunkgrpo.testing.tiny import build_tiny_flux
    from chunkgrpo.train import policy_window
    from chunkgrpo.train.config import TrainConfig
    from chunkgrpo.train.trainer import Trainer

    cuda = device.startswith("cuda")
    mem = WindowMemory(cuda)
    real = policy_window.window_backward

    def measured(*a, **k):  # the policy window, bracketed by the memory probe
        mem.start()
        out = real(*a, **k)
        mem.stop()
        return out

    policy_window.window_backward = measured  # grpo calls it through the module
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = build_tiny_flux(tmp / "model", size=size)
        prompts = tmp / "prompts.txt"
        prompts.write_text("\n".join(PROMPTS) + "\n")
        base = TrainConfig.load("tiny_cpu", [f"model={model_dir}", f"prompts={prompts}", *overrides])
        over = [
            f"model={model_dir}",
            f"prompts={prompts}",
            f"output_dir={tmp / 'run'}",
            "progress=false",
            f"sampling.height={res}",
            f"sampling.width={res}",
            f"device={device}",
            "checkpoint.every=0",
            "checkpoint.resume=false",
            "tracking.image_every=0",
            f"grad_accum={base.samples_per_rank // 2}",
            f"max_steps={10**6}",
            *overrides,
        ]
        cfg = TrainConfig.load("tiny_cpu", over)
        t = Trainer(cfg)
        t.setup()
        rows = []
        for i in range(warmup + iterations):
            mem.peaks.clear()
            t0 = time.perf_counter()
            m = t.iteration()
            t.iteration_idx += 1
            m["time/iteration"] = time.perf_counter() - t0
            m["window_peak_mb"] = list(mem.peaks)
            if i >= warmup:  # warm-up iterations: allocator, threads, compile
                rows.append(m)
        from contextlib import nullcontext

        drifts = {}
        if drift:
            drifts["fp32"] = measure_drift(t, nullcontext)
            dev_type = "cuda" if cuda else "cpu"
            drifts["bf16_autocast"] = measure_drift(t, lambda: torch.autocast(dev_type, dtype=torch.bfloat16))
        params = sum(p.numel() for p in t.model.transformer.parameters())
        trainable = sum(p.numel() for p in t.trainable)
        t.close()

    def avg(k):
        return sum(r[k] for r in rows) / len(rows)

    split = {k: avg(f"time/{k}") for k in ("rollout", "reward", "policy")}
    split["other"] = avg("time/iteration") - sum(split.values())
    return {
        "size": size,
        "resolution": res,
        "device": device,
        "method": cfg.method,
        "chunk_backward": cfg.chunk_backward,
        "policy_batch": cfg.policy_batch,
        "compile": cfg.compile,
        "transformer_params": params,
        "trainable_params": trainable,
        "samples_per_rollout": cfg.samples_per_rank,
        "samples_per_window": cfg.grad_accum,
        "num_steps": cfg.sampling.num_steps,
        "chunk_sizes": t.plan.sizes,
        "iterations_timed": len(rows),
        "warmup_iterations": warmup,
        "torch_threads": torch.get_num_threads(),
        "on_policy_window": {
            "wall_s": round(avg("policy_on_s"), 4),
            "sample_evals": avg("policy_on_samples"),
            "peak_mb": round(max(r["window_peak_mb"][0] for r in rows), 1),
        },
        "off_policy_window": {
            "wall_s": round(avg("policy_off_s"), 4),
            "sample_evals": avg("policy_off_samples"),
            "peak_mb": round(max(r["window_peak_mb"][-1] for r in rows), 1),
        },
        "per_iteration": {
            "transformer_forward_calls": avg("transformer_forward"),
            "transformer_sample_evals": avg("transformer_samples"),
            "algorithm_minimum_sample_evals": avg("min_transformer_samples"),
            "without_shared_inputs_sample_evals": avg("unshared_transformer_samples"),
            "rollout_sample_evals": avg("rollout_samples"),
            "wall_s": round(avg("time/iteration"), 4),
            "split_s": {k: round(v, 4) for k, v in split.items()},
        },
        "peak_memory_kind": mem.kind,
        **({"ratio_drift_at_theta_old": drifts} if drifts else {}),
    }


# ----------------------------------------------------------------------------- side by side

def build_rows(args) -> list[list[str]]:
    """TrainConfig overrides of each row (`strategy:policy_batch`)."""
    rows = []
    for spec in args.rows.split(","):
        strategy, _, budget = spec.strip().partition(":")
        rows.append([f"chunk_backward={strategy}", f"policy_batch={budget or 1}"])
    return rows


def table(results: list[dict]) -> str:
    head = (
        f"{'strategy':<11}{'batch':>6} | {'on: s':>8}{'evals':>7}{'MB':>8}"
        f" | {'off: s':>8}{'evals':>7}{'MB':>8}"
        f" | {'iter s':>8}{'evals':>7}{'min':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        on, off, it = r["on_policy_window"], r["off_policy_window"], r["per_iteration"]
        lines.append(
            f"{r['chunk_backward']:<11}{r['policy_batch']:>6}"
            f" | {on['wall_s']:>8.3f}{on['sample_evals']:>7.0f}"
            f"{on['peak_mb']:>8.1f} | {off['wall_s']:>8.3f}{off['sample_evals']:>7.0f}{off['peak_mb']:>8.1f}"
            f" | {it['wall_s']:>8.3f}{it['transformer_sample_evals']:>7.0f}"
            f"{it['algorithm_minimum_sample_evals']:>6.0f}"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- branching methods

def branching_report(cfg, rows: list[dict]) -> dict:
    """Per anchor: measured calls vs this engine's formula vs the reference implementation's, for the run's
    settings and for the FLUX recipe of the method's preset."""
    from chunkgrpo.train import branching as br
    from chunkgrpo.train.config import TrainConfig

    def compare(c) -> dict:
        steps, grans, G, N = br.branch_steps(c), br.granularities(c), c.group_size, c.sampling.num_steps
        ours = br.engine_cost(N, steps, grans, G, kl_ref=c.kl_ref_coef > 0)
        ref = (br.g2rpo_reference_cost(N, steps, grans, G) if c.method == "granular"
               else br.tempflow_reference_cost(N, steps, G, kl_ref=c.kl_ref_coef > 0))
        return {
            "settings": {
                "num_steps": N,
                "branch_steps": steps,
                "granularities": grans,
                "group_size": G,
                "kl_ref": c.kl_ref_coef > 0,
            },
            "engine": {
                "per_sample_forwards": ours.sample_forwards,
                "sequential_calls": ours.sequential_calls,
            },
            "reference": {
                "per_sample_forwards": ref.sample_forwards,
                "sequential_calls": ref.sequential_calls,
            },
            "forwards_saved_pct": round(100 * (1 - ours.sample_forwards / ref.sample_forwards), 1),
            "sequential_ratio": round(ref.sequential_calls / ours.sequential_calls, 1),
        }

    P = cfg.prompts_per_rank
    run = compare(cfg)
    run["measured"] = {"per_sample_forwards": sum(r["transformer_samples"] for r in rows) / len(rows) / P,
                       "sequential_calls": sum(r["transformer_forward"] for r in rows) / len(rows)}
    flux = TrainConfig.load(f"{cfg.method}_grpo_flux")
    return {"run": run, "flux_recipe": {"preset": f"{cfg.method}_grpo_flux", **compare(flux)}}


def run_branching(args) -> int:
    """--method tempflow|granular: train a few optimizer steps of the method's tiny preset, count calls."""
    from chunkgrpo.testing.tiny import build_tiny_flux
    from chunkgrpo.train.config import TrainConfig
    from chunkgrpo.train.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = build_tiny_flux(tmp / "model", size=args.size)
        prompts = tmp / "prompts.txt"
        prompts.write_text("\n".join(PROMPTS) + "\n")
        over = [f"model={model_dir}", f"prompts={prompts}", f"output_dir={tmp / 'run'}", "progress=false",
                f"sampling.height={args.res}", f"sampling.width={args.res}", f"device={args.device}",
                "checkpoint.every=0", "checkpoint.resume=false", "tracking.image_every=0", *args.overrides]
        cfg = TrainConfig.load(f"{args.method}_grpo_tiny_cpu", over)
        t = Trainer(cfg)
        t.setup()
        rows = []
        for _ in range(max(1, args.iterations)):
            t0 = time.perf_counter()
            m = t.iteration()
            t.iteration_idx += 1
            m["time/iteration"] = time.perf_counter() - t0
            rows.append(m)
        t.close()
    # branching is exactly on-policy (ratio 1 by construction): no rollout/training drift to measure
    print(json.dumps({"size": args.size, "resolution": args.res, "device": args.device, "method": cfg.method,
                      "iterations_timed": len(rows),
                      "wall_s_per_iteration": round(sum(r["time/iteration"] for r in rows) / len(rows), 4),
                      "branching_calls_per_anchor": branching_report(cfg, rows)}, indent=1))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="tiny", choices=["tiny", "mid", "flux"])
    ap.add_argument("--res", type=int, default=64)
    ap.add_argument("--iterations", type=int, default=2, help="timed iterations per row")
    ap.add_argument(
        "--warmup", type=int, default=1, help="untimed iterations first (allocator, threads, compile)"
    )
    ap.add_argument("--threads", type=int, default=0, help="torch threads per row (0 = torch's default)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--rows", default=DEFAULT_ROWS, help=f"strategy:policy_batch,... (default {DEFAULT_ROWS})"
    )
    ap.add_argument(
        "--paper-chunks",
        action="store_true",
        help="17 steps, chunks [2,3,4,7] (default: tiny_cpu's 8 steps, [2,2,3])",
    )
    ap.add_argument(
        "--drift", action="store_true", help="also measure the rollout-vs-training log-prob drift (first row)"
    )
    ap.add_argument(
        "--method",
        choices=["tempflow", "granular"],
        default=None,
        help="branching method: report its transformer calls against the reference implementations",
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument(
        "overrides", nargs="*", help="TrainConfig overrides for every row (e.g. method=dance kl_coef=0.01)"
    )
    args = ap.parse_args()
    if args.child:  # one row, in its own process
        spec = json.loads(args.child)
        print("RESULT " + json.dumps(run_config(**spec)))
        return 0
    if args.method:
        return run_branching(args)
    common = (PAPER if args.paper_chunks else []) + list(args.overrides)
    results = []
    for i, row in enumerate(build_rows(args)):
        spec = {"size": args.size, "res": args.res, "iterations": args.iterations, "device": args.device,
                "overrides": common + row, "drift": args.drift and i == 0, "warmup": args.warmup,
                "threads": args.threads}
        proc = subprocess.run(
            [sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True
        )
        out = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not out:
            sys.stderr.write(proc.stderr[-4000:])
            print(f"row {' '.join(row)} failed (exit {proc.returncode})", file=sys.stderr)
            return 1
        results.append(json.loads(out[-1][len("RESULT "):]))
        # each finished row at once (a long run stopped later keeps the rows it finished)
        print(
            f"done: {' '.join(row)}\n{table(results[-1:])}\nROW {json.dumps(results[-1])}",
            file=sys.stderr,
            flush=True,
        )
    print(table(results))
    print(json.dumps({"rows": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

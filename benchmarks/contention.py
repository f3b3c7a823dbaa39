"""Slowdown of a training step and of the toy model's pretraining when a second 2-thread torch job runs
beside them, under the old thread policy and under chunkgrpo's (`chunkgrpo.threads`).

    python benchmarks/contention.py                       # both workloads, both policies, 5 samples each
    python benchmarks/contention.py --workloads step --samples 8 --json out.json

For each policy (`legacy`: torch's defaults, spinning OpenMP waits; `passive`: chunkgrpo's policy) and
each workload, the workload runs alone, then again while a competitor runs (a 2-thread torch job: small
MLP forward/backward in a loop, the same policy, as another chunkgrpo job would be; `--competitor-policy
legacy` makes it a foreign, spinning job). Each sample is the time of one unit (a training iteration:
`Trainer.iteration()` of `tiny_cpu` on the tiny FLUX; a pretraining chunk: `--pretrain-steps` optimizer
steps of the toy model's own `pretrain`). Slowdown = contended time / median alone time: the median and
the worst sample are printed. Every process is its own (the policy must be set before torch loads). The
load average is printed before and after: the numbers mean something only on an otherwise idle machine.

Target: ≤ 2× with one competing 2-thread job (spinning OpenMP threads gave 4.2× median, 13× worst).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ("legacy", "passive", "spin")
WORKLOADS = ("step", "pretrain")


def policy_env(policy: str, threads: int) -> dict:
    """The environment of a process under `policy` (nothing inherited that would decide it)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_WAIT_POLICY", "KMP_BLOCKTIME", "OMP_NUM_THREADS", "CHUNKGRPO_THREADS",
                        "CHUNKGRPO_THREAD_POLICY", "GOMP_SPINCOUNT")}
    env.update({"CHUNKGRPO_THREAD_POLICY": policy, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_VERBOSITY": "error", "CHUNKGRPO_PROGRESS": "off"})
    if policy == "legacy":
        env["OMP_NUM_THREADS"] = str(threads)  # threads set per job; waits spin (libgomp's default)
    else:
        env["CHUNKGRPO_THREADS"] = str(threads)
    return env


# ------------------------------------------------------------------------------------------ workers


def _worker_setup(threads: int):
    from chunkgrpo import threads as T

    T.configure()
    import torch

    if T.policy() == "legacy":
        torch.set_num_threads(threads)
    return torch


def worker_step(samples: int, threads: int) -> list[float]:
    """Seconds per training iteration (`tiny_cpu` on the tiny FLUX, chunk method), after one warm-up."""
    import tempfile

    _worker_setup(threads)
    from chunkgrpo.testing.tiny import build_tiny_flux
    from chunkgrpo.train.config import TrainConfig
    from chunkgrpo.train.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = build_tiny_flux(tmp / "model", seed=0)
        prompts = tmp / "p.txt"
        prompts.write_text("a red apple\na blue car\na cat on a chair\nthree balloons\n")
        cfg = TrainConfig.load("tiny_cpu", [f"model={model}", f"prompts={prompts}",
                                            f"output_dir={tmp / 'run'}",
                                            "progress=false", "checkpoint.every=0", "checkpoint.resume=false",
                                            "tracking.image_every=0", f"max_steps={10**6}"])
        t = Trainer(cfg)
        t.setup()
        out = []
        for i in range(samples + 1):
            t0 = time.perf_counter()
            t.iteration()
            t.iteration_idx += 1
            if i:
                out.append(time.perf_counter() - t0)
        t.close()
    return out


def worker_pretrain(samples: int, threads: int, steps: int) -> list[float]:
    """Seconds per `steps` pretraining optimizer steps of the default toy model (data preparation
    excluded)."""
    import tempfile

    _worker_setup(threads)
    from chunkgrpo.toy.components import build_components
    from chunkgrpo.toy.config import ToyModelConfig
    from chunkgrpo.toy.pretrain import pretrain

    cfg = ToyModelConfig(steps=steps, threads=threads, pool=1024, ema=0.0)
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        pipe = build_components(cfg, Path(tmp))
        pretrain(pipe, ToyModelConfig(steps=2, threads=threads, pool=256, ema=0.0), progress=False)  # warm-up
        for _ in range(samples):
            stats = pretrain(pipe, cfg, progress=False)
            out.append(stats["wall_s"] - stats["data_s"])
    return out


def worker_competitor(threads: int) -> None:
    """A 2-thread torch job that never ends: MLP forward/backward on small batches (many short parallel
    regions, where spinning OpenMP threads hurt most)."""
    torch = _worker_setup(threads)
    net = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    x = torch.randn(64, 256)
    print("competitor running", flush=True)
    while True:
        opt.zero_grad()
        net(x).square().mean().backward()
        opt.step()


# ------------------------------------------------------------------------------------------ driver


def _run_worker(workload: str, policy: str, args) -> list[float]:
    cmd = [sys.executable, __file__, "--worker", workload, "--samples", str(args.samples),
           "--threads", str(args.threads), "--pretrain-steps", str(args.pretrain_steps)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=policy_env(policy, args.threads),
                       timeout=args.timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{workload} worker ({policy}) failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _start_competitor(policy: str, threads: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, __file__, "--worker", "competitor", "--threads", str(threads)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=policy_env(policy, threads))
    proc.stdout.readline()  # running
    time.sleep(1.0)
    return proc


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def measure(args) -> dict:
    rows = []
    for policy in args.policies:
        for workload in args.workloads:
            alone = _run_worker(workload, policy, args)
            comp = _start_competitor(args.competitor_policy or policy, args.competitor_threads)
            try:
                busy = _run_worker(workload, policy, args)
            finally:
                _stop(comp)
            base = statistics.median(alone)
            ratios = [b / base for b in busy]
            rows.append({"policy": policy, "workload": workload, "alone_s": alone, "contended_s": busy,
                         "slowdown_median": statistics.median(ratios), "slowdown_worst": max(ratios),
                         "competitor_policy": args.competitor_policy or policy})
            print(f"  {policy} {workload}: alone {base:.3f} s, slowdown {rows[-1]['slowdown_median']:.2f}× "
                  f"(worst {rows[-1]['slowdown_worst']:.2f}×)", file=sys.stderr, flush=True)
    return {"rows": rows, "threads": args.threads, "competitor_threads": args.competitor_threads,
            "cores_available": len(os.sched_getaffinity(0)), "samples": args.samples}


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma list: step, pretrain")
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help="comma list: legacy (before), passive (after)")
    ap.add_argument("--competitor-policy", default="", choices=["", *POLICIES],
                    help="the competitor's policy (default: the measured job's)")
    ap.add_argument("--samples", type=int, default=5, help="timed units per run")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the measured job")
    ap.add_argument("--competitor-threads", type=int, default=2)
    ap.add_argument("--pretrain-steps", type=int, default=20, help="pretraining optimizer steps per sample")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per worker run")
    ap.add_argument("--json", default="", help="also write the results here")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker == "competitor":
        worker_competitor(args.threads)
        return 0
    if args.worker:
        fn = {"step": lambda: worker_step(args.samples, args.threads),
              "pretrain": lambda: worker_pretrain(args.samples, args.threads, args.pretrain_steps),
              }[args.worker]
        print(json.dumps(fn()))
        return 0
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.policies = [p for p in args.policies.split(",") if p]
    for name, values, known in (("workload", args.workloads, WORKLOADS), ("policy", args.policies, POLICIES)):
        bad = [v for v in values if v not in known]
        if bad:
            print(f"contention: error: unknown {name} {bad[0]!r} (known: {', '.join(known)})",
                  file=sys.stderr)
            return 2
    before = _uptime()
    t0 = time.perf_counter()
    res = measure(args)
    res.update({"uptime_before": before, "uptime_after": _uptime(),
                "wall_s": round(time.perf_counter() - t0, 1)})
    print(f"contention: {args.threads}-thread job beside a {args.competitor_threads}-thread torch job, "
          f"{res['cores_available']} cores available")
    print(f"{'policy':<8} {'workload':<9} {'alone (median)':>15} {'contended':>10} {'slowdown':>9} "
          f"{'worst':>7}")
    for r in res["rows"]:
        print(f"{r['policy']:<8} {r['workload']:<9} {statistics.median(r['alone_s']):>13.3f} s "
              f"{statistics.median(r['contended_s']):>8.3f} s {r['slowdown_median']:>8.2f}× "
              f"{r['slowdown_worst']:>6.2f}×")
    print(f"load before: {before}\nload after:  {res['uptime_after']}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

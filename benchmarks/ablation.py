"""The paper's ablation on the toy world, budget-matched and powered: chunk (SDE dynamics plan) vs
step-level GRPO.

Same pretrained toy base model; step and chunk arms train the same expected transitions per sample on the
same rollouts, branching arms (TempFlow, Granular) stop at the same cumulative transformer samples;
pre-registered primary endpoint (held-out accuracy at the final point, chunk_dynamics − step_flow, paired
by seed), seeds from the power calculation (or `sequential=true`), Holm-corrected secondaries, learning
curves at `eval_points` points. Cached per (method, seed): re-running the same command resumes and only
computes what is missing or stale; the report is rewritten after every finished run.

    .venv/bin/python benchmarks/ablation.py --jobs 2                     # the pre-registered design (N = 10)
    .venv/bin/python benchmarks/ablation.py --jobs 2 sequential=true     # add seeds until the stop rule holds
    .venv/bin/python benchmarks/ablation.py --report-only --out DIR      # rebuild the report from the cache
    .venv/bin/python benchmarks/ablation.py --report-only --out DIR engine_pin=HASH   # ... of an older engine
    .venv/bin/python benchmarks/ablation.py --seeds 2 --steps 4 --out /tmp/abl eval_samples=2   # a quick look
    .venv/bin/python benchmarks/ablation.py --out DIR sampling.num_steps=17 timestep_fraction=0.5 \
        plan=sizes:2,3,4,7 uniform=uniform:4                           # the paper's N = 17 setting

Writes <out>/ablation.json, ablation.md, curves.png, reward_curves.png, profile.json/png, plan.json and
runs/<method>/seed-<s>.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main(argv: list[str] | None = None) -> int:
    from chunkgrpo.errors import UserError
    from chunkgrpo.toy.ablation import AblationConfig, run_ablation

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="toy model folder (default: build/reuse .chunkgrpo/models/toy)")
    ap.add_argument("--out", help="results folder (default benchmarks/results/ablation)")
    ap.add_argument("--seeds", type=int, help="seeds of the primary pair (default: the power calculation's)")
    ap.add_argument("--steps", type=int, help="optimizer steps per run (default 72)")
    ap.add_argument("--jobs", type=int, help="runs in parallel (default 1)")
    ap.add_argument("--methods", help="comma-separated subset of the methods")
    ap.add_argument("--report-only", action="store_true", help="rebuild the report from the cached runs only")
    ap.add_argument(
        "overrides", nargs="*", help="AblationConfig key=value; other keys are training overrides"
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    fields = set(AblationConfig.__dataclass_fields__)
    own = [o for o in args.overrides if o.split("=", 1)[0] in fields]
    train = [o for o in args.overrides if o.split("=", 1)[0] not in fields]
    for flag, key in (
        ("model", "model"),
        ("out", "out"),
        ("seeds", "seeds"),
        ("steps", "steps"),
        ("jobs", "jobs"),
    ):
        if getattr(args, flag) is not None:
            own.append(f"{key}={getattr(args, flag)}")
    if args.methods:
        own.append(f"methods=[{args.methods}]")
    if args.report_only:
        own.append("compute=false")
    try:
        cfg = AblationConfig.load(None, own)
        if train:
            cfg.overrides = [*cfg.overrides, *train]
        result = run_ablation(cfg)
    except UserError as e:
        print(f"ablation: error: {e}", file=sys.stderr)
        return 2
    md = (os.path.join(cfg.out, "ablation.md"))
    print(open(md).read())
    print(json.dumps({m: {"overall": e["overall"]["mean"], "ci95": e["overall"]["ci95"]}
                      for m, e in result["methods"].items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

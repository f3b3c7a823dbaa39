"""The paper's ablation on the toy world (step-level vs chunk-level GRPO, TempFlow, Granular), with error bars.

Same pretrained toy base model, equal optimizer steps and sampling budget, several seeds per method;
held-out GenEval accuracy per category by the exact toy detector, mean ± 95 % CI over seeds, wall time,
transformer sample-evaluations, paired chunk-vs-step differences. Cached per (method, seed): re-running
the same command resumes and only computes what is missing or stale (changed settings / engine source).

    .venv/bin/python benchmarks/ablation.py                               # the full run: 7 methods × 5 seeds
    .venv/bin/python benchmarks/ablation.py --jobs 2                      # two runs at a time (2 quiet cores)
    .venv/bin/python benchmarks/ablation.py --seeds 2 --steps 4 --out /tmp/abl   # a quick look
    .venv/bin/python benchmarks/ablation.py methods=[step_flow,chunk_dynamics] lr=0.002   # any AblationConfig field

Writes <out>/ablation.json, ablation.md, reward_curves.png, profile.json/png, plan.json and runs/<method>/seed-<s>.json.
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

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="toy model folder (default: build/reuse .chunkgrpo/models/toy)")
    ap.add_argument("--out", help="results folder (default benchmarks/results/ablation)")
    ap.add_argument("--seeds", type=int, help="seeds per method (default 5)")
    ap.add_argument("--steps", type=int, help="optimizer steps per run (default 72)")
    ap.add_argument("--jobs", type=int, help="runs in parallel (default 1)")
    ap.add_argument("--methods", help="comma-separated subset of the methods")
    ap.add_argument("overrides", nargs="*", help="AblationConfig key=value; other keys are training overrides")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    fields = set(AblationConfig.__dataclass_fields__)
    own = [o for o in args.overrides if o.split("=", 1)[0] in fields]
    train = [o for o in args.overrides if o.split("=", 1)[0] not in fields]
    for flag, key in (("model", "model"), ("out", "out"), ("seeds", "seeds"), ("steps", "steps"), ("jobs", "jobs")):
        if getattr(args, flag) is not None:
            own.append(f"{key}={getattr(args, flag)}")
    if args.methods:
        own.append(f"methods=[{args.methods}]")
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

"""The CPU a process spends importing what it needs, with CPython's collector thresholds and with
`chunkgrpo.startup.fewer_full_collections` (the policy of the CLI, every kfp task and torchrun rank).

    .venv/bin/python benchmarks/startup_gc.py [--repeats 5]

Each repetition starts a fresh Python per process kind and variant, in alternation: a training rank's
imports (torch, diffusers' FluxPipeline and FluxTransformer2DModel, transformers, peft, mlflow, the
trainer), an evaluation or profile task's (torch, diffusers, mlflow) and a registry task's (mlflow). The
probe reports the CPU seconds of its imports (`time.process_time`) and how many full collections ran.
Prints the median and range per kind and variant and the median saving. Run it on an otherwise idle
machine.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

KINDS = {
    "training rank": "import torch, diffusers, transformers, peft, mlflow\n"
                     "from diffusers import FluxPipeline, FluxTransformer2DModel\n"
                     "import chunkgrpo.train.trainer\n",
    "evaluate/profile task": "import torch, mlflow\nfrom diffusers import FluxPipeline\n",
    "registry task": "import mlflow\n",
}
PROBE = """import gc, json, time
from chunkgrpo import startup
startup.fewer_full_collections()
t = time.process_time()
{imports}
print(json.dumps({{"cpu_s": time.process_time() - t, "full": gc.get_stats()[2]["collections"]}}))
"""


def probe(imports: str, variant: str) -> dict:
    env = {**os.environ, "CHUNKGRPO_GC": "default" if variant == "default" else ""}
    r = subprocess.run([sys.executable, "-c", PROBE.format(imports=imports)], capture_output=True, text=True,
                       env=env, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print(f"{'process kind':<22} {'variant':<24} {'import CPU s, median [min, max]':>32} {'full GCs':>9}")
    for kind, imports in KINDS.items():
        runs: dict[str, list[dict]] = {"default": [], "fewer_full_collections": []}
        for _ in range(args.repeats):
            for variant in runs:
                runs[variant].append(probe(imports, variant))
        medians = {}
        for variant, rs in runs.items():
            cpu = [r["cpu_s"] for r in rs]
            medians[variant] = statistics.median(cpu)
            print(f"{kind:<22} {variant:<24} {medians[variant]:18.2f} [{min(cpu):.2f}, {max(cpu):.2f}]"
                  f" {statistics.median(r['full'] for r in rs):9.0f}")
        saved = medians["default"] - medians["fewer_full_collections"]
        print(f"{kind:<22} {'saved':<24} {saved:18.2f} ({saved / medians['default']:.0%})")


if __name__ == "__main__":
    main()

"""The main job's wall time, first and later run, with the per-stage breakdown `pipeline run --local`
prints: every task a fresh interpreter started by kfp.local (`fresh`, the default), and `kept`: every
run with `--keep-services`, so a later run finds the S3 and MLflow servers still running from the run
before; they are stopped (`chunkgrpo local down`) at the end.

    python benchmarks/main_job.py [--demo toy|tiny] [--modes fresh,kept] [--runs 2] [--out F.json]

For each mode: a fresh --home, then `--runs` runs of `chunkgrpo pipeline run --local` in it (the first
run starts from nothing but the shipped toy model; later runs find kfp.local's cache and the base-image
cache). The modes alternate per run index (fresh 1, kept 1, fresh 2, kept 2, ...), so a slow spell of a
shared machine falls on both. Prints each run's wall time (this script's clock, the whole command), the
load average before it, and its breakdown; `--out` writes them as JSON. Run it on an otherwise idle
machine.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = {"fresh": [], "kept": ["--keep-services"]}  # mode -> extra arguments of the command
_STAGE = re.compile(r"^\s{4,}(services|model|pipeline|total|task [\w-]+)\s+([\d.]+) s")
_ACCURACY = re.compile(r"(geneval\.overall\.(?:base|trained))=([\d.]+)")


def breakdown(output: str) -> dict:
    """{stage: seconds} and the held-out accuracies from the command's summary."""
    stages = {m.group(1): float(m.group(2)) for ln in output.splitlines() if (m := _STAGE.match(ln))}
    stages.update({m.group(1): float(m.group(2)) for m in _ACCURACY.finditer(output)})
    return stages


def run_once(home: Path, demo: str, mode: str, ports: tuple[int, int]) -> dict:
    cmd = [sys.executable, "-m", "chunkgrpo", "pipeline", "run", "--local", "--home", str(home),
           "--demo", demo, "--s3-port", str(ports[0]), "--mlflow-port", str(ports[1]), *MODES[mode]]
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{mode}: `{' '.join(cmd)}` exited {r.returncode}: {r.stderr.strip()[-500:]}")
    return {"wall_s": round(wall, 1), "load_1min": load, **breakdown(r.stdout)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--demo", default="toy", choices=["toy", "tiny"])
    ap.add_argument("--modes", default="fresh", help="comma-separated: " + ", ".join(MODES))
    ap.add_argument("--runs", type=int, default=2, help="runs per mode in the same home (default 2)")
    ap.add_argument("--out", default="", help="write the results as JSON here")
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        print(f"main_job: error: --modes {args.modes!r} must name some of {', '.join(MODES)}",
              file=sys.stderr)
        raise SystemExit(2)
    if args.runs < 1:
        print(f"main_job: error: --runs {args.runs} must be >= 1", file=sys.stderr)
        raise SystemExit(2)
    results: dict = {m: [] for m in modes}
    from chunkgrpo.processes import free_ports

    free = free_ports(2 * len(modes))  # each mode its own: a kept mode's servers stay up between its runs
    ports = {m: (free[2 * i], free[2 * i + 1]) for i, m in enumerate(modes)}
    with tempfile.TemporaryDirectory(prefix="main-job-") as tmp:
        try:
            for i in range(args.runs):
                for m in modes:
                    res = run_once(Path(tmp) / m, args.demo, m, ports[m])
                    results[m].append(res)
                    print(f"{m} run {i + 1}: {res['wall_s']:.1f} s  " + ", ".join(
                        f"{k} {v:g}" for k, v in res.items() if k != "wall_s"), flush=True)
        finally:
            for m in modes:
                if "--keep-services" in MODES[m] and (Path(tmp) / m / "local").exists():
                    subprocess.run([sys.executable, "-m", "chunkgrpo", "local", "down", "--home",
                                    str(Path(tmp) / m / "local")], check=False)
    columns = [(m, i) for m in modes for i in range(args.runs)]
    width = max(12, *(len(m) + 4 for m in modes))
    print(f"\n{'stage':<22}" + "".join(f"{m + ' ' + str(i + 1):>{width}}" for m, i in columns))
    keys = list(dict.fromkeys(k for m in modes for r in results[m] for k in r))
    for k in keys:
        print(f"{k:<22}" + "".join(f"{results[m][i].get(k, float('nan')):{width}.4g}" for m, i in columns))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"demo": args.demo, "runs": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()

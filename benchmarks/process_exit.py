"""How long a heavy process takes to exit after its work is done, with and without
`chunkgrpo.shutdown.fast_exit` (the handler the CLI and every kfp task install).

    .venv/bin/python benchmarks/process_exit.py [--repeats 3]

Each repetition starts a fresh Python that imports what a task or torchrun worker imports (torch,
diffusers' FluxTransformer2DModel, peft, mlflow, chunkgrpo), prints a line, and exits; the time from that
line to the process's end is its exit time. Prints the median and range per variant. Run it on an
otherwise idle machine.
"""

import argparse
import statistics
import subprocess
import sys
import time

IMPORTS = "import chunkgrpo, torch, peft, mlflow; from diffusers import FluxTransformer2DModel\n"
VARIANTS = {
    "default exit": IMPORTS,
    "shutdown.fast_exit()": IMPORTS + "from chunkgrpo import shutdown; shutdown.fast_exit()\n",
}


def exit_seconds(code: str) -> tuple[float, float]:
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-c", code + "print('done', flush=True)\n"], stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "done"
    t1 = time.perf_counter()
    if p.wait() != 0:
        raise SystemExit(f"the probe process failed (exit {p.returncode})")
    return t1 - t0, time.perf_counter() - t1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(f"{'variant':<22} {'start (s)':>10} {'exit (s), median [min, max]':>30}")
    for name, code in VARIANTS.items():
        runs = [exit_seconds(code) for _ in range(args.repeats)]
        starts, exits = [s for s, _ in runs], [e for _, e in runs]
        print(f"{name:<22} {statistics.median(starts):10.2f} {statistics.median(exits):12.2f} "
              f"[{min(exits):.2f}, {max(exits):.2f}]")


if __name__ == "__main__":
    main()

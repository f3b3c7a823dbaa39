"""Wall time and test count of the fast test tier (no servers, no torchrun, no kfp.local; tests/tiers.py).

    python benchmarks/fast_tier_time.py                 # the fast tier on 2 workers (target: <= 3 min)
    python benchmarks/fast_tier_time.py -n 0            # the same, serial
    python benchmarks/fast_tier_time.py tests/unit -x   # any further pytest arguments

Runs `pytest -q -n 2 -m "not integration and not reward_envs" --durations=30` once with a JUnit XML report
(through `run` of benchmarks/test_suite_time.py), then prints the wall time, the number of tests (passed,
failed, skipped), the CPU time of pytest and its workers, the load average before and after (a shared
machine makes the wall time mean little: compare CPU time) and the slowest files.
"""

from __future__ import annotations

import collections
import importlib.util
import sys
from pathlib import Path

FAST_TIER = "not integration and not reward_envs"
OPTIONS = ("-q", "-p", "no:cacheprovider", "-n", "2", "-m", FAST_TIER, "--durations=30")
TARGET_S = 180.0


def _suite_time():
    """benchmarks/test_suite_time.py (a script beside this one, not a package module)."""
    path = Path(__file__).resolve().with_name("test_suite_time.py")
    spec = importlib.util.spec_from_file_location("test_suite_time_benchmark", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


suite = _suite_time()


def summarize(xml: Path) -> tuple[collections.Counter, dict[str, float]]:
    """Outcome counts (passed, failure, error, skipped) and seconds per test file of a JUnit XML report."""
    cases = suite.summarize(xml)
    return collections.Counter(c[3] for c in cases), suite.per_file(cases)


def main(argv: list[str]) -> int:
    r = suite.run(OPTIONS, argv)
    outcomes = collections.Counter(c[3] for c in r.cases)
    counts = ", ".join(f"{v} {k}" for k, v in sorted(outcomes.items()))
    print(f"\n== fast tier: {r.wall:.0f} s wall ({r.wall / 60:.1f} min, target {TARGET_S / 60:.0f} min), "
          f"{len(r.cases)} tests ({counts}), pytest exit {r.rc}")
    print(f"   CPU time of pytest and its workers: {r.cpu:.0f} s "
          f"({r.cpu / max(r.wall, 1e-9):.2f} cores busy on average)")
    print(f"   load average before: {r.load_before}; after: {r.load_after}")
    print("== slowest files (setup + call + teardown of their tests)")
    suite.print_files(r.cases, 20)
    return r.rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

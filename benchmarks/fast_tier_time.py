"""Wall time and test count of the fast test tier (no servers, no torchrun, no kfp.local; tests/tiers.py).

    python benchmarks/fast_tier_time.py                 # the fast tier on 2 workers (target: <= 3 min)
    python benchmarks/fast_tier_time.py -n 0            # the same, serial
    python benchmarks/fast_tier_time.py tests/unit -x   # any further pytest arguments

Runs `pytest -q -n 2 -m "not integration and not reward_envs" --durations=30` once with a JUnit XML report,
then prints the wall time, the number of tests (passed, failed, skipped), the CPU time of pytest and its
workers, the load average before and after (a shared machine makes the wall time mean little: compare CPU
time) and the slowest files.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAST_TIER = "not integration and not reward_envs"
OPTIONS = ("-q", "-p", "no:cacheprovider", "-n", "2", "-m", FAST_TIER, "--durations=30")
TARGET_S = 180.0


def _load() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def summarize(xml: Path) -> tuple[collections.Counter, dict[str, float]]:
    """Outcome counts (passed, failure, error, skipped) and seconds per test file of a JUnit XML report."""
    outcomes: collections.Counter = collections.Counter()
    per_file: dict[str, float] = collections.defaultdict(float)
    for case in ET.parse(xml).getroot().iter("testcase"):
        kinds = {child.tag for child in case} & {"failure", "error", "skipped"}
        outcomes[next(iter(kinds)) if kinds else "passed"] += 1
        cls = case.get("classname", "")
        module, _, last = cls.rpartition(".")  # module.Class for a method
        per_file[module if last[:1].isupper() else cls] += float(case.get("time", 0))
    return outcomes, dict(per_file)


def main(argv: list[str]) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        before = _load()
        t0, cpu0 = time.perf_counter(), os.times()
        cmd = [sys.executable, "-m", "pytest", *OPTIONS, f"--junitxml={xml}",
               "-o", "junit_duration_report=total", *argv]
        rc = subprocess.run(cmd, cwd=ROOT).returncode
        wall = time.perf_counter() - t0
        cpu1 = os.times()
        cpu = (cpu1.children_user + cpu1.children_system) - (cpu0.children_user + cpu0.children_system)
        outcomes, per_file = summarize(xml) if xml.exists() else (collections.Counter(), {})
    n = sum(outcomes.values())
    counts = ", ".join(f"{v} {k}" for k, v in sorted(outcomes.items()))
    print(f"\n== fast tier: {wall:.0f} s wall ({wall / 60:.1f} min, target {TARGET_S / 60:.0f} min), "
          f"{n} tests ({counts}), pytest exit {rc}")
    print(f"   CPU time of pytest and its workers: {cpu:.0f} s "
          f"({cpu / max(wall, 1e-9):.2f} cores busy on average)")
    print(f"   load average before: {before}; after: {_load()}")
    print("== slowest files (setup + call + teardown of their tests)")
    for f, t in sorted(per_file.items(), key=lambda kv: -kv[1])[:20]:
        print(f"   {t:8.1f} s  {f}")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Wall time of the test suite: the pytest total, the 20 slowest tests and the time per test file.

    python benchmarks/test_suite_time.py                    # the whole suite, as .ci/run runs it (2 workers)
    python benchmarks/test_suite_time.py -n 0               # the same, serial (one process)
    python benchmarks/test_suite_time.py tests/unit -x       # any pytest arguments

Runs pytest once (with a JUnit XML report in a temporary folder), then prints the total wall time,
pytest's own total, the 20 slowest test phases (setup / call / teardown, as `--durations=20`; a
session fixture's setup is charged to the first test that uses it) and the slowest files. The load
average is printed before and after: the target (≤ 12 min on 2 idle cores) means something
only on an otherwise idle machine.
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
# README's test command (a later `-n 0` on the command line runs it serially)
README_OPTIONS = ("-q", "-rs", "--durations=20", "-n", "2", "--dist", "loadfile", "--no-loadscope-reorder")


def _uptime() -> str:
    return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str]) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        before = _uptime()
        t0, cpu0 = time.perf_counter(), os.times()
        cmd = [sys.executable, "-m", "pytest", *README_OPTIONS, f"--junitxml={xml}",
               "-o", "junit_duration_report=total", *argv]
        rc = subprocess.run(cmd, cwd=ROOT).returncode
        wall = time.perf_counter() - t0
        cpu1 = os.times()
        cpu = (cpu1.children_user + cpu1.children_system) - (cpu0.children_user + cpu0.children_system)
        cases = []
        if xml.exists():
            for case in ET.parse(xml).getroot().iter("testcase"):
                cases.append((float(case.get("time", 0)), case.get("classname", ""), case.get("name", "")))
    per_file: dict[str, float] = collections.defaultdict(float)
    for t, cls, _ in cases:
        # JUnit's classname is the module for a test function, module.Class for a method
        module, _, last = cls.rpartition(".")
        per_file[module if last[:1].isupper() else cls] += t
    print(f"\n== test suite: {wall / 60:.1f} min wall ({wall:.0f} s), {len(cases)} tests, pytest exit {rc}")
    print(f"   CPU time of pytest and the processes it waited for: {cpu / 60:.1f} min "
          f"({cpu / wall:.2f} cores busy on average)")
    print(f"   load before: {before}\n   load after:  {_uptime()}")
    print("== 20 slowest tests (setup + call + teardown)")
    for t, cls, name in sorted(cases, reverse=True)[:20]:
        print(f"   {t:8.1f} s  {cls}::{name}")
    busy = sum(t for t, _, _ in cases)
    print(f"   the tests' own time (setup + call + teardown, all workers): {busy / 60:.1f} min; on 2 workers "
          f"{busy / 120:.1f} min each if perfectly balanced")
    print("== slowest files (the first ones are tests/conftest.py LONG_FILES_FIRST's candidates)")
    for f, t in sorted(per_file.items(), key=lambda kv: -kv[1])[:30]:
        print(f"   {t:8.1f} s  {f}")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

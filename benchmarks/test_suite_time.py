"""Wall time of the test suite: the pytest total, the 20 slowest tests and the time per test file.

    python benchmarks/test_suite_time.py                    # the whole suite, as .ci/run runs it (2 workers)
    python benchmarks/test_suite_time.py -n 0               # the same, serial (one process)
    python benchmarks/test_suite_time.py tests/unit -x       # any pytest arguments

Runs pytest once (with a JUnit XML report in a temporary folder), then prints the total wall time,
pytest's own total, the 20 slowest test phases (setup / call / teardown, as `--durations=20`; a
session fixture's setup is charged to the first test that uses it) and the slowest files. The load
average is printed before and after: the times mean something only on an otherwise idle machine.
`benchmarks/fast_tier_time.py` runs the fast tier through `run` and `summarize` of this script.
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
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
# README's test command (a later `-n 0` on the command line runs it serially)
README_OPTIONS = ("-q", "-rs", "--durations=20", "-n", "2", "--dist", "loadfile", "--no-loadscope-reorder")


def load() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


class Run(NamedTuple):
    """One pytest run: exit status, wall and CPU seconds (pytest and the processes it waited for), the
    load average before and after, and (seconds, classname, name, outcome) of every test case."""

    rc: int
    wall: float
    cpu: float
    load_before: str
    load_after: str
    cases: list[tuple[float, str, str, str]]


def summarize(xml: Path) -> list[tuple[float, str, str, str]]:
    """(seconds, classname, name, outcome) of each test case of a JUnit XML report; outcome is passed,
    failure, error or skipped."""
    cases = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        kinds = {child.tag for child in case} & {"failure", "error", "skipped"}
        cases.append((float(case.get("time", 0)), case.get("classname", ""), case.get("name", ""),
                      next(iter(kinds)) if kinds else "passed"))
    return cases


def per_file(cases) -> dict[str, float]:
    """Seconds per test module (JUnit's classname is the module for a function, module.Class for a method)."""
    out: dict[str, float] = collections.defaultdict(float)
    for t, cls, *_ in cases:
        module, _, last = cls.rpartition(".")
        out[module if last[:1].isupper() else cls] += t
    return dict(out)


def run(options, argv) -> Run:
    """pytest with `options` then `argv`, with a JUnit XML report read back into `Run.cases`."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        before = load()
        t0, cpu0 = time.perf_counter(), os.times()
        cmd = [sys.executable, "-m", "pytest", *options, f"--junitxml={xml}",
               "-o", "junit_duration_report=total", *argv]
        rc = subprocess.run(cmd, cwd=ROOT).returncode
        wall = time.perf_counter() - t0
        cpu1 = os.times()
        cpu = (cpu1.children_user + cpu1.children_system) - (cpu0.children_user + cpu0.children_system)
        cases = summarize(xml) if xml.exists() else []
    return Run(rc, wall, cpu, before, load(), cases)


def print_files(cases, n: int) -> None:
    for f, t in sorted(per_file(cases).items(), key=lambda kv: -kv[1])[:n]:
        print(f"   {t:8.1f} s  {f}")


def main(argv: list[str]) -> int:
    r = run(README_OPTIONS, argv)
    print(f"\n== test suite: {r.wall / 60:.1f} min wall ({r.wall:.0f} s), {len(r.cases)} tests, "
          f"pytest exit {r.rc}")
    print(f"   CPU time of pytest and the processes it waited for: {r.cpu / 60:.1f} min "
          f"({r.cpu / r.wall:.2f} cores busy on average)")
    print(f"   load before: load average: {r.load_before}\n   load after:  load average: {r.load_after}")
    print("== 20 slowest tests (setup + call + teardown)")
    for t, cls, name, _ in sorted(r.cases, reverse=True)[:20]:
        print(f"   {t:8.1f} s  {cls}::{name}")
    busy = sum(c[0] for c in r.cases)
    print(f"   the tests' own time (setup + call + teardown, all workers): {busy / 60:.1f} min; on 2 workers "
          f"{busy / 120:.1f} min each if perfectly balanced")
    print("== slowest files (the first ones are tests/conftest.py LONG_FILES_FIRST's candidates)")
    print_files(r.cases, 30)
    return r.rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Where the test suite's CPU goes: by kind of process and by test, and which tests mostly wait.

    python benchmarks/suite_cpu.py                   # the whole suite, as .ci/run runs it (2 workers)
    python benchmarks/suite_cpu.py tests/integration # any pytest arguments
    python benchmarks/suite_cpu.py --json cpu.json   # also every test's wall, CPU and CPU by kind

Runs README's pytest command once. Meanwhile a thread of this script reads every process's CPU time from
/proc once a second, and a pytest plugin of this file (`-p benchmarks.suite_cpu`) records when each test
started and ended on which xdist worker. A process belongs to the worker among its ancestors (servers,
torchrun ranks, kfp.local tasks, scorer workers, forked ranks); each second's CPU is charged to the test
that worker was running then. Prints the CPU by kind of process, the tests that used the most, and the
tests whose wall time is mostly waiting (wall − CPU: outages, timeouts, servers starting), whose idle
core the other worker can fill only with its own work. Processes shorter than the sampling interval are
missed, so the attributed total is a little below the CPU that `benchmarks/test_suite_time.py` reports.
Linux only."""

from __future__ import annotations

import bisect
import collections
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.test_suite_time import README_OPTIONS, run  # noqa: E402

LOG_ENV = "CHUNKGRPO_SUITE_CPU_LOG"
KINDS = (  # (substring of the command line, kind), first match wins
    ("uvicorn", "MLflow server (uvicorn worker)"), ("mlflow server", "MLflow server (CLI)"),
    ("/weed", "SeaweedFS"), ("exec(eval(sys.stdin", "xdist worker (in-process tests)"),
    ("executor_main", "kfp.local task"), ("multiprocessing.spawn", "spawned rank"),
    ("multiprocessing.forkserver", "forked rank / forkserver"), ("torch.distributed.run", "torchrun agent"),
    ("torchrun", "torchrun agent"), ("chunkgrpo.train", "training rank"),
    ("chunkgrpo train", "training rank"), ("train/__main__", "training rank"),
    ("scoring.worker", "scorer worker"), ("reward-envs", "reward venv"),
    ("image-envs", "image environment"), ("chunkgrpo", "chunkgrpo CLI / module"),
)


# ---- the pytest plugin (loaded in the workers with -p benchmarks.suite_cpu) ----------------------------

def _log(kind: str, nodeid: str) -> None:
    path = os.environ.get(LOG_ENV)
    if path:
        with open(path, "a") as f:
            f.write(f"{kind} {os.getpid()} {time.time():.2f} {nodeid}\n")


def pytest_runtest_logstart(nodeid, location):
    _log("S", nodeid)


def pytest_runtest_logfinish(nodeid, location):
    _log("E", nodeid)


# ---- sampling and attribution ----------------------------------------------------------------------------

def kind(cmd: str) -> str:
    return next((k for needle, k in KINDS if needle in cmd), "other: " + " ".join(cmd.split()[:2])[:60])


def sample(procs: dict, tick: float = os.sysconf("SC_CLK_TCK")) -> None:
    """Add one reading of every process to `procs`: key pid:start -> {cmd, ppid, s: [[time, cpu s], ...]}."""
    now = time.time()
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/stat") as f:
                stat = f.read()
            rest = stat[stat.rindex(")") + 2:].split()
            cpu, key = (int(rest[11]) + int(rest[12])) / tick, f"{p}:{rest[19]}"
            d = procs.get(key)
            if d is None:
                with open(f"/proc/{p}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
                procs[key] = {"cmd": cmd, "ppid": int(rest[1]), "s": [[now, cpu]]}
            elif d["s"][-1][1] != cpu:
                d["s"].append([now, cpu])
        except (OSError, ValueError, IndexError):
            pass


def attribute(procs: dict, log_lines: list[str], root_pid: int):
    """(CPU by kind, CPU by test, CPU by test and kind) of the processes under `root_pid` (all started
    after it: a process's CPU before its first reading counts at that reading). `log_lines` are the
    plugin's "S|E pid time nodeid" lines; CPU of a worker between its tests is charged to
    '(between tests)'."""
    parent = {int(k.split(":")[0]): d["ppid"] for k, d in procs.items()}
    workers, opened, windows = set(), {}, collections.defaultdict(list)
    for line in log_lines:
        k, pid, t, nodeid = line.split(" ", 3)
        pid, t = int(pid), float(t)
        workers.add(pid)
        if k == "S":
            opened[pid] = (t, nodeid.strip())
        elif pid in opened:
            start, node = opened.pop(pid)
            windows[pid].append((start, t, node))

    def ancestors(pid):
        for _ in range(64):
            if not pid:
                return
            yield pid
            pid = parent.get(pid)

    by_test_kind: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for key, d in procs.items():
        chain = list(ancestors(int(key.split(":")[0])))
        if root_pid not in chain:
            continue
        worker = next((p for p in chain if p in workers), None)
        k, last = kind(d["cmd"]), 0.0
        for t, cpu in d["s"]:
            delta, last = cpu - last, cpu
            if delta <= 0:
                continue
            test = "(pytest controller)"
            if worker is not None:
                ws = windows[worker]
                i = bisect.bisect_right(ws, (t, float("inf"), "")) - 1
                test = ws[i][2] if i >= 0 and ws[i][0] <= t <= ws[i][1] + 1.5 else "(between tests)"
            by_test_kind[test][k] += delta
    by_kind = sum(by_test_kind.values(), collections.Counter())
    by_test = collections.Counter({test: sum(c.values()) for test, c in by_test_kind.items()})
    return by_kind, by_test, by_test_kind


def nodeid(classname: str, name: str) -> str:
    """pytest's node id of a JUnit test case (classname module.path or module.path.Class)."""
    module, _, last = classname.rpartition(".")
    if last[:1].isupper():
        return f"{module.replace('.', '/')}.py::{last}::{name}"
    return f"{classname.replace('.', '/')}.py::{name}"


def main(argv: list[str]) -> int:
    out = None
    if argv[:1] == ["--json"]:
        out, argv = Path(argv[1]), argv[2:]
    procs: dict = {}
    stop = threading.Event()

    def sampler():
        while not stop.wait(1.0):
            sample(procs)

    thread = threading.Thread(target=sampler, daemon=True)
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "tests.log"
        # pytest, its workers and everything they start inherit these (the plugin is found on ROOT)
        os.environ[LOG_ENV] = str(log)
        os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
        thread.start()
        r = run(("-p", "benchmarks.suite_cpu", *README_OPTIONS), argv)
        stop.set()
        thread.join()
        lines = log.read_text().splitlines() if log.exists() else []
    me = os.getpid()  # the root of pytest's tree; its own CPU (the sampling) is left out
    by_kind, by_test, by_test_kind = attribute(
        {k: d for k, d in procs.items() if int(k.split(":")[0]) != me}, lines, me)
    total = sum(by_kind.values())
    print(f"\n== {r.wall / 60:.1f} min wall, pytest exit {r.rc}; load before {r.load_before}, "
          f"after {r.load_after}")
    print(f"== CPU of pytest and every process under it: {total:.0f} s attributed "
          f"({total / r.wall:.2f} cores busy); {r.cpu:.0f} s counted by the OS for what pytest waited for")
    for k, v in by_kind.most_common():
        print(f"   {v:8.1f} s  {k}")
    print("== the 30 tests that used the most CPU (with their processes' kinds)")
    for test, v in by_test.most_common(30):
        top = ", ".join(f"{k} {c:.0f}" for k, c in by_test_kind[test].most_common(3))
        print(f"   {v:8.1f} s  {test}  [{top}]")
    walls = {nodeid(cls, name): t for t, cls, name, _ in r.cases}
    waiting = sorted(((w - by_test.get(t, 0.0), w, t) for t, w in walls.items()), reverse=True)[:20]
    print("== the 20 tests that wait the most (wall − CPU of the test and its processes)")
    for idle, w, t in waiting:
        print(f"   {idle:8.1f} s of {w:6.1f} s  {t}")
    print(json.dumps({"wall_s": round(r.wall, 1), "cpu_s": round(total, 1), "rc": r.rc}))
    if out is not None:
        tests = {t: {"wall_s": round(walls.get(t, 0.0), 2), "cpu_s": round(by_test.get(t, 0.0), 2),
                     "by_kind": {k: round(c, 2) for k, c in by_test_kind[t].most_common()}}
                 for t in sorted(set(walls) | set(by_test))}
        out.write_text(json.dumps({"wall_s": round(r.wall, 1), "cpu_s": round(total, 1),
                                   "by_kind": {k: round(v, 1) for k, v in by_kind.most_common()},
                                   "tests": tests}, indent=1) + "\n")
    return r.rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

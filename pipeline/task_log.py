"""The console and log of a local run, and a failed task's reason read from its log.

Every line the tasks and kfp print goes to `<home>/logs/<pipeline>-<time>.log`; the console shows one
line per task (`--verbose` streams everything). A failed task raises `TaskFailed`: the task's name and
the reason read from its log (the component's `UserError` message, or the message of the exception that
ended it), whether it was a user error, and the log's path.
"""

import contextlib
import io
import re
import time
from pathlib import Path


def rel(p: str) -> str:
    """`p` relative to the working directory when it lies below it (shorter console lines)."""
    try:
        return str(Path(p).resolve().relative_to(Path.cwd()))
    except ValueError:
        return p


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_TASK_START = re.compile(r"Executing task '([^']+)'")
_TASK_CACHED = re.compile(r"Task (\S+) cache hit \(key=([0-9a-f]+)\)")  # kfp.local's line for a cache hit
_TASK_END = re.compile(r"Task '([^']+)' finished with status (\w+)")
# a `chunkgrpo <command>: error: ...` line (the CLI inside the task, e.g. torchrun rank 0), or the last
# line of a traceback that ended in a UserError
_USER_ERROR = (re.compile(r"\bchunkgrpo [\w.-]+: error: (.+)$"),
               re.compile(r"(?:^|\s)(?:chunkgrpo\.errors\.)?UserError: (.+)$"))
_EXCEPTION = re.compile(
    r"^\s*((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt|Failure)(?::.*)?)$"
)


class TaskFailed(Exception):
    """A pipeline task failed: `task`, the one-line `reason` read from its log, whether the reason is a
    user error (bad parameter or input: exit 2) or an internal failure (exit 1), and the full log."""

    def __init__(self, pipeline: str, task: str, reason: str, user_error: bool, log_path: Path):
        self.pipeline, self.task, self.reason, self.user_error, self.log_path = (
            pipeline,
            task,
            reason,
            user_error,
            log_path,
        )
        super().__init__(f"task '{task}' of {pipeline} failed: {reason} (full log: {rel(str(log_path))})")


def task_failure(log_text: str, pipeline: str, log_path: Path, message: str = "") -> TaskFailed:
    """The failed task and its reason, from the run's log (`message`: kfp's exception text, a fallback)."""
    lines = [_ANSI.sub("", ln).rstrip() for ln in log_text.splitlines()]
    failed = [
        (i, m.group(1))
        for i, ln in enumerate(lines)
        if (m := _TASK_END.search(ln)) and m.group(2) == "FAILURE"
    ]
    if failed:
        end, task = failed[0]  # the first failure; later ones (an exit handler) are consequences
    else:
        names = re.findall(r"'([^']+)'", _ANSI.sub("", message))
        end, task = len(lines), names[0] if names else "?"
    start = max(
        (i for i, ln in enumerate(lines[:end]) if (m := _TASK_START.search(ln)) and m.group(1) == task),
        default=0,
    )
    section = lines[start:end]
    for pattern in _USER_ERROR:
        for ln in section:
            if m := pattern.search(ln):
                return TaskFailed(pipeline, task, m.group(1).strip(), True, log_path)
    last = ""
    in_traceback = False
    for ln in section:
        if ln.strip().startswith("Traceback (most recent call last)"):
            in_traceback = True
        elif in_traceback and (m := _EXCEPTION.match(ln)):
            last, in_traceback = m.group(1).strip(), False
    reason = last or (f"{_ANSI.sub('', message).strip()}" if message else "failed without an error message")
    return TaskFailed(pipeline, task, reason, False, log_path)


class ConsoleLog(io.TextIOBase):
    """stdout/stderr of a local run: everything into the log file; on the console one line per task
    (or everything with `verbose`)."""

    def __init__(self, log, console, verbose: bool = False):
        self._log, self._console, self._verbose = log, console, verbose
        self._buf = ""
        self._started: dict[str, float] = {}
        self.took: dict[str, float] = {}  # task -> seconds, in finishing order
        self.cached: dict[str, str] = {}  # task -> the start of its cache key (kfp.local skipped it)

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        self._log.write(s)
        if self._verbose:
            self._console.write(s)
        self._buf += s
        while "\n" in self._buf:
            line, self._buf = self._buf.split("\n", 1)
            self._progress(_ANSI.sub("", line))
        return len(s)

    def flush(self) -> None:
        self._log.flush()
        self._console.flush()

    def _progress(self, line: str) -> None:
        if m := _TASK_START.search(line):
            self._started[m.group(1)] = time.perf_counter()
        elif m := _TASK_END.search(line):
            self.took[m.group(1)] = time.perf_counter() - self._started.get(m.group(1), time.perf_counter())
        elif m := _TASK_CACHED.search(line):
            self.cached[m.group(1)], self.took[m.group(1)] = m.group(2), 0.0
        if self._verbose:
            return
        if m := _TASK_START.search(line):
            self._console.write(f"  {m.group(1)} ...\n")
        elif m := _TASK_CACHED.search(line):
            self._console.write(f"  {m.group(1)}: cached (an earlier run's outputs, same inputs)\n")
        elif m := _TASK_END.search(line):
            took = self.took[m.group(1)]
            word = "done" if m.group(2) == "SUCCESS" else m.group(2).lower()
            self._console.write(f"  {m.group(1)}: {word} ({took:.0f} s)\n")
        else:
            return
        self._console.flush()


@contextlib.contextmanager
def cache_hits(out):
    """Pass kfp.local's cache-hit lines to `out`. kfp logs them at INFO on the root logger before it
    sets up its own log handler for the task, so with the root logger's default level they are dropped;
    meanwhile the root logger takes INFO and a handler forwards those lines only (the handlers already
    there keep the root's former level)."""
    import logging

    class Hits(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            msg = record.getMessage()
            if _TASK_CACHED.search(msg):
                out.write(msg + "\n")

    root, handler = logging.getLogger(), Hits(logging.INFO)
    level = root.level
    others = [(h, h.level) for h in root.handlers]
    for h, lv in others:
        h.setLevel(max(lv, level))
    root.addHandler(handler)
    root.setLevel(min(level, logging.INFO) if level else logging.INFO)
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        for h, lv in others:
            h.setLevel(lv)

"""Run a `torchrun` command from a pipeline task and turn a rank's user error into the task's error.

torchrun reports a failed worker with its own traceback (`ChildFailedError`) and exit status 1, which
hides the reason. `run_torchrun` streams the workers' output unchanged (the task log keeps every
line) and, if the job fails, raises `UserError` with the message that `chunkgrpo train/evaluate` printed
on a rank (`chunkgrpo <command>: error: ...`), so the pipeline reports the bad value in one line.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from collections.abc import Sequence

from chunkgrpo.errors import UserError

_RANK_ERROR = re.compile(r"\bchunkgrpo [\w.-]+: error: (.+)$")


def run_torchrun(cmd: Sequence[str], env: dict | None = None, out=None) -> None:
    """Run `cmd`, copy its output (stdout + stderr) to `out` (default sys.stdout) line by line, and on a
    non-zero exit raise UserError(first rank error message) or RuntimeError(exit status).

    `python -m chunkgrpo.torchrun_local ...` with forked workers on (`torchrun_local.fork_workers`) in a
    process with no other thread is run in a child forked from this one (`_fork_launcher`) rather than a
    fresh interpreter: a pipeline task forked from a warm server has torch, diffusers and the trainer's
    modules loaded already, so the launcher starts at once and forks ranks that need no imports."""
    out = out or sys.stdout
    reason = None
    launcher = _fork_launcher(list(cmd), env)
    if launcher is not None:
        pid, lines = launcher
    else:
        proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                bufsize=1, env=env)
        pid, lines = proc.pid, proc.stdout
    try:
        for line in lines:
            out.write(line)
            out.flush()
            if reason is None and (m := _RANK_ERROR.search(line.rstrip("\n"))):
                reason = m.group(1).strip()
    finally:
        lines.close()
        if launcher is None:
            rc = proc.wait()
        else:
            rc = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if rc != 0:
        if reason is not None:
            raise UserError(reason)
        raise RuntimeError(f"torchrun exited with status {rc} (see the rank logs above)")


def _fork_launcher(cmd: list[str], env: dict | None):
    """(pid, its output lines) of `cmd` run by a child forked from this process, or None when it must be a
    fresh process: not our torchrun launcher, forked workers off, or another thread in this process (a
    fork copies only the calling thread, and a lock another thread held would stay locked in the child)."""
    from chunkgrpo import torchrun_local

    if cmd[:3] != [sys.executable, "-m", "chunkgrpo.torchrun_local"] or threading.active_count() != 1:
        return None
    environ = dict(os.environ if env is None else env)
    if not torchrun_local.fork_workers(environ):
        return None
    r, w = os.pipe()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()  # nothing buffered here is written twice
    pid = os.fork()
    if pid == 0:  # the launcher: `python -m chunkgrpo.torchrun_local ARGS` in this process's image
        code = 1
        try:
            import atexit

            from chunkgrpo.local_processes import child_stdio, run_as_main

            os.close(r)
            child_stdio(w)
            # the standard streams of a fresh interpreter on fds 1 and 2 (this process may have replaced
            # sys.stdout by an object of its own, such as a log capture, that the pipe would never see)
            sys.stdout = sys.__stdout__ = open(1, "w", encoding="utf-8", errors="backslashreplace",
                                               closefd=False)
            sys.stderr = sys.__stderr__ = open(2, "w", encoding="utf-8", errors="backslashreplace",
                                               closefd=False)
            os.environ.clear()
            os.environ.update(environ)
            atexit._clear()  # this process's handlers are not the launcher's
            sys.argv = [torchrun_local.__file__, *cmd[3:]]
            code = run_as_main(lambda: torchrun_local.main(cmd[3:]))
        except BaseException:  # the set-up above failed: say why, exit 1
            import traceback

            traceback.print_exc()
            sys.stderr.flush()
        finally:
            os._exit(code)
    os.close(w)
    return pid, open(r, encoding="utf-8", errors="replace", buffering=1)

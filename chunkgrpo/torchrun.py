"""Run a `torchrun` command from a pipeline task and turn a rank's user error into the task's error.

torchrun reports a failed worker with its own traceback (`ChildFailedError`) and exit status 1, which
hides the reason. `run_torchrun` streams the workers' output unchanged (the task log keeps every
line) and, if the job fails, raises `UserError` with the message that `chunkgrpo train/evaluate` printed
on a rank (`chunkgrpo <command>: error: ...`), so the pipeline reports the bad value in one line.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Sequence

from chunkgrpo.errors import UserError

_RANK_ERROR = re.compile(r"\bchunkgrpo [\w.-]+: error: (.+)$")


def run_torchrun(cmd: Sequence[str], env: dict | None = None, out=None) -> None:
    """Run `cmd`, copy its output (stdout + stderr) to `out` (default sys.stdout) line by line, and on a
    non-zero exit raise UserError(first rank error message) or RuntimeError(exit status)."""
    out = out or sys.stdout
    reason = None
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1, env=env)
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            out.write(line)
            out.flush()
            if reason is None and (m := _RANK_ERROR.search(line.rstrip("\n"))):
                reason = m.group(1).strip()
    finally:
        proc.stdout.close()
        rc = proc.wait()
    if rc != 0:
        if reason is not None:
            raise UserError(reason)
        raise RuntimeError(f"torchrun exited with status {rc} (see the rank logs above)")

"""User-facing errors: the CLI prints these as one line (no traceback) and exits 2."""

from __future__ import annotations

import os
import sys
import time

# Under torchrun, a non-zero local rank waits this long before printing its user error: when rank 0 hit
# the same bad input (the usual case: every rank reads the same config), torchrun has stopped this
# process by then (it polls its workers every 0.1 s), so the reason is printed once.
OTHER_RANK_REPORT_DELAY_S = 3.0


class UserError(ValueError):
    """Bad input that the user can fix (a path, a value, a combination of settings)."""


class Terminated(BaseException):
    """The process was asked to stop (SIGTERM, e.g. a pod eviction). A BaseException, like
    KeyboardInterrupt, so that no `except Exception` on the way swallows it."""

    def __init__(self, signum: int = 15):
        super().__init__(f"terminated by signal {signum}")
        self.signum = signum


def print_user_error(line: str, stream=None) -> None:
    """Print a one-line user error, once per torchrun job rather than once per rank.

    Outside torchrun (no `LOCAL_RANK`), or on local rank 0, the line is printed at once. Another rank
    first waits `OTHER_RANK_REPORT_DELAY_S`: if rank 0 failed the same way, torchrun ends this process
    in the meantime and nothing is repeated; if only this rank failed (say a file missing on its node),
    it still prints, tagged with its rank."""
    stream = stream or sys.stderr
    local_rank = os.environ.get("LOCAL_RANK", "")
    if local_rank not in ("", "0") and int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        time.sleep(OTHER_RANK_REPORT_DELAY_S)
        line = f"{line} [rank {os.environ.get('RANK', local_rank)}]"
    print(line, file=stream, flush=True)

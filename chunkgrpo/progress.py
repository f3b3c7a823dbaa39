"""Progress bars that read well in a terminal and in a log file: the one helper every bar uses.

    from chunkgrpo.progress import progress_bar
    bar = progress_bar(total=100, desc="train chunk", unit="rollout", disable=not show)
    for ...: bar.update(1); bar.set_postfix(reward=...)
    bar.close()

On a terminal (the bar's stream is a TTY) this is a live `tqdm` bar. Anywhere else (a pipeline task's
log, a file, a pipe) a carriage-return bar would write one update per iteration into the log, so the
same object prints a plain line (`train chunk: 30/100 (30%) [01:02<02:25, 2.07s/rollout, reward=0.41]`)
only every `every_s` seconds or every `every_pct` percent, whichever comes first, and once at the end.

`$CHUNKGRPO_PROGRESS` overrides the choice: `bar`, `lines`, `off` (default `auto`);
`$CHUNKGRPO_PROGRESS_EVERY_S` the line interval (default 30 s).
"""

from __future__ import annotations

import os
import sys
import time

from tqdm import tqdm

MODES = ("auto", "bar", "lines", "off")
EVERY_S = 30.0
EVERY_PCT = 10.0
_LINE_FORMAT = "{desc}: {n_fmt}/{total_fmt} ({percentage:.0f}%) [{elapsed}<{remaining}, {rate_fmt}{postfix}]"
_LINE_FORMAT_NO_TOTAL = "{desc}: {n_fmt} [{elapsed}, {rate_fmt}{postfix}]"


def mode(stream=None) -> str:
    """`bar` or `lines` (or `off`) for `stream` (default sys.stderr), per $CHUNKGRPO_PROGRESS."""
    want = os.environ.get("CHUNKGRPO_PROGRESS", "auto").strip().lower() or "auto"
    if want not in MODES:
        raise ValueError(f"CHUNKGRPO_PROGRESS={want!r} must be one of {', '.join(MODES)}")
    if want != "auto":
        return want
    stream = stream if stream is not None else sys.stderr
    try:
        return "bar" if stream.isatty() else "lines"
    except (AttributeError, ValueError):  # a closed or minimal stream
        return "lines"


def quiet_mlflow_progress(stream=None) -> bool:
    """MLflow's own artifact-download bar off unless `stream` gets bars (`mode`): in a log it writes one
    carriage-return update per file. Sets MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR=false (an explicit value
    in the environment wins); returns whether the bar is off."""
    if mode(stream) != "bar":
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    return os.environ.get("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "true").lower() in ("false", "0")


class LineProgress(tqdm):
    """tqdm's counting, rate and ETA, printed as whole lines every `every_s` s or `every_pct` % (and at
    the end) instead of a carriage-return bar."""

    def __init__(self, *args, every_s: float | None = None, every_pct: float = EVERY_PCT, **kwargs):
        if every_s is None:
            every_s = float(os.environ.get("CHUNKGRPO_PROGRESS_EVERY_S", EVERY_S))
        self._every_s, self._every_pct = every_s, every_pct
        self._last_t: float | None = None
        self._last_n: float | None = None
        self._last_postfix: str | None = None
        self._last_step = -1
        self._closing = False
        total = kwargs.get("total")
        if total is None and args and hasattr(args[0], "__len__"):
            total = len(args[0])
        kwargs.setdefault("bar_format", _LINE_FORMAT if total else _LINE_FORMAT_NO_TOTAL)
        # tqdm asks to display on every update; `display` decides whether a line is due
        super().__init__(*args, mininterval=0, miniters=1, leave=False, dynamic_ncols=False, **kwargs)

    def _step(self) -> int:
        return int(100 * self.n / self.total // self._every_pct) if self.total else -1

    def display(self, msg=None, pos=None):
        if self._closing or self.disable:
            return False
        now = time.monotonic()
        due = (self._last_t is None or now - self._last_t >= self._every_s or self._step() > self._last_step)
        if due and self.n != self._last_n:
            self._emit(now)
        return True

    def _emit(self, now: float | None = None) -> None:
        self.fp.write(str(self).strip() + "\n")
        self.fp.flush()
        self._last_t = now if now is not None else time.monotonic()
        self._last_n, self._last_step, self._last_postfix = self.n, self._step(), self.postfix

    def close(self):
        if not self.disable and not self._closing:
            if self.n != self._last_n or self.postfix != self._last_postfix:  # the end, with the last postfix
                self._emit()
            self._closing = True
        super().close()


def progress_bar(iterable=None, *, disable: bool = False, file=None, every_s: float | None = None,
             every_pct: float = EVERY_PCT, **kwargs) -> tqdm:
    """A progress bar for `iterable` / `total=` (tqdm's arguments): live on a TTY, plain lines otherwise."""
    how = mode(file)
    if how == "off":
        disable = True
    if how == "bar" or disable:
        return tqdm(iterable, disable=disable, file=file, **kwargs)
    return LineProgress(iterable, file=file if file is not None else sys.stderr, every_s=every_s,
                        every_pct=every_pct, **kwargs)

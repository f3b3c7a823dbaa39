"""Progress output (chunkgrpo.progress): a live bar on a terminal, a plain line every N seconds or percent
in a log."""

from __future__ import annotations

import io
import os

import pytest
from tqdm import tqdm

from chunkgrpo import progress as P


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_a_bounded_number_of_plain_lines(monkeypatch):
    monkeypatch.delenv("CHUNKGRPO_PROGRESS", raising=False)
    log = io.StringIO()
    bar = P.progress_bar(total=1000, desc="train chunk", unit="rollout", file=log, every_s=3600)
    for i in range(1000):
        bar.update(1)
        bar.set_postfix(reward=f"{i:.1f}")
    bar.close()
    text = log.getvalue()
    assert "\r" not in text and "\x1b" not in text
    lines = text.splitlines()
    assert 10 <= len(lines) <= 12, lines  # every 10 % (+ the start), not 1000 updates
    assert lines[-1].startswith("train chunk: 1000/1000 (100%)") and "reward=999.0" in lines[-1]


def test_a_log_line_every_n_seconds(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(P.time, "monotonic", lambda: clock[0])
    log = io.StringIO()
    bar = P.progress_bar(total=10_000, desc="x", file=log, every_s=30, every_pct=100)
    for _ in range(100):  # 100 updates 10 s apart: a line each 30 s (+ the start and the end)
        clock[0] += 10
        bar.update(1)
    bar.close()
    n = len(log.getvalue().splitlines())
    assert 33 <= n <= 36, log.getvalue()


def test_a_terminal_gets_a_live_tqdm_bar(monkeypatch):
    monkeypatch.delenv("CHUNKGRPO_PROGRESS", raising=False)
    tty = _Tty()
    bar = P.progress_bar(total=5, desc="y", file=tty)
    assert isinstance(bar, tqdm) and not isinstance(bar, P.LineProgress)
    bar.update(5)
    bar.close()
    assert "\r" in tty.getvalue()


def test_the_environment_overrides_and_disable(monkeypatch):
    monkeypatch.setenv("CHUNKGRPO_PROGRESS", "lines")
    assert isinstance(P.progress_bar(total=1, file=_Tty()), P.LineProgress)
    monkeypatch.setenv("CHUNKGRPO_PROGRESS", "off")
    log = io.StringIO()
    bar = P.progress_bar(total=3, file=log)
    bar.update(3)
    bar.close()
    assert log.getvalue() == ""
    monkeypatch.setenv("CHUNKGRPO_PROGRESS", "fancy")
    with pytest.raises(ValueError, match="CHUNKGRPO_PROGRESS='fancy'"):
        P.progress_bar(total=1)


def test_iterating_a_sequence(monkeypatch):
    monkeypatch.delenv("CHUNKGRPO_PROGRESS", raising=False)
    log = io.StringIO()
    assert list(P.progress_bar(range(20), desc="z", file=log)) == list(range(20))
    assert log.getvalue().splitlines()[-1].startswith("z: 20/20 (100%)")


def test_mlflow_download_bar_off_in_a_log_on_in_a_terminal(monkeypatch):
    from chunkgrpo.progress import quiet_mlflow_progress

    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.delenv("CHUNKGRPO_PROGRESS", raising=False)
    monkeypatch.delenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", raising=False)
    assert quiet_mlflow_progress(Tty()) is False
    assert "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR" not in os.environ
    assert quiet_mlflow_progress(io.StringIO()) is True
    assert os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] == "false"
    monkeypatch.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "true")  # the user's choice wins
    assert quiet_mlflow_progress(io.StringIO()) is False

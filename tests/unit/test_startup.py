"""The collector's start policy (chunkgrpo.startup): full collections rarer in the processes the entry
points start, CPython's thresholds on request or when only the library is imported, one line for a bad
setting."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest

from chunkgrpo import startup
from tests.repo_copy import ROOT


@pytest.fixture
def thresholds():
    before = gc.get_threshold()
    yield
    gc.set_threshold(*before)


def test_the_policy_raises_only_the_full_collection_threshold(thresholds, monkeypatch):
    monkeypatch.delenv(startup.ENV, raising=False)
    gc.set_threshold(700, 10, 10)
    assert startup.fewer_full_collections() is True
    assert gc.get_threshold() == (700, 10, startup.FULL_AFTER)
    assert startup.fewer_full_collections() is True and gc.get_threshold() == (700, 10, startup.FULL_AFTER)


def test_default_keeps_cpythons_thresholds_and_a_bad_value_is_one_line(thresholds, monkeypatch):
    gc.set_threshold(700, 10, 10)
    monkeypatch.setenv(startup.ENV, "default")
    assert startup.fewer_full_collections() is False and gc.get_threshold() == (700, 10, 10)
    monkeypatch.setenv(startup.ENV, "off")
    with pytest.raises(ValueError, match=r"^CHUNKGRPO_GC='off': leave it unset, or 'default'"):
        startup.fewer_full_collections()
    assert gc.get_threshold() == (700, 10, 10)


def _py(code: str, **env) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != startup.ENV}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**base, "PYTHONPATH": str(ROOT), **env})


PROBE = """
import gc
from chunkgrpo import cli
print("import", gc.get_threshold()[2])
cli.build_parser = lambda: (_ for _ in ()).throw(SystemExit(f"main {gc.get_threshold()[2]}"))
cli.main(["capacity"])
"""


def test_the_cli_applies_it_first_and_importing_the_library_does_not():
    r = _py(PROBE)
    assert r.stdout.split() == ["import", "10"] and r.stderr.strip() == f"main {startup.FULL_AFTER}", r
    r = _py(PROBE, CHUNKGRPO_GC="default")
    assert r.stderr.strip() == "main 10", r


def test_a_bad_setting_stops_the_cli_in_one_line_with_exit_2():
    r = subprocess.run([sys.executable, "-m", "chunkgrpo", "capacity", "--help"], capture_output=True,
                       text=True, timeout=120, cwd=ROOT, env={**os.environ, startup.ENV: "never"})
    assert r.returncode == 2 and r.stdout == "", r
    assert r.stderr.strip().splitlines() == [
        "chunkgrpo: error: CHUNKGRPO_GC='never': leave it unset, or 'default' for CPython's collector "
        "thresholds"]


def _launch(script, gc_setting: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "chunkgrpo.torchrun_local", "--nproc-per-node", "1", str(script)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, startup.ENV: gc_setting})


@pytest.mark.integration  # the valid setting's launch is a real torchrun
def test_a_bad_setting_stops_the_local_torchrun_launcher_in_one_line_with_exit_2(tmp_path):
    script = tmp_path / "exits_7.py"
    script.write_text("raise SystemExit(7)\n")
    r = _launch(script, "never")
    assert r.returncode == 2 and r.stdout == "", r
    assert r.stderr.strip().splitlines() == [
        "chunkgrpo.torchrun_local: error: CHUNKGRPO_GC='never': leave it unset, or 'default' for CPython's "
        "collector thresholds"]
    r = _launch(script, "default")
    assert r.returncode == 7, r  # a valid setting launches: the script's own status comes back


def test_every_task_applies_it():
    r = _py("import gc\nfrom chunkgrpo.stages.task import stage_env\n"
            "stage_env('')\nprint(gc.get_threshold()[2])")
    assert r.stdout.split() == [str(startup.FULL_AFTER)], r

"""Bad input, through the real CLI entry point (`chunkgrpo.cli.main`): every case exits 2 with exactly
one `chunkgrpo <cmd>: error: ...` line on stderr naming the problem, no traceback, and nothing
half-written or lost. Each case is one bad input (the table: tests/unit/cli_bad_inputs.py); pytest's count
is the number tried / handled:

    .venv/bin/python -m pytest -q tests/unit/test_cli_bad_inputs.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from chunkgrpo.cli import main
from tests.unit.cli_bad_inputs import BAD_INPUTS, TINY_MODEL


@pytest.fixture
def ws(tmp_path, monkeypatch):
    """A workspace: a stand-in model folder (never loaded: every case fails before), good prompts,
    a good profile; cwd = tmp_path."""
    monkeypatch.chdir(tmp_path)
    for k in ("MLFLOW_TRACKING_URI", "CHUNKGRPO_S3_ENDPOINT"):
        monkeypatch.delenv(k, raising=False)
    model = tmp_path / "model"
    model.mkdir()
    (model / "model_index.json").write_text("{}")
    (tmp_path / "prompts.txt").write_text("a cat\na dog\n")
    (tmp_path / "profile.json").write_text(json.dumps({"sigmas": [1.0, 0.8, 0.6, 0.4, 0.2, 0.0],
                                                       "l1rel": [0.5, 0.3, 0.2, 0.15, 0.1]}))
    (tmp_path / "adir").mkdir()
    (tmp_path / "adir" / "keep.txt").write_text("precious")
    return tmp_path


def _snapshot(root: Path) -> dict[str, bytes]:
    """Every entry under `root`: files by content, folders and FIFOs by kind (a created folder is a
    change)."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else "dir" if p.is_dir() else "other")
            for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_exit_2_and_loses_nothing(case, ws, capsys, monkeypatch, request):
    argv_fn, needle = BAD_INPUTS[case]
    TINY_MODEL["dir"] = lambda: request.getfixturevalue("tiny_model_dir")
    # S3 / MLflow point at a closed port: a case that reached the network would fail differently
    monkeypatch.setenv("CHUNKGRPO_S3_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test-secret")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    argv = argv_fn(ws)
    before = _snapshot(ws)
    capsys.readouterr()  # what preparing the workspace printed
    rc = main(argv)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2, err
    assert "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith(f"chunkgrpo {argv[0]}: error: "), err
    assert needle in lines[0], lines[0]
    # nothing written, replaced or removed: the workspace is byte-for-byte what it was
    assert _snapshot(ws) == before
    assert not [p for p in ws.rglob("*") if p.name.endswith((".tmp", ".partial"))]


FAILURES = {
    "StoreError": ("chunkgrpo.store", "StoreError", "S3 at http://x still failing after 6 attempts"),
    "ChecksumMismatchError": ("chunkgrpo.store", "ChecksumMismatchError", "s3://b/k: sha256 1 != recorded 2"),
    "NonFiniteLossError": ("chunkgrpo.train.context", "NonFiniteLossError", "non-finite loss at step 3"),
    "CorruptCheckpointError": (
        "chunkgrpo.train.checkpoint_format",
        "CorruptCheckpointError",
        "step-000004/optimizer.pt: x",
    ),
    "MirrorBacklogError": (
        "chunkgrpo.train.checkpoint_format",
        "MirrorBacklogError",
        "checkpoint.keep=1 would delete",
    ),
    "ConnectionRefusedError": ("builtins", "ConnectionRefusedError", "[Errno 111] Connection refused"),
    "IsADirectoryError": ("builtins", "IsADirectoryError", None),
    "UnicodeDecodeError": ("builtins", "UnicodeDecodeError", None),
}


@pytest.mark.parametrize("name", list(FAILURES))
def test_known_failures_reaching_the_cli_are_one_line(name, capsys, monkeypatch):
    import importlib

    import chunkgrpo.commands.plan as plan_cmd

    module, cls_name, text = FAILURES[name]
    cls = getattr(importlib.import_module(module), cls_name)
    if cls is IsADirectoryError:
        exc = IsADirectoryError(21, "Is a directory", "/some/dir")
    elif cls is UnicodeDecodeError:
        exc = UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
    else:
        exc = cls(text)

    def boom(args):
        raise exc

    monkeypatch.setattr(plan_cmd, "run", boom)
    rc = main(["plan", "--profile", "p.json", "--out", "o.json"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("chunkgrpo plan: error: ")
    if text:
        assert text in lines[0]


def test_a_bug_keeps_its_traceback(monkeypatch):
    """Only known failures are shortened: a programming error still raises (and shows where)."""
    import chunkgrpo.commands.plan as plan_cmd

    monkeypatch.setattr(plan_cmd, "run", lambda args: {}["missing"])
    with pytest.raises(KeyError):
        main(["plan", "--profile", "p.json", "--out", "o.json"])


def test_kfp_unreachable_is_one_line(capsys, monkeypatch):
    pytest.importorskip("kfp")
    from chunkgrpo.processes import free_port

    rc = main(["pipeline", "upload", "--host", f"http://127.0.0.1:{free_port()}"])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and "Traceback" not in err and len(lines) == 1, err
    assert "cannot reach Kubeflow Pipelines" in lines[0]


def test_tiny_model_overwrite_replaces_only_its_own_folder(tmp_path):
    from chunkgrpo.testing.tiny import MARKER

    out = tmp_path / "tiny"
    assert main(["tiny-model", "--out", str(out)]) == 0
    first = (out / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes()
    assert main(["tiny-model", "--out", str(out), "--seed", "1"]) == 2  # refused without --overwrite
    assert (out / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes() == first
    assert main(["tiny-model", "--out", str(out), "--seed", "1", "--overwrite"]) == 0  # its own folder
    assert (out / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes() != first
    assert json.loads((out / MARKER).read_text())["seed"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]  # no staging/old folders left
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["tiny-model", "--out", str(empty)]) == 0  # an empty folder is fine
    assert (empty / "model_index.json").exists()
    assert os.listdir(tmp_path) and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:1"])
def test_valid_devices_are_accepted(device):
    from chunkgrpo.train.config import TrainConfig

    assert TrainConfig.load("tiny_cpu", [f"device={device}"]).device == device


@pytest.mark.parametrize("record", ["no start time", "another command line", "another process group"])
def test_local_down_never_signals_a_process_it_did_not_start(record, tmp_path, capsys):
    """A state.json naming an unrelated live process: exit 2, one line naming the
    pid, the process untouched, the state file untouched."""
    import subprocess
    import sys

    import psutil

    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        rec = {"pid": victim.pid, "pgid": victim.pid, "port": 1, "cmd": ["weed", "mini"], "log": "x",
               "create_time": psutil.Process(victim.pid).create_time()}
        if record == "no start time":
            rec.pop("create_time")
        elif record == "another process group":
            rec["pgid"] = os.getpgid(0)
        home = tmp_path / "home"
        home.mkdir()
        (home / "state.json").write_text(json.dumps({"services": {"s3": rec}}))
        before = (home / "state.json").read_bytes()
        rc = main(["local", "down", "--home", str(home)])
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert rc == 2 and "Traceback" not in err and len(lines) == 1, err
        assert f"pid {victim.pid}" in lines[0] and "not signalling it" in lines[0]
        assert victim.poll() is None  # still running
        assert (home / "state.json").read_bytes() == before
    finally:
        victim.kill()
        victim.wait()


def test_tiny_flux_layers_override(tmp_path):
    """`build_tiny_flux(layers=)`: the transformer gets the given block counts (the GPU benchmark's
    one-block folder of FLUX's widths); anything but two counts >= 1 is refused in one line."""
    import json

    from chunkgrpo.errors import UserError
    from chunkgrpo.testing.tiny import build_tiny_flux

    out = build_tiny_flux(tmp_path / "m", size="tiny", layers=(2, 3))
    cfg = json.loads((out / "transformer" / "config.json").read_text())
    assert (cfg["num_layers"], cfg["num_single_layers"]) == (2, 3)
    for bad in ((0, 1), (1,), (1, 2, 3)):
        with pytest.raises(UserError, match="layers must be two block counts"):
            build_tiny_flux(tmp_path / "bad", size="tiny", layers=bad)
    assert not (tmp_path / "bad").exists()

"""Nothing read from a checkpoint is trusted: pickled code is refused and
never runs, every file is verified against the manifest, a bad checkpoint is set aside (never
deleted) and the newest good one is used — resuming exactly —, and NaN weights are never committed."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from chunkgrpo.train import checkpoint_format as ckpt
from chunkgrpo.train.config import TrainConfig
from chunkgrpo.train.context import NonFiniteLossError
from chunkgrpo.train.trainer import Trainer, run_training


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("data") / "prompts.txt"
    p.write_text("a cat on a chair\na red car\nthree apples\na bowl of fruit\n")
    return p


def _cfg(model, prompts, out, *over):
    return TrainConfig.load(
        "tiny_cpu",
        [
            f"model={model}",
            f"prompts={prompts}",
            f"output_dir={out}",
            "progress=false",
            "checkpoint.every=1",
            "checkpoint.keep=10",
            "tracking.image_every=0",
            *over,
        ],
    )


@pytest.fixture(scope="module")
def reference(tiny_model_dir, prompts_file, tmp_path_factory):
    """An uninterrupted 3-step run: the final weights every recovered run must reproduce exactly."""
    out = tmp_path_factory.mktemp("ref")
    run_training(_cfg(tiny_model_dir, prompts_file, out, "max_steps=3"))
    return load_file(str(out / "final" / "pytorch_lora_weights.safetensors"))


@pytest.fixture(scope="module")
def stopped_run(tiny_model_dir, prompts_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("stopped") / "run"
    run_training(_cfg(tiny_model_dir, prompts_file, out, "max_steps=2"))
    shutil.rmtree(out / "final")
    return out


@pytest.fixture
def two_checkpoints(stopped_run, tmp_path):
    """A run stopped after 2 optimizer steps (checkpoints step-1 and step-2), to be resumed to 3."""
    out = tmp_path / "run"
    shutil.copytree(stopped_run, out)
    return out


class Payload:
    """What an attacker plants: unpickling it runs a shell command."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _plant(path: Path, rel: str, obj) -> None:
    """Replace one file and rewrite the manifest to match (whoever plants files writes the manifest)."""
    torch.save(obj, path / rel)
    ckpt.write_manifest(path, {"kind": "checkpoint"})


def _resume(model, prompts, out, caplog):
    caplog.set_level(logging.INFO, logger="chunkgrpo.train.trainer")
    summary = run_training(_cfg(model, prompts, out, "max_steps=3"))
    return summary, load_file(str(out / "final" / "pytorch_lora_weights.safetensors"))


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("rel", ["optimizer.pt", "scheduler.pt", "rng/rank0.pt"])
def test_pickled_payload_is_refused_never_run_and_the_older_checkpoint_is_used(
        rel, two_checkpoints, tiny_model_dir, prompts_file, reference, tmp_path, caplog):
    marker = tmp_path / "pwned"
    step2 = two_checkpoints / "checkpoints" / "step-000002"
    _plant(step2, rel, {"state": Payload(marker), "param_groups": []})
    with pytest.raises(ckpt.CorruptCheckpointError, match=rel.replace("/", ".")):
        ckpt.read(step2, 0)
    assert not marker.exists()

    summary, final = _resume(tiny_model_dir, prompts_file, two_checkpoints, caplog)
    assert not marker.exists()  # the payload never ran
    aside = two_checkpoints / "checkpoints" / "step-000002.bad-1"
    assert (aside / rel).exists()  # kept for inspection, not deleted
    assert "fell back to step-000001" in caplog.text
    assert summary["optimizer_steps"] == 3
    assert _same(final, reference)  # steps 2 and 3 were re-trained from step 1: exactly the same result


def test_bit_flips_are_detected_by_checksum(two_checkpoints, tiny_model_dir, prompts_file, reference, caplog):
    step2 = two_checkpoints / "checkpoints" / "step-000002"
    f = step2 / "trainable.safetensors"
    data = bytearray(f.read_bytes())
    for i in range(1000):  # 1,000 flipped bytes after the header: still a loadable file
        pos = len(data) - 1 - i * 3
        data[pos] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(ckpt.CorruptCheckpointError, match="trainable.safetensors: sha256 differs"):
        ckpt.verify(step2)
    _, final = _resume(tiny_model_dir, prompts_file, two_checkpoints, caplog)
    assert "sha256 differs from the manifest" in caplog.text
    assert (
        two_checkpoints / "checkpoints" / "step-000002.bad-1" / "trainable.safetensors"
    ).read_bytes() == bytes(data)
    assert _same(final, reference)


@pytest.mark.parametrize("damage", ["truncated optimizer.pt", "bad safetensors header", "missing file",
                                    "size differs", "manifest unreadable"])
def test_unreadable_latest_checkpoint_falls_back(
    damage, two_checkpoints, tiny_model_dir, prompts_file, reference, caplog
):
    step2 = two_checkpoints / "checkpoints" / "step-000002"
    if damage == "truncated optimizer.pt":  # manifest rewritten to match: only reading can tell
        f = step2 / "optimizer.pt"
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
        ckpt.write_manifest(step2, {"kind": "checkpoint"})
    elif damage == "bad safetensors header":
        f = step2 / "trainable.safetensors"
        f.write_bytes(b"\xff" * 8 + f.read_bytes()[8:])
        ckpt.write_manifest(step2, {"kind": "checkpoint"})
    elif damage == "missing file":
        (step2 / "scheduler.pt").unlink()
    elif damage == "size differs":
        with open(step2 / "trainer_state.json", "a") as fh:
            fh.write(" ")
    else:
        (step2 / "MANIFEST.json").write_text("{not json")
    summary, final = _resume(tiny_model_dir, prompts_file, two_checkpoints, caplog)
    assert summary["optimizer_steps"] == 3
    assert (two_checkpoints / "checkpoints" / "step-000002.bad-1").is_dir()
    assert "fell back to step-000001" in caplog.text
    assert _same(final, reference)


def test_no_checkpoint_verifies_starts_fresh_and_keeps_them_all(two_checkpoints, tiny_model_dir, prompts_file,
                                                               reference, caplog):
    for step in (1, 2):
        (two_checkpoints / "checkpoints" / f"step-{step:06d}" / "optimizer.pt").write_bytes(b"garbage")
    summary, final = _resume(tiny_model_dir, prompts_file, two_checkpoints, caplog)
    assert "no checkpoint verifies" in caplog.text
    names = sorted(p.name for p in (two_checkpoints / "checkpoints").iterdir())
    assert "step-000001.bad-1" in names and "step-000002.bad-1" in names
    assert summary["history"][0]["optimizer_step"] == 1 and len(summary["history"]) == 3
    assert _same(final, reference)  # from scratch is the same deterministic run


def test_rng_state_is_plain_data():
    """RNG states are tensors and plain values: readable with weights_only=True, and exact."""
    import io
    import random

    import numpy as np

    state = ckpt.rng_state()
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    a = (torch.rand(3), random.random(), np.random.rand())
    ckpt.set_rng_state(loaded)
    b = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(a[0], b[0]) and a[1] == b[1] and a[2] == b[2]


def test_nan_weights_are_never_committed(tiny_model_dir, prompts_file, tmp_path, monkeypatch):
    """A step that leaves NaN in the weights (here: an optimizer poisoned after step 1) stops the run
    before the checkpoint is written: step-1 stays the newest complete checkpoint and resumes."""
    out = tmp_path / "run"
    real_step = Trainer._optimizer_step

    def poisoned(self):
        res = real_step(self)
        if self.opt_step == 2:
            with torch.no_grad():
                self.trainable[0].fill_(float("nan"))
        return res

    monkeypatch.setattr(Trainer, "_optimizer_step", poisoned)
    with pytest.raises(NonFiniteLossError, match="checkpoint not written"):
        run_training(_cfg(tiny_model_dir, prompts_file, out, "max_steps=3"))
    done = ckpt.complete_checkpoints(out / "checkpoints")
    assert [p.name for p in done] == ["step-000001"]
    assert not list((out / "checkpoints").glob(".staging*")) and not (out / "final").exists()
    weights = load_file(str(done[0] / "trainable.safetensors"))
    assert all(torch.isfinite(v).all() for v in weights.values())
    monkeypatch.setattr(Trainer, "_optimizer_step", real_step)
    summary = run_training(_cfg(tiny_model_dir, prompts_file, out, "max_steps=3"))
    assert summary["optimizer_steps"] == 3


def test_nan_optimizer_state_is_never_committed(tiny_model_dir, prompts_file, tmp_path, monkeypatch):
    out = tmp_path / "run"
    real_step = Trainer._optimizer_step

    def poisoned(self):
        res = real_step(self)
        for st in self.optimizer.state.values():
            st["exp_avg_sq"].fill_(float("inf"))
        return res

    monkeypatch.setattr(Trainer, "_optimizer_step", poisoned)
    with pytest.raises(NonFiniteLossError, match="exp_avg_sq"):
        run_training(_cfg(tiny_model_dir, prompts_file, out, "max_steps=2"))
    assert ckpt.complete_checkpoints(out / "checkpoints") == []


def test_sigterm_while_saving_finishes_the_checkpoint_then_stops(
    tiny_model_dir, prompts_file, tmp_path, monkeypatch
):
    import signal

    from chunkgrpo.errors import Terminated

    out = tmp_path / "run"
    real_finalize = ckpt.finalize

    def finalize_under_sigterm(*a, **k):
        os.kill(os.getpid(), signal.SIGTERM)  # arrives while the checkpoint is being written
        return real_finalize(*a, **k)

    monkeypatch.setattr(ckpt, "finalize", finalize_under_sigterm)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Terminated):
        run_training(_cfg(tiny_model_dir, prompts_file, out, "max_steps=3"))
    done = ckpt.complete_checkpoints(out / "checkpoints")
    assert [p.name for p in done] == ["step-000001"]  # the one in flight was finished, no later one started
    ckpt.verify(done[0])  # complete and consistent
    assert not list((out / "checkpoints").glob(".staging*"))
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is the trainer's only while it trains


def test_second_trainer_on_the_same_output_dir_is_refused(tiny_model_dir, prompts_file, tmp_path):
    from chunkgrpo.errors import UserError

    cfg = _cfg(tiny_model_dir, prompts_file, tmp_path / "run", "max_steps=1")
    first = Trainer(cfg)
    first.setup()
    try:
        second = Trainer(cfg)
        with pytest.raises(UserError, match=f"in use by another training process \\(pid {os.getpid()}\\)"):
            second.setup()
    finally:
        first.close()
    third = Trainer(cfg)  # released on close
    third.setup()
    third.close()


class FakeMirror:
    """The two questions pruning asks a mirror: is it still pending, and (after waiting while the
    mirror works) is it still not in S3."""

    def __init__(self, pending, failing):
        self.pending, self.failing, self.last_error, self.waited = set(pending), failing, "S3 down", []

    def is_pending(self, p):
        return p in self.pending

    def is_mirrored(self, p):  # nothing uploaded in this mirror's lifetime (test_checkpoint_format_prune.py)
        return False

    def settle(self, p):
        self.waited.append(p.name)
        if not self.failing:
            self.pending.discard(p)  # a working mirror finishes the upload
        return p in self.pending


def test_prune_never_deletes_a_checkpoint_not_yet_in_s3(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3, 4):
        d = ckpt.step_dir(root, step)
        d.mkdir(parents=True)
        (d / "x").write_text(str(step))
        ckpt.write_manifest(d, {})
    # within the backlog: kept without waiting, the mirrored one is deleted
    m = FakeMirror({ckpt.step_dir(root, 1)}, failing=True)
    assert [p.name for p in ckpt.prune(root, keep=2, mirror=m, backlog=1)] == ["step-000002"]
    assert m.waited == []
    assert [p.name for p in ckpt.complete_checkpoints(root)] == ["step-000001", "step-000003", "step-000004"]
    # beyond the backlog, mirror working: wait for the upload (normal lag), then delete
    m = FakeMirror({ckpt.step_dir(root, 1)}, failing=False)
    assert [p.name for p in ckpt.prune(root, keep=2, mirror=m, backlog=0)] == ["step-000001"]
    assert m.waited == ["step-000001"]
    # beyond the backlog, mirror failing: refuse, delete nothing
    m = FakeMirror({ckpt.step_dir(root, 3)}, failing=True)
    with pytest.raises(ckpt.MirrorBacklogError, match="would delete step-000003, not yet mirrored"):
        ckpt.prune(root, keep=1, mirror=m, backlog=0)
    assert [p.name for p in ckpt.complete_checkpoints(root)] == ["step-000003", "step-000004"]


def test_mirror_retries_until_s3_answers(tmp_path):
    """The background mirror keeps a failed upload queued and retries it with backoff."""
    d = ckpt.step_dir(tmp_path, 1)
    d.mkdir()
    calls = []

    class Flaky:
        def put_folder(self, path, uri, meta=None):
            calls.append(uri)
            if len(calls) < 3:
                raise ConnectionRefusedError("S3 down")

    m = ckpt.Mirror("s3://bucket/ckpt", store_factory=Flaky, backoff_s=0.01, max_backoff_s=0.02)
    m.submit(d)
    assert m.wait(30) and calls == ["s3://bucket/ckpt/step-000001"] * 3
    assert not m.failing and m.failures == 2 and m.uploaded == ["s3://bucket/ckpt/step-000001"]
    m.close()


def test_manifest_must_list_the_required_files(tmp_path):
    d = tmp_path / "step-000001"
    d.mkdir()
    (d / "trainable.safetensors").write_bytes(b"x")
    ckpt.write_manifest(d, {})
    with pytest.raises(ckpt.CorruptCheckpointError, match="manifest lacks optimizer.pt"):
        ckpt.verify(d)
    assert json.loads((d / "MANIFEST.json").read_text())["files"]


def _unsafe_loads(source: str) -> list[str]:
    """Calls in `source` that can unpickle code: torch.load without a literal weights_only=True,
    pickle/dill/joblib loads, numpy loads with allow_pickle=True."""
    import ast

    bad = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = (
            f"{getattr(f.value, 'id', '?')}.{f.attr}"
            if isinstance(f, ast.Attribute)
            else getattr(f, "id", "?")
        )
        kw = {k.arg: k.value for k in node.keywords}
        literal_true = lambda v: isinstance(v, ast.Constant) and v.value is True  # noqa: E731
        if name == "torch.load" and not literal_true(kw.get("weights_only")):
            bad.append(f"line {node.lineno}: torch.load without weights_only=True")
        elif name in {"pickle.load", "pickle.loads", "dill.load", "dill.loads", "joblib.load"}:
            bad.append(f"line {node.lineno}: {name}")
        elif name in {"np.load", "numpy.load"} and literal_true(kw.get("allow_pickle")):
            bad.append(f"line {node.lineno}: {name}(allow_pickle=True)")
    return bad


def test_the_guard_finds_unsafe_loads():
    src = (
        "import torch, pickle\n"
        "torch.load(p)\ntorch.load(p, weights_only=False)\ntorch.load(p, weights_only=flag)\n"
        "pickle.loads(b)\nnp.load(p, allow_pickle=True)\n"
        "torch.load(p, map_location='cpu', weights_only=True)\n"
    )
    assert [b.split(":")[0] for b in _unsafe_loads(src)] == ["line 2", "line 3", "line 4", "line 5", "line 6"]


def test_no_code_in_the_package_can_unpickle_code():
    """Item 1 for every reader, also after merges: anything the package loads from disk or S3 goes
    through weights_only=True (or safetensors / JSON)."""
    import chunkgrpo

    root = Path(chunkgrpo.__file__).parent
    found = {
        str(p.relative_to(root)): b for p in sorted(root.rglob("*.py")) if (b := _unsafe_loads(p.read_text()))
    }
    assert not found, found


# ------------------------------------------------------------- contents, not just checksums


def _rewrite_state(step_dir: Path, **changes) -> None:
    f = step_dir / "trainer_state.json"
    state = json.loads(f.read_text())
    state.update(changes)
    f.write_text(json.dumps(state))
    ckpt.write_manifest(step_dir, {"kind": "checkpoint"})


@pytest.mark.parametrize("damage", ["nan weights", "inf optimizer moment", "optimizer_step=1000",
                                    "optimizer_step=-1", "iteration disagrees with history"])
def test_checkpoint_contents_are_checked_and_the_older_one_is_used(damage, two_checkpoints, tiny_model_dir,
                                                                   prompts_file, reference, caplog):
    """The manifest is rewritten to match every planted change (whoever plants files writes it too):
    only a check of the contents can refuse the checkpoint."""
    from safetensors.torch import save_file

    step2 = two_checkpoints / "checkpoints" / "step-000002"
    if damage == "nan weights":
        w = load_file(str(step2 / "trainable.safetensors"))
        name = sorted(w)[0]
        w[name][0] = float("nan")
        save_file(w, str(step2 / "trainable.safetensors"))
        ckpt.write_manifest(step2, {"kind": "checkpoint"})
        expect = "non-finite values"
    elif damage == "inf optimizer moment":
        opt = torch.load(step2 / "optimizer.pt", weights_only=True)
        first = next(iter(opt["state"].values()))
        first["exp_avg_sq"].view(-1)[0] = float("inf")
        _plant(step2, "optimizer.pt", opt)
        expect = "optimizer.pt: non-finite"
    elif damage == "optimizer_step=1000":
        _rewrite_state(step2, optimizer_step=1000)
        expect = "optimizer_step=1000 but the folder is step 2"
    elif damage == "optimizer_step=-1":
        _rewrite_state(step2, optimizer_step=-1)
        expect = "negative optimizer_step=-1"
    else:
        _rewrite_state(step2, iteration=7)
        expect = "iteration=7 but 2 history entries"
    with pytest.raises(ckpt.CorruptCheckpointError, match=expect):
        ckpt.read(step2, 0)
    summary, final = _resume(tiny_model_dir, prompts_file, two_checkpoints, caplog)
    assert expect in caplog.text and "fell back to step-000001" in caplog.text
    assert (two_checkpoints / "checkpoints" / "step-000002.bad-1").is_dir()  # kept aside, not deleted
    assert summary["optimizer_steps"] == 3
    assert _same(final, reference)


def test_step_count_must_agree_with_the_scheduler_and_optimizer(two_checkpoints):
    """A folder renamed together with its trainer_state (step-2 → step-9) still disagrees with the
    LR scheduler's and AdamW's own step counters."""
    src = two_checkpoints / "checkpoints" / "step-000002"
    moved = src.rename(src.with_name("step-000009"))
    _rewrite_state(moved, optimizer_step=9)
    with pytest.raises(
        ckpt.CorruptCheckpointError, match="optimizer_step=9 but scheduler.pt has taken 2 steps"
    ):
        ckpt.read(moved, 0)


def test_a_checkpoint_beyond_the_run_end_is_refused_not_finished(
    two_checkpoints, tiny_model_dir, prompts_file
):
    """A genuine step-2 checkpoint and max_steps=1: one line, nothing set aside, nothing 'finished'."""
    from chunkgrpo.errors import UserError

    with pytest.raises(UserError, match="optimizer_step=2 .*beyond this run's end"):
        run_training(_cfg(tiny_model_dir, prompts_file, two_checkpoints, "max_steps=1"))
    names = sorted(p.name for p in (two_checkpoints / "checkpoints").iterdir())
    assert names == ["step-000001", "step-000002"] and not (two_checkpoints / "final").exists()


@pytest.mark.parametrize("change", ["lr=0.5", "model"])
def test_resume_with_another_lr_or_base_model_is_refused(
    change, two_checkpoints, tiny_model_dir, prompts_file, tmp_path, caplog
):
    from chunkgrpo.errors import UserError

    if change == "model":
        other = tmp_path / "other-model"
        shutil.copytree(tiny_model_dir, other)
        cfg_args, model, needle = (), other, "model: "
    else:
        cfg_args, model, needle = (change,), tiny_model_dir, "lr: "
    before = sorted(p.name for p in (two_checkpoints / "checkpoints").iterdir())
    with pytest.raises(UserError, match=f"trained with another config \\({needle}.*allow_config_change"):
        run_training(_cfg(model, prompts_file, two_checkpoints, "max_steps=3", *cfg_args))
    assert sorted(p.name for p in (two_checkpoints / "checkpoints").iterdir()) == before
    summary = run_training(_cfg(model, prompts_file, two_checkpoints, "max_steps=3", *cfg_args,
                                "checkpoint.allow_config_change=true"))
    assert summary["history"][0]["optimizer_step"] == 1 and summary["optimizer_steps"] == 3


# ---------------------------------------------------------------- full / read-only disks


@pytest.mark.parametrize("fault", ["ENOSPC in torch.save", "ENOSPC in safetensors",
                                   "EROFS creating the staging", "ENOSPC writing the manifest"])
def test_checkpoint_write_failures_are_one_line_and_leave_the_last_checkpoint(
    fault, tiny_model_dir, prompts_file, tmp_path, monkeypatch, capsys
):
    """A disk that fills (or turns read-only) at step 2, simulated at the write boundary: the CLI says so
    in one line (exit 2), the staging folder is gone, step-1 is intact and a re-run resumes from it."""
    import errno

    import safetensors.torch

    from chunkgrpo.cli import main

    out = tmp_path / "run"
    args = ["train", "--config", "tiny_cpu", f"model={tiny_model_dir}", f"prompts={prompts_file}",
            f"output_dir={out}", "progress=false", "checkpoint.every=1", "checkpoint.keep=10",
            "tracking.image_every=0", "max_steps=3"]

    def at_step_2(real, exc):
        def wrapped(*a, **k):
            if (out / "checkpoints" / "step-000001").exists() and not (
                out / "checkpoints" / "step-000002"
            ).exists():
                raise exc
            return real(*a, **k)
        return wrapped

    if fault == "ENOSPC in torch.save":
        real = torch.save
        monkeypatch.setattr(
            torch,
            "save",
            lambda obj, f, *a, **k: (
                (
                    at_step_2(
                        real,
                        RuntimeError(
                            "[enforce fail at inline_container.cc:603] . unexpected pos 64 vs 0: "
                            "PytorchStreamWriter failed writing file data/0: file write failed"
                        ),
                    )(obj, f, *a, **k)
                )
                if str(f).endswith("optimizer.pt")
                else real(obj, f, *a, **k)
            ),
        )
        needle = "file write failed"
    elif fault == "ENOSPC in safetensors":
        monkeypatch.setattr(
            safetensors.torch,
            "save_file",
            at_step_2(
                safetensors.torch.save_file,
                OSError(errno.ENOSPC, "No space left on device", "trainable.safetensors"),
            ),
        )
        needle = "No space left on device"
    elif fault == "EROFS creating the staging":
        monkeypatch.setattr(ckpt, "stage_dir", at_step_2(
            ckpt.stage_dir, OSError(errno.EROFS, "Read-only file system", str(out / "checkpoints"))))
        needle = "Read-only file system"
    else:
        monkeypatch.setattr(ckpt, "write_manifest", at_step_2(
            ckpt.write_manifest, OSError(errno.ENOSPC, "No space left on device", "MANIFEST.json.tmp")))
        needle = "No space left on device"
    rc = main(args)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith(("train ", "\r"))]
    assert rc == 2 and "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("chunkgrpo train: error: cannot write checkpoint"), err
    assert needle in lines[0]
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-000001"]  # no staging left
    ckpt.verify(out / "checkpoints" / "step-000001")
    monkeypatch.undo()
    assert main(args) == 0
    assert json.loads((out / "train_summary.json").read_text())["history"][0]["optimizer_step"] == 1

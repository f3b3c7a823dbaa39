# ruff: noqa: F811 - pytest fixtures imported from test_checkpoint_format_safety
"""A resumed run is the same experiment: another prompts file (by content), objective (KL, clip) or EMA
setting is refused at resume unless `checkpoint.allow_config_change=true`, which records the change in every
later checkpoint's trainer_state.json; an EMA run's checkpoint without its ema.safetensors is a failing
checkpoint (the newest good one is used)."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from chunkgrpo.errors import UserError
from chunkgrpo.train import checkpoint_format as ckpt
from chunkgrpo.train.trainer import run_training
from tests.unit.train.test_checkpoint_format_safety import (  # noqa: F401 - fixtures
    _cfg,
    prompts_file,
    stopped_run,
    two_checkpoints,
)


@pytest.mark.parametrize("change, needle", [
    ("kl_coef=0.5", "kl_coef: 0.0 → 0.5"),
    ("clip_high=0.3", "clip_high: "),
    ("ema.decay=0.9", "ema.decay: 0.0 → 0.9"),
    ("prompts", "prompts (sha256)"),
])
def test_another_objective_ema_or_data_is_refused_unless_allowed_and_then_recorded(
    change, needle, two_checkpoints, tiny_model_dir, prompts_file, tmp_path
):
    prompts, over = prompts_file, [change]
    if change == "prompts":
        prompts = tmp_path / "other.txt"
        prompts.write_text(prompts_file.read_text() + "a green door\n")
        over = []
    root = two_checkpoints / "checkpoints"
    before = sorted(p.name for p in root.iterdir())
    with pytest.raises(UserError, match="trained with another config") as e:
        run_training(_cfg(tiny_model_dir, prompts, two_checkpoints, "max_steps=3", *over))
    assert needle in str(e.value) and len(str(e.value).splitlines()) == 1
    assert sorted(p.name for p in root.iterdir()) == before  # nothing trained, nothing set aside
    run_training(_cfg(tiny_model_dir, prompts, two_checkpoints, "max_steps=3", *over,
                      "checkpoint.allow_config_change=true"))
    state = json.loads((root / "step-000003" / "trainer_state.json").read_text())
    [record] = state["config_changes"]
    assert record["from"] == "step-000002" and any(needle in c for c in record["changes"]), record


def test_the_same_prompts_under_another_path_resume(two_checkpoints, tiny_model_dir, prompts_file, tmp_path):
    copy = tmp_path / "copy.txt"
    shutil.copy(prompts_file, copy)
    summary = run_training(_cfg(tiny_model_dir, copy, two_checkpoints, "max_steps=3"))
    assert summary["optimizer_steps"] == 3 and summary["history"][0]["optimizer_step"] == 1


def test_an_ema_checkpoint_without_its_ema_file_falls_back_to_the_newest_good_one(
    tiny_model_dir, prompts_file, tmp_path, caplog
):
    out = tmp_path / "ema-run"
    run_training(_cfg(tiny_model_dir, prompts_file, out, "max_steps=2", "ema.decay=0.9"))
    shutil.rmtree(out / "final")
    newest = out / "checkpoints" / "step-000002"
    (newest / "ema.safetensors").unlink()
    manifest = json.loads((newest / ckpt.MANIFEST).read_text())  # a manifest that agrees: content is checked
    manifest["files"].pop("ema.safetensors")
    (newest / ckpt.MANIFEST).write_text(json.dumps(manifest))
    caplog.set_level(logging.INFO)
    summary = run_training(_cfg(tiny_model_dir, prompts_file, out, "max_steps=3", "ema.decay=0.9"))
    assert "ema.safetensors: missing" in caplog.text and "fell back to step-000001" in caplog.text
    assert summary["history"][0]["optimizer_step"] == 1  # resumed from step-1 (history kept)
    assert list((out / "checkpoints").glob("step-000002.bad-*"))

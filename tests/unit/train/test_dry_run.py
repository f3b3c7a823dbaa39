"""`chunkgrpo train --dry-run` on every shipped training preset: exit 0 and one JSON line naming the model
folder, the prompt count and the chunk sizes the run would train, with no weights loaded (the model folder
here holds none, and loading is made to fail)."""

import json
from pathlib import Path

import pytest

from chunkgrpo.cli import main

PRESETS = Path(__file__).resolve().parents[3] / "chunkgrpo" / "presets"
TRAINING_PRESETS = sorted(p.stem for p in PRESETS.glob("*.yaml") if not p.stem.startswith("eval_"))


def test_the_training_presets_are_found():
    assert {"tiny_cpu", "chunk_grpo_flux", "step_grpo_flux", "tempflow_grpo_flux"} <= set(TRAINING_PRESETS)


@pytest.mark.parametrize("preset", TRAINING_PRESETS)
def test_dry_run_checks_inputs_and_loads_no_weights(preset, tmp_path, capsys, monkeypatch):
    import chunkgrpo.flux as flux
    from chunkgrpo.chunks import training_plan
    from chunkgrpo.train.config import TrainConfig

    def no_loading(*a, **k):
        raise AssertionError("a dry run loaded model weights")

    monkeypatch.setattr(flux, "load_flux", no_loading)
    model = tmp_path / "model"
    model.mkdir()
    (model / "model_index.json").write_text("{}")  # a diffusers folder's shape, no weights
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\na dog\na red apple\n")
    over = [f"model={model}", f"prompts={prompts}", f"output_dir={tmp_path / 'run'}"]
    assert main(["train", "--config", preset, "--dry-run", *over]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    cfg = TrainConfig.load(preset, over)
    expected = training_plan(cfg.method, cfg.chunks, cfg.trainable_steps).sizes
    from chunkgrpo.gpu import problem

    why = problem(cfg.device)  # a GPU preset on a machine without one: reported, not an error
    assert out == {"ok": True, "model": str(model), "prompts": 3, "chunk_sizes": [int(s) for s in expected],
                   "device": cfg.device, "device_ok_here": why is None,
                   **({"device_problem": why} if why else {})}
    assert sum(out["chunk_sizes"]) == cfg.trainable_steps
    assert not (tmp_path / "run").exists()  # nothing written


def test_a_real_run_of_a_gpu_preset_still_stops_on_the_missing_gpu(tmp_path, capsys, monkeypatch):
    """The dry run reports what a real run of the same config stops on: the GPU check stays first there."""
    from chunkgrpo.gpu import problem
    from chunkgrpo.train.config import TrainConfig

    model = tmp_path / "model"
    model.mkdir()
    (model / "model_index.json").write_text("{}")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n")
    over = [f"model={model}", f"prompts={prompts}", f"output_dir={tmp_path / 'run'}"]
    why = problem(TrainConfig.load("chunk_grpo_flux", over).device)
    if why is None:
        pytest.skip("this machine has a usable CUDA device")
    assert main(["train", "--config", "chunk_grpo_flux", "--dry-run", *over]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["device_ok_here"] is False and out["device_problem"] == why
    assert main(["train", "--config", "chunk_grpo_flux", *over]) == 2
    assert why in capsys.readouterr().err

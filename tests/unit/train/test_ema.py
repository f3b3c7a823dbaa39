"""EMA of the trainable weights: the update rule, the exported model, exact resume."""

import json

import pytest
import torch
from safetensors.torch import load_file

from chunkgrpo.train.config import TrainConfig
from chunkgrpo.train.ema import Ema
from chunkgrpo.train.trainer import run_training


def test_update_rule_interval_and_warmup():
    p = torch.nn.Parameter(torch.zeros(3))
    ema = Ema([p], decay=0.9, every=2)
    with torch.no_grad():
        p.fill_(1.0)
    assert not ema.after_iteration(1)  # not due
    assert ema.after_iteration(2)
    assert torch.allclose(ema.shadow[0], torch.full((3,), 0.1))  # 0.9·0 + 0.1·1
    w = Ema([p], decay=0.9, warmup=True)
    assert w.current_decay() == pytest.approx(0.1)  # (1 + 0)/(10 + 0)
    w.after_iteration(1)
    assert w.current_decay() == pytest.approx(2 / 11)
    with w.swapped():
        assert torch.equal(p.detach(), w.shadow[0])
    assert torch.equal(p.detach(), torch.ones(3))  # trained weights restored


def test_exported_model_is_the_ema_and_resume_continues_it(tiny_model_dir, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\na dog\n")
    common = [f"model={tiny_model_dir}", f"prompts={prompts}", "progress=false", "tracking.image_every=0",
              "sampling.num_steps=4", "chunks=sizes:1,2", "ema.decay=0.5", "checkpoint.every=2"]
    full = run_training(
        TrainConfig.load("tiny_cpu", [*common, f"output_dir={tmp_path / 'a'}", "max_iterations=4"])
    )
    assert full["iterations"] == 4
    ema_final = load_file(str(tmp_path / "a" / "final" / "pytorch_lora_weights.safetensors"))
    trained = load_file(str(tmp_path / "a" / "checkpoints" / "step-000004" / "trainable.safetensors"))
    ckpt_ema = load_file(str(tmp_path / "a" / "checkpoints" / "step-000004" / "ema.safetensors"))
    meta = json.loads((tmp_path / "a" / "final" / "chunkgrpo_model.json").read_text())
    assert meta["ema"]["updates"] == 4 and meta["ema"]["decay"] == 0.5
    lora_b = [k for k in ckpt_ema if "lora_B" in k]
    assert any(not torch.equal(ckpt_ema[k], trained[k]) for k in lora_b)  # the EMA lags the trained weights
    # the exported LoRA holds the EMA (diffusers renames the keys; compare the multisets of values)
    got = sorted(float(v.abs().sum()) for k, v in ema_final.items() if "lora_B" in k)
    assert got == pytest.approx(sorted(float(ckpt_ema[k].abs().sum()) for k in lora_b), rel=1e-6)
    # stop after 2 iterations, resume to 4: the same EMA (and weights) as the uninterrupted run
    out = tmp_path / "b"
    run_training(TrainConfig.load("tiny_cpu", [*common, f"output_dir={out}", "max_iterations=2"]))
    run_training(TrainConfig.load("tiny_cpu", [*common, f"output_dir={out}", "max_iterations=4"]))
    resumed = load_file(str(out / "checkpoints" / "step-000004" / "ema.safetensors"))
    assert all(torch.allclose(resumed[k], ckpt_ema[k], atol=1e-7) for k in ckpt_ema)

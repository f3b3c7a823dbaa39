"""`lora.init`: peft's default (Kaiming-uniform A) or TempFlow-GRPO's Gaussian A with sd 1/r, checked on the
A matrices an adapter gets; the TempFlow presets follow their reference (gaussian)."""

import pytest
import torch
from peft import inject_adapter_in_model

from chunkgrpo.errors import UserError
from chunkgrpo.train.config import LoraConfig, TrainConfig
from chunkgrpo.train.trainer import peft_lora_config


class Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.to_q = torch.nn.Linear(width, width)
        self.proj_out = torch.nn.Linear(4 * width, width)


def _a_sd(init: str, rank: int = 32, width: int = 3072) -> dict[str, float]:
    torch.manual_seed(0)
    model = inject_adapter_in_model(peft_lora_config(LoraConfig(rank=rank, alpha=2 * rank, init=init,
                                                                targets=["to_q", "proj_out"])), Block(width))
    sd = {n.split(".")[0]: float(p.detach().std()) for n, p in model.named_parameters() if "lora_A" in n}
    assert all(
        float(p.detach().abs().max()) == 0 for n, p in model.named_parameters() if "lora_B" in n
    )  # B = 0: no-op start
    return sd


def test_gaussian_init_has_a_with_sd_one_over_rank():
    sd = _a_sd("gaussian", rank=32)
    assert sd["to_q"] == pytest.approx(1 / 32, rel=0.02) and sd["proj_out"] == pytest.approx(1 / 32, rel=0.02)


def test_default_init_is_kaiming_uniform_and_3_to_6_times_smaller_on_flux_widths():
    sd = _a_sd("default", rank=32)
    assert sd["to_q"] == pytest.approx((3 * 3072) ** -0.5, rel=0.02)  # ≈ 0.0104
    assert sd["proj_out"] == pytest.approx((3 * 4 * 3072) ** -0.5, rel=0.02)  # ≈ 0.0052
    assert 2.5 < (1 / 32) / sd["to_q"] < 3.5 and 5.5 < (1 / 32) / sd["proj_out"] < 6.5


def test_tempflow_presets_use_the_reference_init_and_others_peft_default():
    for preset in ("tempflow_grpo_flux", "tempflow_grpo_tiny_cpu"):
        assert TrainConfig.load(preset, []).lora.init == "gaussian", preset
    for preset in ("chunk_grpo_flux", "granular_grpo_flux", "toy_cpu"):
        assert TrainConfig.load(preset, []).lora.init == "default", preset
    assert TrainConfig.load("toy_cpu", ["lora.init=gaussian"]).lora.init == "gaussian"


def test_bad_init_is_a_clear_error():
    with pytest.raises(UserError, match="lora.init='xavier'"):
        LoraConfig(init="xavier")

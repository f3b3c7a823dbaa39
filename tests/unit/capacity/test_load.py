"""The load phase of the capacity plan (chunkgrpo/capacity/load.py and its use in capacity.plan): shards
as FSDP pads them, the host's copies per load path, the stored dtype read from the file headers.
The measured side (per-rank memory at 1, 2 ranks under torchrun): tests/benchmarks/test_load_memory.py."""

from __future__ import annotations

import math
import shutil

import torch

from chunkgrpo.capacity.arch import FLUX_DEV, FLUX_DEV_TRANSFORMER_PARAMS, ModelArch
from chunkgrpo.capacity.load import (
    adapter_shapes,
    frozen_host_bytes,
    stored_bytes,
    tensor_shapes,
    transformer_load,
)
from chunkgrpo.capacity.plan import capacity_plan
from chunkgrpo.capacity.pool import local_pool
from chunkgrpo.train.config import TrainConfig
from chunkgrpo.train.model_load import sharded_load


def test_shards_are_padded_like_fsdp_and_fall_as_one_over_world():
    shapes = [torch.Size([5, 3]), torch.Size([8]), torch.Size([])]
    one = transformer_load(shapes, world=1, sharded=True, load_bytes=4, stored_bytes=2)
    assert one["device"] == (15 + 8 + 1) * 4
    four = transformer_load(shapes, world=4, sharded=True, load_bytes=4, stored_bytes=2)
    # ⌈5/4⌉·3 + ⌈8/4⌉ + 1 elements (torch.chunk's split, every rank padded to the first's rows)
    assert four["device"] == (2 * 3 + 2 + 1) * 4
    assert four["host"] == 2 * 3 * 2  # the largest tensor's rows, in the stored dtype
    whole = transformer_load(shapes, world=4, sharded=False, load_bytes=4, stored_bytes=2)
    assert whole["device"] == whole["host"] == whole["cpu"] == 24 * 4  # each rank's own copy, host and device
    fsdp = transformer_load(shapes, world=4, sharded=False, load_bytes=2, stored_bytes=2, fsdp=True)
    assert fsdp["host"] == 24 * 2 and fsdp["device"] == 24 * 2 + 9 * 2  # + the shards FSDP copies out of it
    assert four["cpu"] == four["device"] + four["host"]


def test_flux_dev_shard_is_a_world_th_of_the_fp32_transformer():
    shapes = tensor_shapes(ModelArch(**FLUX_DEV).build("transformer"))
    W = FLUX_DEV_TRANSFORMER_PARAMS
    for n in (1, 2, 8, 16):
        load = transformer_load(shapes, world=n, sharded=True, load_bytes=4, stored_bytes=2)
        assert 4 * W / n <= load["device"] <= 4 * W / n * 1.002, n  # padding below 0.2 %
        assert load["host"] < 2**30 / n  # one tensor's rows, never a copy of the transformer


def test_stored_dtype_is_read_from_the_headers(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    assert stored_bytes(tiny_model_dir) == 4  # the tiny builder writes fp32
    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    f = model / "transformer" / "diffusion_pytorch_model.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(str(f)).items()}, str(f))
    assert stored_bytes(model) == 2
    assert stored_bytes(tmp_path / "absent", default=2) == 2


def test_t5_keeps_wo_in_fp32_while_it_loads_in_bf16():
    t5 = ModelArch(**FLUX_DEV).build("text_encoder_2")
    wo = sum(p.numel() for n, p in t5.named_parameters() if ".wo." in n)
    assert wo == 24 * 4096 * 10240
    assert frozen_host_bytes(t5, 2) == 2 * wo and frozen_host_bytes(t5, 4) == 0


def test_lora_shards_its_base_in_the_load_dtype_and_keeps_the_adapter_init_on_the_host():
    shapes, adapters = [torch.Size([6, 4]), torch.Size([6])], [torch.Size([2, 4]), torch.Size([6, 2])]
    load = transformer_load(shapes, world=2, sharded=True, load_bytes=2, stored_bytes=2, adapters=adapters)
    assert load["parts"] == {"transformer shard (bf16, 1/n)": (3 * 4 + 3) * 2,
                             "LoRA adapter shard (fp32, 1/n)": (1 * 4 + 3 * 2) * 4}
    assert load["host_parts"] == {"one tensor's rows in transit": 3 * 4 * 2,
                                  "LoRA initial values (whole, bf16)": (8 + 12) * 2}
    assert load["device"] == sum(load["parts"].values()) and load["host"] == sum(load["host_parts"].values())
    assert load["cpu"] == load["device"] + load["host"]
    whole = transformer_load(shapes, world=2, sharded=False, load_bytes=2, stored_bytes=2, fsdp=True,
                             adapters=adapters)
    assert whole["host"] == 30 * 2 and whole["parts"]["LoRA adapter (fp32)"] == 20 * 4


def test_flux_dev_lora_base_shard_is_a_world_th_of_the_bf16_transformer():
    """LoRA under FSDP on FLUX.1-dev: the bf16 base's shard falls as 2·W/n, the host keeps one tensor's
    rows and the adapter's bf16 initial values (rank 64 on the attention projections: under 0.5 GB)."""
    from chunkgrpo.train.model_load import peft_lora_config

    tr = ModelArch(**FLUX_DEV).build("transformer")
    shapes = tensor_shapes(tr)
    cfg = TrainConfig.load("chunk_grpo_flux", ["lora.enabled=true", "lora.rank=64"])
    with torch.device("meta"):
        tr.add_adapter(peft_lora_config(cfg.lora))
    adapters = adapter_shapes(tr)
    P = sum(math.prod(s) for s in adapters)
    assert 0 < P < FLUX_DEV_TRANSFORMER_PARAMS / 50
    W = FLUX_DEV_TRANSFORMER_PARAMS
    for n in (2, 8, 16):
        load = transformer_load(shapes, world=n, sharded=True, load_bytes=2, stored_bytes=2,
                                adapters=adapters)
        assert 2 * W / n <= load["parts"]["transformer shard (bf16, 1/n)"] <= 2 * W / n * 1.002, n
        assert load["host_parts"]["LoRA initial values (whole, bf16)"] == 2 * P < 0.5e9
        assert load["host"] < 2 * P + 2**30 / n


def test_plan_load_phase_per_path(tiny_model_dir):
    """FSDP on 2 ranks, full fine-tuning or LoRA: the device holds this rank's shards at load and the host
    only one tensor's rows of the transformer (+ a LoRA adapter's initial values); DDP reads the whole
    transformer on every rank. The plan's path is the trainer's (`model_load.sharded_load`)."""
    arch = ModelArch.from_folder(tiny_model_dir)
    shapes = tensor_shapes(arch.build("transformer"))
    W = sum(math.prod(s) for s in shapes)

    def plan(*over):
        cfg = TrainConfig.load("tiny_cpu", [f"model={tiny_model_dir}", *over])
        p = capacity_plan(cfg, local_pool(), device="cpu", nodes=2, arch=arch)
        assert p.facts["load_path"] == ("sharded" if sharded_load(cfg, p.world) else "whole"), over
        return p, {i.what: i for i in p.items}["load phase"].parts

    full, load = plan("distributed=fsdp", "lora.enabled=false")
    expected = transformer_load(shapes, world=2, sharded=True, load_bytes=4, stored_bytes=4)
    assert full.facts["load_path"] == "sharded" and full.world == 2
    assert load["transformer shard (fp32, 1/n)"] == expected["device"]
    assert full.facts["transformer_load_device_bytes"] == expected["device"]
    assert math.isclose(expected["device"], 4 * W / 2, rel_tol=0.01)
    assert full.facts["transformer_load_host_bytes"] == expected["host"] < 4 * W / 10
    assert "whole transformer in the load dtype" not in load

    lora, load = plan("distributed=fsdp", "lora.enabled=true", "mixed_precision=bf16")
    assert lora.facts["load_path"] == "sharded" and lora.facts["load_dtype"] == "bf16"
    assert "whole transformer in the load dtype" not in load
    assert math.isclose(load["transformer shard (bf16, 1/n)"], 2 * W / 2, rel_tol=0.01)
    adapter = load["LoRA adapter shard (fp32, 1/n)"]
    assert 0 < adapter < 4 * W / 2 / 10 and math.isclose(adapter, 4 * lora.facts["trainable_params"] / 2,
                                                         rel_tol=0.05)
    rows = transformer_load(shapes, world=2, sharded=True, load_bytes=2, stored_bytes=4)["host"]
    # one tensor's rows (fp32 files) + the adapter's bf16 initial values: no copy of the base
    assert lora.facts["transformer_load_host_bytes"] == rows + 2 * lora.facts["trainable_params"] < 2 * W / 2

    whole, load = plan("distributed=ddp", "lora.enabled=false")
    assert whole.facts["load_path"] == "whole"
    assert load["whole transformer in the load dtype"] == 4 * W  # CPU: fp32
    assert whole.facts["transformer_load_host_bytes"] == 4 * W

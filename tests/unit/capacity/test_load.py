"""The load phase of the capacity plan (chunkgrpo/capacity/load.py and its use in capacity.plan): shards
as FSDP pads them, the host's copies per load path, the stored dtype read from the file headers.
The measured side (per-rank memory at 1, 2 ranks under torchrun): tests/benchmarks/test_load_memory.py."""

from __future__ import annotations

import math
import shutil

import torch

from chunkgrpo.capacity.arch import FLUX_DEV, FLUX_DEV_TRANSFORMER_PARAMS, ModelArch
from chunkgrpo.capacity.load import frozen_host_bytes, stored_bytes, tensor_shapes, transformer_load
from chunkgrpo.capacity.plan import capacity_plan
from chunkgrpo.capacity.pool import local_pool
from chunkgrpo.train.config import TrainConfig


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


def test_plan_load_phase_per_path(tiny_model_dir):
    """FSDP full fine-tuning on 2 ranks: the device holds this rank's shard at load and the host only one
    tensor's rows of the transformer; DDP (and LoRA) read the whole transformer on every rank."""
    arch = ModelArch.from_folder(tiny_model_dir)
    shapes = tensor_shapes(arch.build("transformer"))
    W = sum(math.prod(s) for s in shapes)

    def plan(*over):
        cfg = TrainConfig.load("tiny_cpu", [f"model={tiny_model_dir}", *over])
        p = capacity_plan(cfg, local_pool(), device="cpu", nodes=2, arch=arch)
        return p, {i.what: i for i in p.items}["load phase"].parts

    full, load = plan("distributed=fsdp", "lora.enabled=false")
    expected = transformer_load(shapes, world=2, sharded=True, load_bytes=4, stored_bytes=4)
    assert full.facts["load_path"] == "sharded" and full.world == 2
    assert load["transformer shard (fp32, 1/n)"] == expected["device"]
    assert full.facts["transformer_load_device_bytes"] == expected["device"]
    assert math.isclose(expected["device"], 4 * W / 2, rel_tol=0.01)
    assert full.facts["transformer_load_host_bytes"] == expected["host"] < 4 * W / 10
    assert "whole transformer in the load dtype" not in load
    for over in (("distributed=ddp", "lora.enabled=false"), ("distributed=fsdp", "lora.enabled=true")):
        whole, load = plan(*over)
        assert whole.facts["load_path"] == "whole", over
        assert load["whole transformer in the load dtype"] == 4 * W  # CPU: fp32, LoRA's base too
        assert whole.facts["transformer_load_host_bytes"] == 4 * W

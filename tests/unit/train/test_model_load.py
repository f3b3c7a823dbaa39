"""The policy model's load paths (chunkgrpo/train/model_load.py): the sharded load of the transformer
(meta build, `fully_shard`, this rank's rows read from the safetensors files) gives exactly the weights of
the whole load, from fp32 and from bf16 files, with LoRA adapters initialised exactly as on the whole load
(same values, same random state after); bad folders fail in one line; the exported config names the
diffusers class. One process in a one-rank gloo group (the two-rank split: tests/integration)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.distributed as dist

from chunkgrpo.errors import UserError
from chunkgrpo.train import dist as D
from chunkgrpo.train.config import TrainConfig
from chunkgrpo.train.model_load import (
    add_lora_on_meta,
    base_dtype,
    load_sharded_policy_transformer,
    load_sharded_transformer,
    local_index,
    make_trainable,
    save_transformer_config,
    sharded_load,
    stored_name,
    transformer_weight_files,
)


@pytest.fixture
def group():
    """A one-rank gloo process group for this test."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _whole(model_dir) -> dict[str, torch.Tensor]:
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel.from_pretrained(model_dir / "transformer", dtype=torch.float32).state_dict()


def _shard(tr):
    tr.requires_grad_(True)
    D.shard_fsdp(tr, mixed_bf16=False)


def _gathered(tr) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in tr.state_dict().items()}


def test_sharded_load_equals_the_whole_load(tiny_model_dir, group):
    tr = load_sharded_transformer(tiny_model_dir, torch.device("cpu"), _shard)
    params = list(tr.parameters())
    assert all(type(p).__name__ == "DTensor" and p.requires_grad for p in params)  # sharded, trainable
    assert not tr.training
    ref, got = _whole(tiny_model_dir), _gathered(tr)
    assert got.keys() == ref.keys()
    assert [k for k in ref if got[k].dtype != torch.float32 or not torch.equal(got[k], ref[k])] == []


def test_bf16_files_load_as_the_whole_load_casts_them(tiny_model_dir, group, tmp_path):
    """FLUX.1-dev stores bf16: each rank's rows are cast to fp32 on copy, exactly as from_pretrained does."""
    from safetensors.torch import load_file, save_file

    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    f = model / "transformer" / "diffusion_pytorch_model.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(str(f)).items()}, str(f),
              metadata={"format": "pt"})
    ref, got = _whole(model), _gathered(load_sharded_transformer(model, torch.device("cpu"), _shard))
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    assert any(not torch.equal(got[k], load_file(str(tiny_model_dir / "transformer" / f.name))[k])
               for k in ref)  # the bf16 rounding is really there


def test_index_of_a_split_checkpoint_is_followed(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    folder = model / "transformer"
    weights = load_file(str(folder / "diffusion_pytorch_model.safetensors"))
    (folder / "diffusion_pytorch_model.safetensors").unlink()
    names = sorted(weights)
    halves = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for file, keys in halves.items():
        save_file({k: weights[k] for k in keys}, str(folder / file))
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: f for f, keys in halves.items() for k in keys}}))
    files = transformer_weight_files(model)
    assert {p.name for p in files.values()} == set(halves) and set(files) == set(names)


def test_missing_and_misshapen_tensors_are_one_line_errors(tiny_model_dir, group, tmp_path):
    from safetensors.torch import load_file, save_file

    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    f = model / "transformer" / "diffusion_pytorch_model.safetensors"
    weights = load_file(str(f))
    name = sorted(k for k, v in weights.items() if v.ndim == 2)[0]
    save_file({k: v for k, v in weights.items() if k != name}, str(f))
    with pytest.raises(UserError, match=f"lack 1 tensor.*{name}"):
        load_sharded_transformer(model, torch.device("cpu"), _shard)
    save_file({**weights, name: weights[name][:, :-1].contiguous()}, str(f))
    with pytest.raises(UserError, match=f"tensor {name} is stored with shape"):
        load_sharded_transformer(model, torch.device("cpu"), _shard)
    f.unlink()
    with pytest.raises(UserError, match="has no transformer/diffusion_pytorch_model.safetensors"):
        transformer_weight_files(model)


def test_local_index_of_a_plain_tensor_is_the_whole_tensor():
    assert local_index(torch.zeros(3, 4)) == (slice(None), slice(None))


def test_exported_config_names_the_diffusers_class(tiny_model_dir, group, tmp_path):
    """FSDP swaps the module's class for `FSDPFluxTransformer2DModel`; the folder must load as FLUX."""
    from diffusers import FluxTransformer2DModel

    tr = load_sharded_transformer(tiny_model_dir, torch.device("cpu"), _shard)
    assert type(tr).__name__ == "FSDPFluxTransformer2DModel"
    save_transformer_config(tr, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    original = json.loads((tiny_model_dir / "transformer" / "config.json").read_text())
    assert saved["_class_name"] == "FluxTransformer2DModel"
    assert {k: v for k, v in saved.items() if k != "_name_or_path"} == {
        k: v for k, v in original.items() if k != "_name_or_path"}
    assert FluxTransformer2DModel.from_config(FluxTransformer2DModel.load_config(tmp_path)) is not None


@pytest.mark.parametrize("over,world,expected", [
    (["distributed=fsdp", "lora.enabled=false"], 2, True),
    (["distributed=fsdp", "lora.enabled=false"], 1, False),   # one process: nothing to shard
    (["distributed=fsdp", "lora.enabled=true"], 2, True),     # LoRA's frozen base too
    (["distributed=fsdp", "lora.enabled=true"], 1, False),
    (["distributed=ddp", "lora.enabled=false"], 2, False),
])
def test_which_runs_load_sharded(tiny_model_dir, over, world, expected):
    cfg = TrainConfig.load("tiny_cpu", [f"model={tiny_model_dir}", *over])
    assert sharded_load(cfg, world) is expected


def _whole_lora(model_dir, cfg, bf16):
    """The whole load of a LoRA policy under FSDP: the transformer read in its load dtype, seeded, adapted,
    sharded (as `load_policy_model` did for every LoRA run); returns it and the host random state after."""
    from diffusers import FluxTransformer2DModel

    tr = FluxTransformer2DModel.from_pretrained(model_dir / "transformer", dtype=base_dtype(cfg, bf16)).eval()
    torch.manual_seed(cfg.seed)
    make_trainable(tr, cfg)
    after = torch.get_rng_state()
    D.shard_fsdp(tr, mixed_bf16=bf16)
    return tr, after


@pytest.mark.parametrize("bf16,init", [(False, "default"), (True, "default"), (True, "gaussian")])
def test_sharded_lora_load_equals_the_whole_load(tiny_model_dir, group, bf16, init):
    """Base weights, adapter initial values (peft's Kaiming-uniform or Gaussian A, zero B, cast through
    the bf16 base as peft casts them), dtypes, grad flags, module modes and the host random state after the
    load: all identical to the whole load's at the same seed."""
    cfg = TrainConfig.load("tiny_cpu", [f"model={tiny_model_dir}", "distributed=fsdp", "seed=11",
                                        f"lora.init={init}"])
    torch.manual_seed(123)  # whatever came before: both paths seed
    ref, ref_rng = _whole_lora(tiny_model_dir, cfg, bf16)
    torch.manual_seed(456)
    got, got_rng = load_sharded_policy_transformer(cfg, str(tiny_model_dir), torch.device("cpu"), bf16)
    assert torch.equal(got_rng, ref_rng)
    r, g = _gathered(ref), _gathered(got)
    assert g.keys() == r.keys() and any("lora_A" in k for k in r) and any(".base_layer." in k for k in r)
    assert [k for k in r if g[k].dtype != r[k].dtype or not torch.equal(g[k], r[k])] == []
    lora_a = next(k for k in r if "lora_A" in k)
    assert r[lora_a].dtype == torch.float32 and r[lora_a].abs().max() > 0  # drawn, fp32 master
    if bf16:  # the initial values went through the bf16 base's dtype, as peft casts them
        assert torch.equal(r[lora_a], r[lora_a].bfloat16().float())
        assert r[stored_name(lora_a).replace("lora_A.default.", "base_layer.")].dtype == torch.bfloat16
    named_r, named_g = dict(ref.named_parameters()), dict(got.named_parameters())
    assert {n: p.requires_grad for n, p in named_g.items()} == {n: p.requires_grad
                                                                for n, p in named_r.items()}
    assert {n: m.training for n, m in got.named_modules()} == {n: m.training
                                                               for n, m in ref.named_modules()}
    assert all(type(p).__name__ == "DTensor" for p in named_g.values())


def test_lora_on_meta_keeps_the_base_on_meta_and_the_draws_on_the_host(tiny_model_dir):
    from diffusers import FluxTransformer2DModel

    cfg = TrainConfig.load("tiny_cpu", [f"model={tiny_model_dir}"])
    config = FluxTransformer2DModel.load_config(tiny_model_dir / "transformer")
    with torch.device("meta"):
        tr = FluxTransformer2DModel.from_config(config)
    initial = add_lora_on_meta(tr, cfg)
    assert all(p.is_meta for p in tr.parameters())
    assert set(initial) == {n for n, _ in tr.named_parameters() if "lora_" in n}
    assert all(not v.is_meta for v in initial.values())
    b = next(v for k, v in initial.items() if "lora_B" in k)
    assert not b.any()  # B starts at zero
    bad = TrainConfig.load("tiny_cpu", [f"model={tiny_model_dir}", "lora.targets=[no_such_module]"])
    with torch.device("meta"):
        tr = FluxTransformer2DModel.from_config(config)
    with pytest.raises(UserError, match="no_such_module"):
        add_lora_on_meta(tr, bad)
    assert all(p.is_meta for p in tr.parameters())  # the stand-ins are gone after a failure too


def test_stored_name_drops_peft_base_layer():
    assert stored_name("blocks.0.attn.to_q.base_layer.weight") == "blocks.0.attn.to_q.weight"
    assert stored_name("proj_out.bias") == "proj_out.bias"

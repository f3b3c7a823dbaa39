"""The policy model on each rank: the transformer made trainable (LoRA or full), distributed, and the
frozen components around it.

Two load paths, chosen by `sharded_load(cfg, world)`:

* **Sharded** (FSDP full fine-tuning on more than one rank). The transformer is built on the meta device
  (shapes only), made trainable, gradient-checkpointed and sharded there (`dist.shard_fsdp`); then each
  rank allocates its own shards (`to_empty`) and fills them from the folder's safetensors files, reading
  only its rows of each tensor through a memory map (`safe_open(...).get_slice`, per the DTensor's
  `Shard` placement). No rank holds the whole transformer, on its device or on the host: device memory
  for the transformer is 4·W/n bytes (fp32 master shards, FSDP's padding included) and the host holds
  no copy of it, only one tensor's rows in transit (`chunkgrpo.capacity.load`). The file pages it reads
  are page cache (shared by the node's ranks, reclaimable), not process memory. The frozen components
  (text encoders, VAE) are read in their own dtype (`load_flux(frozen_dtype=)`).
* **Whole** (single process, DDP, LoRA): the whole pipeline is read by `load_flux` (the transformer in its
  load dtype, the frozen components in theirs), made trainable, then sharded (LoRA under FSDP) or
  broadcast from rank 0.

Both paths end with the global random state seeded by `cfg.seed` after the LoRA initialisation, and
reward models are loaded afterwards by the trainer (`Trainer.setup`), so the load never has them and the
transformer on a device at once.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from chunkgrpo.errors import UserError
from chunkgrpo.train import dist as D

WEIGHTS = "diffusion_pytorch_model.safetensors"


def sharded_load(cfg, world: int) -> bool:
    """Whether the transformer is built sharded: FSDP full fine-tuning on more than one rank. (LoRA under
    FSDP reads its bf16 base whole: the adapter's initialisation draws from the global random stream in
    module order, which a meta-device build would not reproduce.)"""
    return cfg.distributed == "fsdp" and world > 1 and not cfg.lora.enabled


def transformer_weight_files(path: str | Path) -> dict[str, Path]:
    """{tensor name: safetensors file} of a diffusers pipeline folder's transformer (one file, or the
    shards listed by its index)."""
    from safetensors import safe_open

    folder = Path(path) / "transformer"
    index = folder / f"{WEIGHTS}.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UserError(f"{index} is not a readable safetensors index ({type(e).__name__})") from None
        return {k: folder / f for k, f in weight_map.items()}
    single = folder / WEIGHTS
    if not single.is_file():
        raise UserError(f"model dir {path} has no transformer/{WEIGHTS} (or its .index.json); sharded "
                        "loading reads diffusers safetensors weights")
    with safe_open(str(single), framework="pt", device="cpu") as f:
        return {k: single for k in f.keys()}


def local_index(tensor: torch.Tensor) -> tuple[slice, ...] | None:
    """This rank's part of `tensor`'s global tensor as an index of slices (the whole tensor when it is not
    a DTensor or is replicated), or None when the rank holds no rows of it. A `Shard(d)` placement splits
    dim d as `torch.chunk` does (FSDP's split: ⌈size/n⌉ rows per rank, the last ranks short or empty)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    index = [slice(None)] * tensor.ndim
    if not isinstance(tensor, DTensor):
        return tuple(index)
    local_shape = tensor.to_local().shape
    coordinate = tensor.device_mesh.get_coordinate()
    sharded_dims = set()
    for mesh_dim, placement in enumerate(tensor.placements):
        if isinstance(placement, Replicate):
            continue
        d = placement.dim % tensor.ndim if isinstance(placement, Shard) else None
        if d is None or d in sharded_dims:
            raise NotImplementedError(f"placement {tensor.placements} (one Shard per tensor dim supported)")
        sharded_dims.add(d)
        size, n = tensor.shape[d], tensor.device_mesh.size(mesh_dim)
        step = -(-size // n)
        start = min(size, coordinate[mesh_dim] * step)
        end = min(size, start + step)
        if end - start != local_shape[d]:
            raise RuntimeError(f"local shard of dim {d} has {local_shape[d]} rows, expected {end - start}")
        if end == start:
            return None
        index[d] = slice(start, end)
    return tuple(index)


@torch.no_grad()
def load_local_shards(module: torch.nn.Module, files: dict[str, Path], where: str = "") -> int:
    """Fill every tensor of `module`'s state dict (DTensor shards or plain tensors, already allocated)
    with this rank's part of the same-named tensor in `files`, read through a memory map and cast on copy.
    Returns the bytes copied into the module. A tensor the files lack is a UserError naming it."""
    from safetensors import safe_open

    state = module.state_dict()
    persistent = set(state)
    transient = [n for n, _ in module.named_buffers() if n not in persistent]
    if transient:  # after to_empty they would hold garbage, and the files cannot restore them
        raise NotImplementedError(f"non-persistent buffers {transient[:3]} cannot be loaded from weights")
    missing = sorted(set(state) - set(files))
    if missing:
        raise UserError(f"model {where or 'folder'}: the transformer's weights lack {len(missing)} tensor(s) "
                        f"of its config, e.g. {missing[0]}")
    by_file: dict[Path, list[str]] = {}
    for name in state:
        by_file.setdefault(files[name], []).append(name)
    copied = 0
    for file, names in sorted(by_file.items()):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in names:
                target = state[name]
                local = target.to_local() if hasattr(target, "to_local") else target
                index = local_index(target)
                if index is None:
                    continue
                stored = f.get_slice(name)
                if list(stored.get_shape()) != list(target.shape):
                    raise UserError(f"model {where or 'folder'}: tensor {name} is stored with shape "
                                    f"{stored.get_shape()}, the config makes it {list(target.shape)}")
                local.copy_(stored[index] if target.ndim else f.get_tensor(name))
                copied += local.numel() * local.element_size()
    return copied


def load_sharded_transformer(path: str | Path, device: torch.device, prepare) -> torch.nn.Module:
    """The folder's transformer in fp32, built on the meta device, passed to `prepare(transformer)` there
    (grad flags, checkpointing, `fully_shard`), then given this rank's storage on `device` and filled with
    this rank's rows of the stored weights."""
    from diffusers import FluxTransformer2DModel

    folder = Path(path) / "transformer"
    config = FluxTransformer2DModel.load_config(folder)
    with torch.device("meta"):
        tr = FluxTransformer2DModel.from_config(config)
    if any(p.dtype != torch.float32 for p in tr.parameters()):  # a non-default default dtype
        tr.to(torch.float32)
    tr.register_to_config(_name_or_path=str(folder))  # as `from_pretrained` records it
    prepare(tr)
    tr.to_empty(device=device)
    load_local_shards(tr, transformer_weight_files(path), str(path))
    return tr.eval()


def save_transformer_config(tr: torch.nn.Module, folder: Path) -> None:
    """`tr.save_config(folder)` naming the diffusers class: FSDP's wrapper class (`FSDP<name>`) would make
    `_class_name` a class that diffusers cannot load the folder as."""
    from torch.distributed.fsdp import FSDPModule

    tr.save_config(folder)
    if isinstance(tr, FSDPModule):
        path = Path(folder) / "config.json"
        config = json.loads(path.read_text(encoding="utf-8"))
        config["_class_name"] = next(c.__name__ for c in type(tr).__mro__[1:]
                                     if not issubclass(c, FSDPModule) and issubclass(c, torch.nn.Module))
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def peft_lora_config(lc):
    """peft's LoraConfig for `lora` (LoraConfig of this package): rank, alpha, dropout, targets and the A
    initialisation (`default`: peft's Kaiming-uniform; `gaussian`: N(0, (1/r)²), TempFlow-GRPO's)."""
    from peft import LoraConfig

    return LoraConfig(
        r=lc.rank,
        lora_alpha=lc.alpha,
        lora_dropout=lc.dropout,
        target_modules=list(lc.targets),
        init_lora_weights=True if lc.init == "default" else "gaussian",
    )


def _make_trainable(tr, cfg) -> None:
    """LoRA adapters (the only trainable parameters) or the whole transformer; fp32 for what trains."""
    if cfg.lora.enabled:
        try:
            tr.add_adapter(peft_lora_config(cfg.lora))
        except ValueError as e:  # peft's NoMatchingPeftModuleError is a ValueError
            raise UserError(f"lora.targets={list(cfg.lora.targets)} match no module of the transformer "
                            f"({str(e).splitlines()[0][:200]})") from None
        for n, p in tr.named_parameters():
            p.requires_grad_("lora_" in n)
    else:
        tr.requires_grad_(True)
    for p in tr.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()  # fp32 master weights for everything trained
    if not any(p.requires_grad for p in tr.parameters()):
        raise UserError(
            f"no trainable parameters: lora.targets {cfg.lora.targets} match no module of the transformer"
        )
    if cfg.gradient_checkpointing:
        tr.enable_gradient_checkpointing()


def load_policy_model(cfg, info: D.DistInfo, model_path: str, bf16: bool):
    """The `FluxModel` whose transformer this rank trains: trainable, sharded (FSDP) or identical on every
    rank (broadcast from rank 0), on `info.device`."""
    from chunkgrpo.flux import load_flux

    dev = info.device
    frozen_dtype = torch.bfloat16 if bf16 else None  # text encoders + VAE, also for full fine-tuning
    if sharded_load(cfg, info.world):
        def prepare(tr):
            _make_trainable(tr, cfg)
            D.shard_fsdp(tr, mixed_bf16=bf16)

        tr = load_sharded_transformer(model_path, dev, prepare)
        model = load_flux(model_path, device=dev, dtype=torch.float32, frozen_dtype=frozen_dtype,
                          transformer=tr)
        torch.manual_seed(cfg.seed)  # the global random state every path leaves
        return model
    base_dtype = torch.bfloat16 if (bf16 and cfg.lora.enabled) else torch.float32
    model = load_flux(model_path, device=dev, dtype=base_dtype, frozen_dtype=frozen_dtype)
    tr = model.transformer
    torch.manual_seed(cfg.seed)  # identical LoRA init on every rank
    _make_trainable(tr, cfg)
    if cfg.distributed == "fsdp" and info.enabled:
        D.shard_fsdp(tr, mixed_bf16=bf16)  # chunk/step methods then train whole units (train/grpo.py)
    else:
        D.broadcast_params(tr)
    return model

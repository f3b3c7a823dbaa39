"""The policy model on each rank: the transformer made trainable (LoRA or full), distributed, and the
frozen components around it.

Two load paths, chosen by `sharded_load(cfg, world)`:

* **Sharded** (FSDP on more than one rank, LoRA or full fine-tuning). The transformer is built on the meta
  device (shapes only) in its load dtype (`base_dtype`), made trainable, gradient-checkpointed and sharded
  there (`dist.shard_fsdp`); then each rank allocates its own shards (`to_empty`) and fills them from the
  folder's safetensors files, reading only its rows of each tensor through a memory map
  (`safe_open(...).get_slice`, per the DTensor's `Shard` placement). No rank holds the whole transformer,
  on its device or on the host: device memory for the transformer is W·b/n bytes (fp32 master shards for
  full fine-tuning, the bf16 or fp32 base plus fp32 adapter shards for LoRA; FSDP's padding included) and
  the host holds no copy of it, only one tensor's rows in transit (`chunkgrpo.capacity.load`). The file
  pages it reads are page cache (shared by the node's ranks, reclaimable), not process memory. The frozen
  components (text encoders, VAE) are read in their own dtype (`load_flux(frozen_dtype=)`).
  LoRA adapters are added on the meta device with the initial values of the whole load
  (`add_lora_on_meta`): the same seed, the same draws from the host's generator in the same module order,
  the same cast to the base's dtype; each rank keeps the whole adapter's initial values on the host (a
  few hundred MB for FLUX.1-dev) until its shards of them are filled.
* **Whole** (single process, DDP): the whole pipeline is read by `load_flux` (the transformer in its load
  dtype, the frozen components in theirs), made trainable, then broadcast from rank 0.

Both paths end with the global random state of the whole load: seeded by `cfg.seed`, then advanced by the
LoRA initialisation's draws; reward models are loaded afterwards by the trainer (`Trainer.setup`), so the
load never has them and the transformer on a device at once.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from chunkgrpo.errors import UserError
from chunkgrpo.train import dist as D

WEIGHTS = "diffusion_pytorch_model.safetensors"


def sharded_load(cfg, world: int) -> bool:
    """Whether the transformer is built sharded: FSDP (LoRA or full fine-tuning) on more than one rank."""
    return cfg.distributed == "fsdp" and world > 1


def base_dtype(cfg, bf16: bool) -> torch.dtype:
    """The transformer's load dtype: bf16 for a LoRA base under bf16 mixed precision, else fp32 (full
    fine-tuning's master weights)."""
    return torch.bfloat16 if (bf16 and cfg.lora.enabled) else torch.float32


def stored_name(name: str) -> str:
    """The stored tensor a parameter of an adapted module is read from: peft moves each adapted layer's
    own weights under `base_layer`."""
    return name.replace(".base_layer.", ".")


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
def load_local_shards(module: torch.nn.Module, files: dict[str, Path], where: str = "",
                      initial: dict[str, torch.Tensor] | None = None) -> int:
    """Fill every tensor of `module`'s state dict (DTensor shards or plain tensors, already allocated)
    with this rank's part of the same-named tensor in `initial` (whole tensors: an adapter's initial
    values) or else of the tensor `stored_name(name)` in `files`, read through a memory map; cast on copy.
    Returns the bytes copied into the module. A tensor the files lack is a UserError naming it."""
    from safetensors import safe_open

    initial = initial or {}
    state = module.state_dict()
    persistent = set(state)
    transient = [n for n, _ in module.named_buffers() if n not in persistent]
    if transient:  # after to_empty they would hold garbage, and the files cannot restore them
        raise NotImplementedError(f"non-persistent buffers {transient[:3]} cannot be loaded from weights")
    missing = sorted(stored_name(n) for n in state if n not in initial and stored_name(n) not in files)
    if missing:
        raise UserError(f"model {where or 'folder'}: the transformer's weights lack {len(missing)} tensor(s) "
                        f"of its config, e.g. {missing[0]}")
    copied = 0
    for name, target in state.items():
        if name in initial:
            index = local_index(target)
            if index is not None:
                local = target.to_local() if hasattr(target, "to_local") else target
                local.copy_(initial[name][index])
                copied += local.numel() * local.element_size()
    by_file: dict[Path, list[str]] = {}
    for name in state:
        if name not in initial:
            by_file.setdefault(files[stored_name(name)], []).append(name)
    for file, names in sorted(by_file.items()):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in names:
                target = state[name]
                local = target.to_local() if hasattr(target, "to_local") else target
                index = local_index(target)
                if index is None:
                    continue
                key = stored_name(name)
                stored = f.get_slice(key)
                if list(stored.get_shape()) != list(target.shape):
                    raise UserError(f"model {where or 'folder'}: tensor {key} is stored with shape "
                                    f"{stored.get_shape()}, the config makes it {list(target.shape)}")
                local.copy_(stored[index] if target.ndim else f.get_tensor(key))
                copied += local.numel() * local.element_size()
    return copied


def load_sharded_transformer(path: str | Path, device: torch.device, prepare,
                             dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The folder's transformer in `dtype`, built on the meta device in eval mode (as `from_pretrained`
    returns it), passed to `prepare(transformer)` there (adapters, grad flags, checkpointing,
    `fully_shard`), then given this rank's storage on `device` and filled with this rank's rows of the
    stored weights. `prepare` may return {name: whole tensor} for the tensors the files do not hold (an
    adapter's initial values, `add_lora_on_meta`)."""
    from diffusers import FluxTransformer2DModel

    folder = Path(path) / "transformer"
    config = FluxTransformer2DModel.load_config(folder)
    with torch.device("meta"):
        tr = FluxTransformer2DModel.from_config(config)
    if any(p.dtype != dtype for p in tr.parameters()):  # torch.nn's cast: diffusers' warns about fp32 modules
        torch.nn.Module.to(tr, dtype)
    tr.register_to_config(_name_or_path=str(folder))  # as `from_pretrained` records it
    tr.eval()
    initial = prepare(tr) or {}
    tr.to_empty(device=device)
    load_local_shards(tr, transformer_weight_files(path), str(path), initial)
    return tr


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


def _add_adapter(tr, cfg) -> None:
    try:
        tr.add_adapter(peft_lora_config(cfg.lora))
    except ValueError as e:  # peft's NoMatchingPeftModuleError is a ValueError
        raise UserError(f"lora.targets={list(cfg.lora.targets)} match no module of the transformer "
                        f"({str(e).splitlines()[0][:200]})") from None


def _finish_trainable(tr, cfg) -> None:
    """Grad flags (only the adapter's under LoRA), fp32 for what trains, gradient checkpointing."""
    if cfg.lora.enabled:
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


def make_trainable(tr, cfg) -> None:
    """LoRA adapters (the only trainable parameters; their initial values drawn from the global random
    state) or the whole transformer; fp32 for what trains."""
    if cfg.lora.enabled:
        _add_adapter(tr, cfg)
    _finish_trainable(tr, cfg)


def add_lora_on_meta(tr, cfg) -> dict[str, torch.Tensor]:
    """Add the LoRA adapters to the meta-device transformer `tr`, their parameters left on meta, and return
    {parameter name: whole initial value, on the host, in the base's dtype}: exactly the values
    `make_trainable` gives a loaded transformer from the same global random state, which it advances
    alike. peft creates each adapter's layers on the host, draws their values from the global generator,
    then moves them to the device and dtype of the adapted layer's weight; while it does, every meta weight
    is a host tensor of its shape and dtype over one element of storage, so the draws stay on the host
    and are cast as the whole load casts them."""
    meta_weights = []
    for module in tr.modules():
        w = module._parameters.get("weight")
        if w is not None and w.is_meta:
            module._parameters["weight"] = torch.nn.Parameter(torch.empty((), dtype=w.dtype).expand(w.shape),
                                                              requires_grad=False)
            meta_weights.append((module, w))
    try:
        _add_adapter(tr, cfg)
    finally:
        for module, w in meta_weights:
            module._parameters["weight"] = w
    initial = {}
    for module_name, module in tr.named_modules():
        for name, p in list(module._parameters.items()):
            if p is None or p.is_meta:
                continue
            full = f"{module_name}.{name}" if module_name else name
            if "lora_" not in full:
                raise RuntimeError(f"parameter {full} left the meta device while the adapters were added")
            initial[full] = p.detach()
            module._parameters[name] = torch.nn.Parameter(p.detach().to("meta"),
                                                          requires_grad=p.requires_grad)
    if not initial:
        raise RuntimeError("peft created the LoRA adapters on the meta device: their initial values are lost")
    return initial


def load_sharded_policy_transformer(cfg, model_path: str, device: torch.device, bf16: bool):
    """(transformer, host random state after the LoRA draws or None): the sharded load of
    `load_policy_model`, with the adapters initialised as on the whole path (seeded by `cfg.seed` first)."""
    after_lora: list[torch.Tensor] = []

    def prepare(tr):
        initial = {}
        if cfg.lora.enabled:
            torch.manual_seed(cfg.seed)  # as the whole path before its adapters: identical on every rank
            initial = add_lora_on_meta(tr, cfg)
            after_lora.append(torch.get_rng_state())
        _finish_trainable(tr, cfg)
        D.shard_fsdp(tr, mixed_bf16=bf16)
        return initial

    tr = load_sharded_transformer(model_path, device, prepare, dtype=base_dtype(cfg, bf16))
    return tr, (after_lora[0] if after_lora else None)


def load_policy_model(cfg, info: D.DistInfo, model_path: str, bf16: bool):
    """The `FluxModel` whose transformer this rank trains: trainable, sharded (FSDP) or identical on every
    rank (broadcast from rank 0), on `info.device`."""
    from chunkgrpo.flux import load_flux

    dev = info.device
    frozen_dtype = torch.bfloat16 if bf16 else None  # text encoders + VAE, also for full fine-tuning
    dtype = base_dtype(cfg, bf16)
    if sharded_load(cfg, info.world):
        tr, after_lora = load_sharded_policy_transformer(cfg, model_path, dev, bf16)
        model = load_flux(model_path, device=dev, dtype=dtype, frozen_dtype=frozen_dtype, transformer=tr)
        # the global random state the whole path leaves: seeded, then advanced by the adapters' host draws
        torch.manual_seed(cfg.seed)
        if after_lora is not None:
            torch.set_rng_state(after_lora)
        return model
    model = load_flux(model_path, device=dev, dtype=dtype, frozen_dtype=frozen_dtype)
    tr = model.transformer
    torch.manual_seed(cfg.seed)  # identical LoRA init on every rank
    make_trainable(tr, cfg)
    if cfg.distributed == "fsdp" and info.enabled:  # the whole load under FSDP (when not `sharded_load`)
        D.shard_fsdp(tr, mixed_bf16=bf16)
    else:
        D.broadcast_params(tr)
    return model

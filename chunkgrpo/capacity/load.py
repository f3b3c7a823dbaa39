"""The load phase of the capacity plan: what one rank holds while the transformer is loaded, on its device
and on the host, for the two load paths of `chunkgrpo.train.model_load`.

With n ranks, W transformer parameters, `b` bytes per parameter as loaded (4 for fp32 master weights; 2
for a LoRA base under bf16) and P LoRA adapter parameters (0 for full fine-tuning):

* **sharded** (FSDP on more than one rank, LoRA or full fine-tuning): the device holds this rank's shards
  only, Σ_tensors b·⌈d0/n⌉·(d1·…) bytes (FSDP splits dim 0 as `torch.chunk` and pads every rank's shard
  to ⌈d0/n⌉ rows), ≈ b·W/n, + the adapter's fp32 shards ≈ 4·P/n. The host holds no copy of the
  transformer: only one tensor's rows in transit, read from the memory-mapped file in the stored dtype
  (the largest ⌈d0/n⌉·(d1·…)·b_stored), and, with LoRA, the adapter's whole initial values in the base's
  dtype (b·P), drawn on the host and kept until this rank's shards of them are filled. The file pages read
  are page cache, shared by the node's ranks and reclaimable, and not counted.
* **whole** (single process, DDP): every rank reads the whole transformer in the load dtype on the host,
  then moves it to its device: W·b on the host and W·b on the device (the same bytes on the CPU),
  + under FSDP (the path the sharded load replaced) the shards `fully_shard` copies out of it, ≈ W·b/n.

The frozen components (text encoders, VAE) are read in their own dtype on every path; transformers keeps
T5's `wo` projections in fp32 while loading them (`frozen_host_bytes`), and `load_flux` casts them before
they reach the device.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch

DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4}


def stored_bytes(folder: str | Path, default: int = 4) -> int:
    """Bytes per element of the transformer's stored weights (the widest float dtype in its safetensors
    headers; headers only are read), or `default` when the folder has none."""
    root = Path(folder) / "transformer"
    widest = 0
    for f in sorted(root.glob("*.safetensors")):
        with open(f, "rb") as fp:
            (n,) = struct.unpack("<Q", fp.read(8))
            header = json.loads(fp.read(n))
        widest = max([widest] + [DTYPE_BYTES.get(v.get("dtype"), 0) for k, v in header.items()
                                 if k != "__metadata__"])
    return widest or default


def _rows(shape: torch.Size, n: int) -> int:
    """Elements of one rank's (padded) shard of a tensor of `shape` split on dim 0 over n ranks."""
    if not len(shape):
        return 1
    return math.ceil(shape[0] / n) * math.prod(shape[1:])


def tensor_shapes(tr: torch.nn.Module) -> list[torch.Size]:
    """The shapes of the tensors the load fills: `tr`'s state dict (on meta: no memory)."""
    return [t.shape for t in tr.state_dict().values()]


def adapter_shapes(tr: torch.nn.Module) -> list[torch.Size]:
    """The shapes of the LoRA adapter's tensors of an adapted (meta) transformer; [] without adapters."""
    return [t.shape for n, t in tr.state_dict().items() if "lora_" in n]


def transformer_load(shapes: list[torch.Size], *, world: int, sharded: bool, load_bytes: int,
                     stored_bytes: int, fsdp: bool = False, adapters: list[torch.Size] = ()) -> dict:
    """Per-rank bytes of the transformer while it loads, from the shapes of its base tensors
    (`tensor_shapes`) and of its LoRA adapter's (`adapter_shapes`; fp32): {"device", "host", "parts" (the
    device's), "host_parts", "cpu"}. `cpu` is the rank's total when its device is the host (a CPU run): the
    sharded load's shards, rows in transit and adapter initial values; the whole load's one copy, which is
    both. `fsdp` (whole load): the shards FSDP copies out of the whole transformer while it is still held
    (an upper bound: each whole tensor is freed once its shard exists)."""
    W = sum(math.prod(s) for s in shapes)
    P = sum(math.prod(s) for s in adapters)
    name = {4: "fp32", 2: "bf16"}.get(load_bytes, f"{load_bytes} bytes")
    if sharded:
        base = sum(_rows(s, world) for s in shapes) * load_bytes
        parts = {f"transformer shard ({name}, 1/n)": base}
        if adapters:
            parts["LoRA adapter shard (fp32, 1/n)"] = sum(_rows(s, world) for s in adapters) * 4
        host_parts = {"one tensor's rows in transit": max(_rows(s, world) for s in shapes) * stored_bytes}
        if adapters:
            host_parts[f"LoRA initial values (whole, {name})"] = P * load_bytes
        device, host = sum(parts.values()), sum(host_parts.values())
        return {"device": device, "host": host, "cpu": device + host, "parts": parts,
                "host_parts": host_parts}
    whole = W * load_bytes
    parts = {"whole transformer in the load dtype": whole}
    if adapters:  # added once the transformer is on its device
        parts["LoRA adapter (fp32)"] = P * 4
    if fsdp and world > 1:
        parts["FSDP shards copied from it"] = (sum(_rows(s, world) for s in shapes) * load_bytes
                                               + sum(_rows(s, world) for s in adapters) * 4)
    device = sum(parts.values())
    return {"device": device, "host": whole, "cpu": device, "parts": parts,
            "host_parts": {"whole transformer in the load dtype": whole}}


def frozen_host_bytes(t5: torch.nn.Module, frozen_bytes: int) -> int:
    """Extra host bytes of reading T5 in a 2-byte dtype: its `_keep_in_fp32_modules` (`wo`) load in fp32."""
    if frozen_bytes >= 4:
        return 0
    keep = tuple(getattr(type(t5), "_keep_in_fp32_modules", None) or ())
    extra = sum(p.numel() for n, p in t5.named_parameters() if any(f".{k}." in f".{n}" for k in keep))
    return extra * (4 - frozen_bytes)

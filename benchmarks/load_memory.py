"""Per-rank memory of loading the transformer under FSDP, at 1, 2 and 4 CPU ranks (gloo), for the sharded
load (`chunkgrpo.train.model_load`) and the whole load it replaces, against the capacity plan's load-phase
terms (`chunkgrpo.capacity.load`). Full fine-tuning by default (fp32 master weights); `--lora`: a LoRA
policy as a GPU run loads it (bf16 base, FSDP's bf16 mixed precision, fp32 adapters: rank 32 on the
attention projections, `LORA`), through `model_load.load_sharded_policy_transformer` and, for the whole
load, the transformer read in bf16, adapted (`model_load.make_trainable`) and sharded.

    .venv/bin/python benchmarks/load_memory.py                     # mid model, 1 2 4 ranks, both paths
    .venv/bin/python benchmarks/load_memory.py --lora              # the same for a LoRA policy
    .venv/bin/python benchmarks/load_memory.py --size tiny --worlds 1 2 --paths sharded

Each (path, world) runs under `torchrun` (`chunkgrpo.torchrun_local`, one thread per rank). Every rank
imports everything and joins the process group first, then measures only the transformer's load:

* `anon_peak`: the peak of the process's anonymous resident memory above its value before (RssAnon,
  sampled every 0.5 ms by a thread) while the transformer is built, sharded and filled: the memory the
  rank owns, whoever allocated it. On the CPU the rank's device is the host, so the plan's prediction
  (`predicted`, the `cpu` total of `capacity.load.transformer_load`) is the shard plus one tensor's rows
  in transit (+ with LoRA the adapter's shard and its whole initial values) for the sharded load, and the
  one whole copy plus FSDP's shards for the whole load. (torch's profiler would count the memory maps
  safetensors opens as allocations of the whole file.) With `--lora` every rank joins a process group,
  one rank's too: the sharded load always runs `fully_shard`.
* `hwm`: VmHWM above the RSS before (reset through /proc/self/clear_refs): anonymous memory plus the
  file pages of the safetensors files mapped while they are read (page cache; shared and reclaimable).

Prints one JSON object: per row the ranks' maxima, the prediction, their ratio, and the fit of
`anon_peak` against a + b/world over the sharded rows.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _status(key: str) -> int:
    with open("/proc/self/status") as fp:
        for line in fp:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


class AnonSampler:
    """Peak of RssAnon, sampled every `interval` seconds in a thread."""

    def __init__(self, interval: float = 0.0005):
        self.interval, self.peak, self._stop = interval, _status("RssAnon"), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _status("RssAnon"))
            time.sleep(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _status("RssAnon"))


# The LoRA of `--lora`: LoraConfig's defaults (rank 32, alpha 64, FLUX's attention projections)
LORA = ["lora.enabled=true", "lora.rank=32", "lora.alpha=64",
        "lora.targets=[to_q,to_k,to_v,to_out.0,add_q_proj,add_k_proj,add_v_proj,to_add_out]"]


def lora_config(model: str):
    from chunkgrpo.train.config import TrainConfig

    return TrainConfig.load("tiny_cpu", [f"model={model}", "distributed=fsdp", "mixed_precision=bf16",
                                         "gradient_checkpointing=false", *LORA])


def worker(model: str, path: str, out: str) -> None:
    """One rank: load the transformer the `path` way (`sharded`/`whole`, `lora-sharded`/`lora-whole`)
    and write this rank's numbers to `out`."""
    import gc

    import torch
    import torch.distributed as dist
    from diffusers import FluxTransformer2DModel

    from chunkgrpo.train import dist as D
    from chunkgrpo.train.model_load import (
        load_sharded_policy_transformer,
        load_sharded_transformer,
        make_trainable,
    )

    info = D.setup("cpu")
    lora = path.startswith("lora-")
    if lora and not dist.is_initialized():  # one rank: a group of one, for `fully_shard`
        dist.init_process_group("gloo", rank=0, world_size=1)
    D.barrier()
    keep = []

    def prepare(tr):
        tr.requires_grad_(True)
        if info.enabled:
            D.shard_fsdp(tr, mixed_bf16=False)

    def sharded():
        keep.append(load_sharded_transformer(model, info.device, prepare))

    def whole():  # the load this replaces: every rank reads the whole fp32 transformer, then shards it
        tr = FluxTransformer2DModel.from_pretrained(Path(model) / "transformer", dtype=torch.float32)
        prepare(tr)
        keep.append(tr)

    cfg = lora_config(model) if lora else None

    def lora_sharded():
        keep.append(load_sharded_policy_transformer(cfg, model, info.device, bf16=True)[0])

    def lora_whole():  # the load LoRA under FSDP had: the whole bf16 base on every rank, adapted, sharded
        tr = FluxTransformer2DModel.from_pretrained(Path(model) / "transformer", dtype=torch.bfloat16)
        torch.manual_seed(cfg.seed)
        make_trainable(tr, cfg)
        if info.enabled:
            D.shard_fsdp(tr, mixed_bf16=True)
        keep.append(tr)

    load = {"sharded": sharded, "whole": whole, "lora-sharded": lora_sharded, "lora-whole": lora_whole}[path]

    gc.collect()
    rss0, anon0 = _status("VmRSS"), _status("RssAnon")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    t0 = time.perf_counter()
    with AnonSampler() as anon:
        load()
    seconds = time.perf_counter() - t0
    hwm = _status("VmHWM")
    tr = keep[0]
    local = sum((p.to_local() if hasattr(p, "to_local") else p).nbytes for p in tr.parameters())
    Path(out).write_text(json.dumps({
        "rank": info.rank, "world": info.world, "anon_peak": anon.peak - anon0, "hwm": hwm - rss0,
        "local_param_bytes": local, "seconds": seconds,
    }))
    D.barrier()
    if dist.is_initialized():
        dist.destroy_process_group()


def store_bf16(model: Path) -> None:
    """Rewrite the folder's transformer weights in bf16, as FLUX.1-dev's are stored (a load in fp32 then
    converts every tensor: the whole load's fp32 copy is process memory, not mapped file pages)."""
    import torch
    from safetensors.torch import load_file, save_file

    for f in (model / "transformer").glob("*.safetensors"):
        weights = {k: v.to(torch.bfloat16) for k, v in load_file(str(f)).items()}
        save_file(weights, str(f), metadata={"format": "pt"})


def predict(model: Path, world: int, sharded: bool, lora: bool = False) -> dict:
    """The capacity plan's per-rank load terms for the transformer (`capacity.load`)."""
    import torch

    from chunkgrpo.capacity.arch import ModelArch
    from chunkgrpo.capacity.load import adapter_shapes, stored_bytes, tensor_shapes, transformer_load
    from chunkgrpo.train.model_load import peft_lora_config

    tr = ModelArch.from_folder(model).build("transformer")
    shapes, adapters = tensor_shapes(tr), []
    if lora:
        with torch.device("meta"):
            tr.add_adapter(peft_lora_config(lora_config(str(model)).lora))
        adapters = adapter_shapes(tr)
    return transformer_load(shapes, world=world, sharded=sharded, load_bytes=2 if lora else 4,
                            stored_bytes=stored_bytes(model), fsdp=True, adapters=adapters)


def run(model: Path, path: str, world: int, tmp: Path) -> dict:
    from chunkgrpo.torchrun_local import command

    outs = [tmp / f"{path}-{world}-rank{r}.json" for r in range(world)]
    cmd = command(world, str(Path(__file__).resolve()), "--worker", str(model), path,
                  str(tmp / f"{path}-{world}"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
           "PYTHONPATH": str(REPO)}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if r.returncode != 0:
        raise SystemExit(f"{path} world {world} failed:\n{r.stderr[-3000:]}")
    ranks = [json.loads(o.read_text()) for o in outs]
    pred = predict(model, world, path.endswith("sharded"), lora=path.startswith("lora-"))
    row = {"path": path, "world": world, **{k: max(x[k] for x in ranks) for k in
                                              ("anon_peak", "hwm", "local_param_bytes")},
           "seconds": max(x["seconds"] for x in ranks), "predicted": pred["cpu"],
           "prediction": pred}
    row["anon_peak / predicted"] = round(row["anon_peak"] / row["predicted"], 4)
    return row


def fit(rows: list[dict]) -> dict:
    """Least-squares a + b/world of anon_peak over the rows; the largest relative residual."""
    import numpy as np

    x = np.array([1 / r["world"] for r in rows])
    y = np.array([r["anon_peak"] for r in rows], dtype=float)
    A = np.stack([np.ones_like(x), x], 1)
    (a, b), *_ = np.linalg.lstsq(A, y, rcond=None)
    resid = max(abs(a + b * xi - yi) / yi for xi, yi in zip(x, y))
    return {"constant_bytes": float(a), "per_world_bytes": float(b), "max_relative_residual": float(resid)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="mid", choices=["tiny", "mid"])
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--stored", default="bf16", choices=["bf16", "fp32"],
                    help="dtype of the transformer's stored weights (FLUX.1-dev's are bf16)")
    ap.add_argument("--paths", nargs="+", default=["sharded", "whole"], choices=["sharded", "whole"])
    ap.add_argument("--lora", action="store_true",
                    help="a LoRA policy (bf16 base + fp32 adapters, `LORA`) instead of full fine-tuning")
    ap.add_argument("--json", metavar="PATH", help="also write the result to PATH")
    ap.add_argument("--worker", nargs=3, metavar=("MODEL", "PATH", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        model, path, out = args.worker
        worker(model, path, f"{out}-rank{os.environ.get('RANK', '0')}.json")
        return 0
    if min(args.worlds) < 1:
        print(f"--worlds {args.worlds}: every world size must be >= 1", file=sys.stderr)
        return 2
    from chunkgrpo.capacity.arch import ModelArch, param_count
    from chunkgrpo.testing.tiny import build_tiny_flux

    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        model = build_tiny_flux(tmp / "model", size=args.size)
        if args.stored == "bf16":
            store_bf16(model)
        params = param_count(ModelArch.from_folder(model).build("transformer"))
        paths = [f"lora-{p}" if args.lora else p for p in args.paths]
        rows = [run(model, p, w, tmp) for p in paths for w in args.worlds]
        if args.lora:
            adapters = predict(model, 1, True, lora=True)["parts"]["LoRA adapter shard (fp32, 1/n)"] // 4
    result = {"size": args.size, "stored": args.stored, "mode": "lora" if args.lora else "full",
              "transformer_params": params, "fp32_bytes": 4 * params, "rows": rows}
    if args.lora:
        result.update(lora=LORA, adapter_params=adapters, base_bf16_bytes=2 * params)
    sharded = [r for r in rows if r["path"].endswith("sharded")]
    if len(sharded) >= 2:
        result["sharded_fit"] = fit(sharded)
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    from chunkgrpo import startup

    startup.fewer_full_collections()  # as the entry points: fewer full collections while it loads
    raise SystemExit(main())

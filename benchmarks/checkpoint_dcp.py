"""Checkpoint save and resume of a 2-rank FSDP full fine-tune on CPU (gloo): the sharded layout
(`chunkgrpo.train.checkpoint_sharded`: every rank writes and hashes its own shards; written synchronously
and asynchronously, the trainer's default) against the gathered one the FSDP trainer wrote before it
(full weights and optimizer state gathered to rank 0, which writes and hashes them all; on resume every
rank `torch.load`s the whole optimizer file), on a tiny FLUX transformer of `--size`. Prints one JSON
object: per layout the save time (and how long training is blocked), the resume time, the largest
file, the bytes written, and each rank's peak host memory above its level before the phase; times are
the fastest of `--repeat` runs (the cores may be shared).

With `--nodes` the 2 ranks are 2 nodes of 1 rank with their own folders (LOCAL_WORLD_SIZE=1): the
gathered layout (everything through rank 0, which writes, hashes and then uploads it all) against the
node-local sharded one (`chunkgrpo.train.checkpoint_nodes`: each rank writes and hashes its shards in its
node's folder; the entries meet through the process group). Reported: the save time, each rank's peak
host memory, and the bytes each node writes (and then uploads).

  python benchmarks/checkpoint_dcp.py --size mid
  python benchmarks/checkpoint_dcp.py --size mid --nodes
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import torch
import torch.multiprocessing as mp


class Peak:
    """Peak resident memory of this process above its level at entry (sampled every 2 ms)."""

    def __enter__(self):
        self.proc = psutil.Process()
        self.base = self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)
        self.mb = (self.peak - self.base) / 1e6


def _model(model_dir: Path, world: int):
    from diffusers import FluxTransformer2DModel

    from chunkgrpo.train.dist import shard_fsdp

    torch.manual_seed(0)
    tr = FluxTransformer2DModel.from_pretrained(model_dir / "transformer", torch_dtype=torch.float32)
    tr.requires_grad_(True)
    shard_fsdp(tr, mixed_bf16=False)
    params = list(tr.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4)
    for p in params:  # one optimizer step: both AdamW moments exist, as in a running training
        p.grad = torch.randn_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    names = [n for n, _ in tr.named_parameters()]
    return SimpleNamespace(model=SimpleNamespace(transformer=tr), optimizer=opt, trainable_names=names,
                           trainable=params, ema=None)


def _gathered_save(t, folder: Path, rank: int) -> None:
    """The layout the FSDP trainer wrote before: rank 0 receives everything and writes and hashes it."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    from chunkgrpo.train import checkpoint_format as ckpt

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(t.model.transformer, options=opts)
    optim = get_optimizer_state_dict(t.model.transformer, t.optimizer, options=opts)
    if rank == 0:
        folder.mkdir(parents=True)
        save_file({n: full[n].float().contiguous() for n in t.trainable_names},
                  str(folder / "trainable.safetensors"))
        torch.save(optim, folder / "optimizer.pt")
        ckpt.write_manifest(folder, {})
    torch.distributed.barrier()


def _gathered_load(t, folder: Path) -> None:
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    weights = load_file(str(folder / "trainable.safetensors"))
    optim = torch.load(folder / "optimizer.pt", map_location="cpu", weights_only=True)
    opts = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(t.model.transformer, weights, options=opts)
    set_optimizer_state_dict(t.model.transformer, t.optimizer, optim, options=opts)


def _sharded_save(t, folder: Path, rank: int) -> None:
    from chunkgrpo.train import checkpoint_format as ckpt
    from chunkgrpo.train import checkpoint_sharded as sharded

    if rank == 0:
        folder.mkdir(parents=True)
    torch.distributed.barrier()
    sharded.save(sharded.state_dicts(t), folder)
    entries = sharded.hash_files(folder, sharded.own_files(folder, rank))
    every = sharded.gather(entries)
    if rank == 0:
        ckpt.write_manifest(folder, {}, files={k: v for part in every for k, v in part.items()})
    torch.distributed.barrier()


def _async_save(t, folder: Path, rank: int) -> None:
    """The trainer's default under FSDP: the shards copied to host memory, written by a background thread;
    only the copy blocks training (`blocking_s`), the write and the commit go on beside it."""
    import torch.distributed.checkpoint as dcp

    from chunkgrpo.train import checkpoint_format as ckpt
    from chunkgrpo.train import checkpoint_sharded as sharded

    if rank == 0:
        folder.mkdir(parents=True)
    torch.distributed.barrier()
    t0 = time.perf_counter()
    future = dcp.async_save(sharded.state_dicts(t), checkpoint_id=str(folder / sharded.DCP_DIR),
                            process_group=GROUP[0])
    t.blocking_s = time.perf_counter() - t0
    future.result()
    entries = sharded.hash_files(folder, sharded.own_files(folder, rank))
    every = sharded.gather(entries)
    if rank == 0:
        ckpt.write_manifest(folder, {}, files={k: v for part in every for k, v in part.items()})
    torch.distributed.barrier()


GROUP: list = []  # the asynchronous saves' own gloo group, as the trainer makes one


def _node_sharded_save(t, folder: Path, rank: int) -> None:
    """Several nodes with their own disks: rank r's node folder is `folder/node{r}`; each rank writes and
    hashes its shards there, the entries meet through the process group, every node writes its part."""
    from chunkgrpo.store.manifest import Manifest, _now
    from chunkgrpo.train import checkpoint_format as ckpt
    from chunkgrpo.train import checkpoint_nodes as nodes
    from chunkgrpo.train import checkpoint_sharded as sharded

    root = folder / f"node{rank}"
    staging = ckpt.stage_dir(root, 1)
    sharded.save(sharded.state_dicts(t), staging)
    entries = sharded.hash_files(staging, sharded.own_files(staging, rank))
    every = sharded.gather(entries)
    files = {k: v for part in every for k, v in part.items()}
    manifest = sharded.gather(Manifest(files=files, created=_now(), meta={}).to_json() if rank == 0
                              else None)[0]
    (staging / "rng").rmdir()
    nodes.finalize_part(staging, root, 1, manifest, entries)
    torch.distributed.barrier()


def _sharded_load(t, folder: Path) -> None:
    from chunkgrpo.train import checkpoint_sharded as sharded

    step = max(sharded.adam_steps(sharded.state_dicts(t)["optim"]))
    sharded.apply(t, sharded.load(t, folder, step, ema=False), 0)


def _worker(rank: int, world: int, port: int, model_dir: str, work: str, result: str, layout: str) -> None:
    """One layout's save and resume in fresh processes (a heap grown by an earlier phase would hide the
    next one's allocations from the resident-memory peak)."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    GROUP.append(dist.new_group(backend="gloo"))
    out: dict = {}
    try:
        save, load = {"gathered": (_gathered_save, _gathered_load), "sharded": (_sharded_save, _sharded_load),
                      "sharded_async": (_async_save, _sharded_load),
                      "node_sharded": (_node_sharded_save, None)}[layout]
        t = _model(Path(model_dir), world)
        folder = Path(work)
        dist.barrier()
        t0 = time.perf_counter()
        with Peak() as ps:
            save(t, folder, rank)
        save_s = time.perf_counter() - t0
        t2 = _model(Path(model_dir), world)  # a fresh run resuming
        dist.barrier()
        t0 = time.perf_counter()
        with Peak() as pl:
            if load is not None:  # (node-local parts are completed from S3 first: not measured here)
                load(t2, folder)
            dist.barrier()
        load_s = time.perf_counter() - t0
        pairs = zip(t.model.transformer.parameters(), t2.model.transformer.parameters())
        same = load is not None and all(torch.equal(a.to_local(), b.to_local()) for a, b in pairs)
        out.setdefault(layout, []).append({
            "save_s": save_s, "resume_s": load_s, "save_peak_mb": ps.mb, "resume_peak_mb": pl.mb,
            "resumed_weights_equal": same, "blocking_s": getattr(t, "blocking_s", save_s)})
        del t, t2
        got = [None] * world
        dist.all_gather_object(got, out)
        if rank == 0:
            Path(result).write_text(json.dumps(got))
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="mid", choices=["tiny", "mid"])
    ap.add_argument("--repeat", type=int, default=3, help="runs of each layout (times: the fastest)")
    ap.add_argument("--nodes", action="store_true",
                    help="2 nodes × 1 rank with their own folders: gathered vs node-local sharded saves")
    args = ap.parse_args()
    layouts = ("gathered", "node_sharded") if args.nodes else ("gathered", "sharded", "sharded_async")
    if args.nodes:
        os.environ["LOCAL_WORLD_SIZE"] = "1"  # each rank a node of its own (inherited by the workers)
    from chunkgrpo.processes import free_port
    from chunkgrpo.store.manifest import file_sizes
    from chunkgrpo.testing.tiny import build_tiny_flux

    world = 2
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        build_tiny_flux(tmp / "model", size=args.size)
        result = tmp / "result.json"
        runs: dict = {}
        for i in range(args.repeat):
            for layout in layouts:
                work = tmp / "ckpt" / (layout if i == 0 else f"{layout}-{i}")
                mp.start_processes(_worker, nprocs=world, join=True, start_method="spawn",
                                   args=(world, free_port(), str(tmp / "model"), str(work), str(result),
                                         layout))
                runs.setdefault(layout, []).append(json.loads(result.read_text()))
        # ranks[r][layout] = that rank's list of runs
        ranks = [{layout: [run[r][layout][0] for run in runs[layout]] for layout in runs}
                 for r in range(world)]
        report = {"size": args.size, "world": world, "nodes": world if args.nodes else 1,
                  "threads_per_rank": 1, "repeat": args.repeat,
                  "load_average": [round(x, 2) for x in os.getloadavg()], "layouts": {}}

        def fastest(layout, key):  # per run the slowest rank, then the fastest run
            return round(min(max(r[layout][i][key] for r in ranks) for i in range(args.repeat)), 3)

        for layout in layouts:
            sizes = file_sizes(tmp / "ckpt" / layout)
            state = sum(v for k, v in sizes.items() if k not in ("MANIFEST.json", "PART.json")
                        and not k.endswith("/PART.json"))
            per_node = [sum(v for k, v in sizes.items() if k.startswith(f"node{r}/") and
                            not k.endswith("PART.json")) for r in range(world)]
            report["layouts"][layout] = {
                "bytes_written_mb_per_node": ([round(b / 1e6, 2) for b in per_node]
                                              if layout == "node_sharded"
                                              else [round(state / 1e6, 2)] + [0.0] * (world - 1)),
                "save_s": fastest(layout, "save_s"),
                "training_blocked_s": fastest(layout, "blocking_s"),
                "resume_s": fastest(layout, "resume_s"),
                "save_peak_mb_per_rank": [round(max(x["save_peak_mb"] for x in r[layout]), 1) for r in ranks],
                "resume_peak_mb_per_rank": [round(max(x["resume_peak_mb"] for x in r[layout]), 1)
                                            for r in ranks],
                "bytes_written_mb": round(state / 1e6, 2),
                "largest_file_mb": round(max(sizes.values()) / 1e6, 2),
                "largest_file": max(sizes, key=sizes.get),
                "resumed_weights_equal": all(x["resumed_weights_equal"] for r in ranks for x in r[layout]),
            }
            if layout == "node_sharded":  # its resume is a DCP read as `sharded`, after a fill from S3
                for key in ("resume_s", "resume_peak_mb_per_rank", "resumed_weights_equal"):
                    report["layouts"][layout].pop(key)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

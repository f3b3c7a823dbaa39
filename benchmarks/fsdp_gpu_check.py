"""FSDP full fine-tuning at real size, one GPU: what one rank of `chunk_grpo_flux` on the h800 pool needs,
measured beside the capacity plan's prediction for the same quantity.

    python benchmarks/fsdp_gpu_check.py --device cuda --json fsdp_gpu_check.json    # one H100/H200, ≤ 8 min
    python benchmarks/fsdp_gpu_check.py --size tiny --device cpu                    # CPU check of the wiring

Random weights at real size (FLUX.1-dev's published configs, `capacity.arch.FLUX_DEV`), built on the
device: no downloads, no files. The predictions come from `chunkgrpo.capacity.plan.capacity_plan` for
`chunk_grpo_flux` (full fine-tuning, FSDP, bf16) on the h800 pool (its rendered runtime; without kubectl,
8 × H800 as `capacity.pool.GPU_MEMORY` states them), computed when the script runs, never copied in.
`--size tiny` runs every stage at the tiny FLUX folder's widths (`chunkgrpo.testing.tiny`), 64², a 32-token
prompt, a 30 MB state dict and a reward stand-in of 1/1000 of the plan's (the load stage's
ratio is then left out), against the plan of the same configuration: a check of the wiring, not a measurement.

Stages (`--stages`, in this order; each prints one JSON line `{"stage", "measured", "predicted", ...}` as
soon as it finishes, so a run cut short keeps what it finished; `--budget-s` skips a stage whose stated
duration would overrun the budget, printing `{"stage", "skipped"}`):

* `load`: the load phase of rank 0 of 8 with the sharded loader (`train.model_load`). One process cannot
  join an 8-rank group, so it joins a *fake* one (torch's `fake` backend: rank 0 of world 8, collectives
  are no-ops): the transformer is built on the meta device in fp32, made trainable, sharded by the
  project's `fully_shard` (`train.dist.shard_fsdp`) and given storage with `to_empty`, exactly as
  `model_load.load_sharded_transformer` does, so the device holds exactly the shards FSDP2 gives rank 0
  of 8 (⌈d0/8⌉ rows of every tensor). The shards are then filled with random values where the loader
  copies the files' rows into the same storage. Then T5-XXL, CLIP-L and the VAE at their real widths in
  their load dtype (bf16), random init on the device; then a second process opens its own CUDA context
  on the same GPU and holds 8.29 B bf16 parameters (the plan's HPSv3 size) as the reward worker's
  stand-in. Measured: this process's peak allocation, each part, the second process's allocation and its
  context (device memory in use, `cudaMemGetInfo`, above what it allocated). Not on one GPU: NCCL's
  buffers (the plan's 1 GiB stated estimate is shown, not measured).
* `decode`: the VAE decode of the rollout's 24 images at 720² (bf16): seconds and the peak above what
  was allocated before, against the plan's decode activations.
* `forward`: FLUX.1-dev's transformer (bf16), one no-grad forward of 24 inputs (2,025 image + 512 text
  tokens): seconds, peak above the weights and inputs, against the plan's no-grad forward.
* `backward`: forward + backward of the plan's policy inputs per forward (7) with gradient checkpointing,
  every parameter trainable, its gradient pre-allocated (as the plan, which counts the sharded gradients
  apart): seconds and the peak above weights, gradients and inputs against the plan's policy
  forward+backward. cuDNN attention is off (`flux.use_training_attention`), as in training.
* `save`: a 30 GB fp32 state dict (1 GB tensors) written with `torch.save` to `--out` (fsync'd), its
  pages dropped from the page cache, then read back through sha256; GB/s of each pass against the
  plan's stated I/O rate (`capacity.io`, 200 MB/s per pass) and the checkpoint-save seconds it predicts
  for the same bytes. The file is deleted after.
* `iteration`: `benchmarks/flux_gpu.py --stages iteration` in a subprocess (LoRA, one rank, see its
  docstring): its iteration times and its measured peak against its own capacity-plan prediction.

Measured memory is `torch.cuda.max_memory_allocated` on a GPU; on the CPU the bytes of the tensors held
(load) and the peak anonymous resident memory above the stage's start (the other stages).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

STAGES = ("load", "decode", "forward", "backward", "save", "iteration")
WORLD = 8  # the h800 pool's ranks per node
# stated seconds of each stage on one H200 at real size (the budget guard's estimates; tiny: 1/20)
EXPECTED_S = {"load": 60, "decode": 30, "forward": 45, "backward": 30, "save": 100, "iteration": 200}
SIZES = {  # resolution, prompt tokens, state-dict bytes, reward stand-in divisor
    "real": {"res": 720, "tokens": 512, "save_bytes": 30 * 10**9, "reward_div": 1},
    "tiny": {"res": 64, "tokens": 32, "save_bytes": 30 * 10**6, "reward_div": 1000},
}
GiB = 2**30


def emit(stage: str, payload: dict, results: list) -> None:
    line = {"stage": stage, **payload}
    results.append(line)
    print(json.dumps(line), flush=True)


def gib(n) -> float | None:
    return None if n is None else round(n / GiB, 6)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------ configuration and plan
def architecture(size: str, tmp: Path):
    """The model's component configs: FLUX.1-dev's published ones (real) or the tiny folder's."""
    from chunkgrpo.capacity.arch import FLUX_DEV, ModelArch

    if size == "real":
        return ModelArch(**FLUX_DEV)
    from chunkgrpo.testing.tiny import build_tiny_flux

    return ModelArch.from_folder(build_tiny_flux(tmp / "model", size="tiny", layers=(1, 1)))


def recipe(size: str):
    from chunkgrpo.train.config import TrainConfig

    s = SIZES[size]
    return TrainConfig.load("chunk_grpo_flux", [f"sampling.height={s['res']}", f"sampling.width={s['res']}",
                                                f"sampling.max_sequence_length={s['tokens']}"])


def h800_pool():
    """The h800 pool (its rendered runtime), else its GPUs as `capacity.pool` states them."""
    from chunkgrpo.capacity.pool import GPU_MEMORY, Pool, load_pool

    try:
        return load_pool("h800")
    except Exception as e:  # no kubectl / manifests where the check runs: the GPU terms need only these
        return Pool("h800", "NVIDIA-H800", GPU_MEMORY["NVIDIA-H800"], WORLD, None, None, [], {},
                    f"stated: {WORLD} x NVIDIA-H800 ({type(e).__name__})")


def plan_for(cfg, arch) -> dict:
    """The capacity plan's GPU phases as {phase: {part: bytes}} and its facts."""
    from chunkgrpo.capacity.plan import capacity_plan

    pool = h800_pool()
    plan = capacity_plan(cfg, pool, preset="chunk_grpo_flux", arch=arch)
    phases = {i.what.removesuffix(" phase"): dict(i.parts, total=i.need) for i in plan.items
              if i.resource == "GPU memory per rank"}
    return {"phases": phases, "facts": plan.facts, "pool": pool.source, "cfg": cfg}


def part(phases: dict, phase: str, prefix: str) -> int:
    return next(v for k, v in phases[phase].items() if k.startswith(prefix))


def real_counts() -> dict:
    """Parameter counts of the real-size components and rank 0's shard of the transformer at world 8, on
    the meta device (nothing allocated)."""
    from chunkgrpo.capacity.arch import FLUX_DEV, ModelArch, param_count
    from chunkgrpo.capacity.load import _rows, tensor_shapes

    arch = ModelArch(**FLUX_DEV)
    tr = arch.build("transformer")
    return {"transformer": param_count(tr), "text_encoder_2": param_count(arch.build("text_encoder_2")),
            "text_encoder": param_count(arch.build("text_encoder")), "vae": param_count(arch.build("vae")),
            "shard_elements": sum(_rows(s, WORLD) for s in tensor_shapes(tr))}


# ------------------------------------------------------------------------------ memory measurement
def _rss_anon() -> int:
    with open("/proc/self/status") as fp:
        for line in fp:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


class Peak:
    """Peak bytes above the start of a block: `max_memory_allocated` on a GPU, sampled RssAnon on the CPU."""

    def __init__(self, device: torch.device):
        self.device, self.peak, self._stop = device, 0, threading.Event()

    def __enter__(self):
        sync(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            self.base = _rss_anon()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_anon() - self.base)
            time.sleep(0.001)

    def __exit__(self, *exc):
        sync(self.device)
        if self.device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated() - self.base
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, _rss_anon() - self.base)


def build_on(arch, name: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """Component `name` of `arch` constructed on `device` in `dtype` (random init there), frozen."""
    return arch.build(name, dtype, device).requires_grad_(False).eval()


def tensor_bytes(m: torch.nn.Module) -> int:
    return sum((t.to_local() if hasattr(t, "to_local") else t).untyped_storage().nbytes()
               for t in m.state_dict().values())


# ------------------------------------------------------------------------------ stages
REWARD_HOLDER = """
import sys, torch
n, dev = int(sys.argv[1]), sys.argv[2]
chunk = 2**29
held = [torch.empty(min(chunk, n - i), dtype=torch.bfloat16, device=dev).normal_()
        for i in range(0, n, chunk)]
if dev.startswith("cuda"):
    torch.cuda.synchronize()
print(sum(t.numel() * t.element_size() for t in held), flush=True)
sys.stdin.read()
"""


def device_used(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def stage_load(ctx) -> dict:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from chunkgrpo.capacity.plan import REWARD_MODELS
    from chunkgrpo.train import dist as D
    from chunkgrpo.train.model_load import make_trainable

    dev, arch, plan = ctx["device"], ctx["arch"], ctx["plan"]
    cfg = plan["cfg"]
    used0 = device_used(dev)
    if not dist.is_initialized():
        dist.init_process_group("fake", rank=0, world_size=WORLD, store=FakeStore())
    t0 = time.perf_counter()
    with Peak(dev) as pk:
        with torch.device("meta"):
            from diffusers import FluxTransformer2DModel

            tr = FluxTransformer2DModel.from_config(arch.transformer)
        torch.nn.Module.to(tr, torch.float32)  # full fine-tuning's load dtype: fp32 master weights
        tr.eval()
        make_trainable(tr, cfg)
        D.shard_fsdp(tr, mixed_bf16=True)
        tr.to_empty(device=dev)
        with torch.no_grad():  # where the loader copies the files' rows into the same storage
            for t in tr.state_dict().values():
                (t.to_local() if hasattr(t, "to_local") else t).normal_(0, 0.02)
        sync(dev)
        shard = tensor_bytes(tr)
        shard_elements = sum(p.to_local().numel() for p in tr.parameters())
        frozen = [build_on(arch, n, dev, torch.bfloat16) for n in ("text_encoder", "text_encoder_2", "vae")]
        frozen_bytes = sum(tensor_bytes(m) for m in frozen)
    own_peak = pk.peak if dev.type == "cuda" else shard + frozen_bytes
    n_reward = REWARD_MODELS["hpsv3"][0] // SIZES[ctx["size"]]["reward_div"]
    before_reward = device_used(dev)
    holder = subprocess.Popen([sys.executable, "-c", REWARD_HOLDER, str(n_reward), str(dev)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        reward_bytes = int(holder.stdout.readline() or 0)
        after_reward = device_used(dev)
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    seconds = time.perf_counter() - t0
    if not reward_bytes:
        raise RuntimeError(f"the reward stand-in process failed (exit {holder.returncode})")
    context = (after_reward - before_reward - reward_bytes) if dev.type == "cuda" else None
    del tr, frozen
    dist.destroy_process_group()
    ph = plan["phases"]["load"]
    from chunkgrpo.capacity.load import _rows, tensor_shapes

    shard_expected = sum(_rows(t, WORLD) for t in tensor_shapes(arch.build("transformer")))
    pred_shard = part(plan["phases"], "load", "transformer shard")
    predicted = {"transformer_shard_gib": gib(pred_shard),
                 "text_encoders_vae_gib": gib(ph["text encoders + VAE"]),
                 "reward_models_gib": gib(ph.get("reward models", 0)),
                 "reward_worker_context_gib": gib(ph.get("reward worker CUDA contexts", 0)),
                 "nccl_buffers_gib (not measurable on one GPU)": gib(ph.get("NCCL buffers", 0)),
                 "total_gib": gib(ph["total"]),
                 "total_without_nccl_gib": gib(ph["total"] - ph.get("NCCL buffers", 0))}
    total = own_peak + reward_bytes + (context or 0)
    measured = {"transformer_shard_gib": gib(shard), "shard_elements": shard_elements,
                "text_encoders_vae_gib": gib(frozen_bytes), "rank_process_peak_gib": gib(own_peak),
                "reward_models_gib": gib(reward_bytes), "reward_worker_context_gib": gib(context),
                "total_gib": gib(total),
                "device_used_before_gib": gib(used0), "device_used_with_reward_gib": gib(after_reward)}
    real = ctx["size"] == "real"  # tiny: the stand-in is 1/1000 of the reward the plan counts whole
    return {"measured": measured, "predicted": predicted, "seconds": round(seconds, 2),
            "measured_over_predicted": round(total / (ph["total"] - ph.get("NCCL buffers", 0)), 3) if real
            else None, "reward_stand_in_fraction": 1 / SIZES[ctx["size"]]["reward_div"],
            "shard_elements_expected": shard_expected}


def stage_decode(ctx) -> dict:
    dev, arch, plan = ctx["device"], ctx["arch"], ctx["plan"]
    cfg = plan["cfg"]
    B, H = plan["facts"]["rollout_batch"], cfg.sampling.height
    vae = build_on(arch, "vae", dev, torch.bfloat16)
    scale = 2 ** (len(arch.vae["block_out_channels"]) - 1)
    z = torch.randn(B, arch.vae["latent_channels"], H // scale, H // scale, device=dev, dtype=torch.bfloat16)
    times = []
    with torch.no_grad():
        with Peak(dev) as pk:
            t0 = time.perf_counter()
            img = vae.decode(z, return_dict=False)[0]
            sync(dev)
            times.append(time.perf_counter() - t0)
        del img
        t0 = time.perf_counter()
        vae.decode(z, return_dict=False)
        sync(dev)
        times.append(time.perf_counter() - t0)
    del vae, z
    pred = part(plan["phases"], "decode", "VAE decode")
    return {"measured": {"decode_peak_gib": gib(pk.peak), "first_s": round(times[0], 3),
                         "second_s": round(times[1], 3), "images": B, "res": H},
            "predicted": {"decode_peak_gib": gib(pred), "seconds": None},
            "measured_over_predicted": round(pk.peak / pred, 3) if pk.peak else None}


def transformer(ctx) -> torch.nn.Module:
    """The transformer in bf16 on the device, built once for the forward and backward stages."""
    if "transformer" not in ctx:
        t0 = time.perf_counter()
        ctx["transformer"] = build_on(ctx["arch"], "transformer", ctx["device"], torch.bfloat16)
        sync(ctx["device"])
        ctx["build_s"] = round(time.perf_counter() - t0, 2)
    return ctx["transformer"]


def inputs(ctx, batch: int) -> dict:
    dev, cfg, tc = ctx["device"], ctx["plan"]["cfg"], ctx["arch"].transformer
    L, T = ctx["plan"]["facts"]["image_tokens"], cfg.sampling.max_sequence_length
    bf = dict(device=dev, dtype=torch.bfloat16)
    return dict(hidden_states=torch.randn(batch, L, tc["in_channels"], **bf),
                encoder_hidden_states=torch.randn(batch, T, tc["joint_attention_dim"], **bf),
                pooled_projections=torch.randn(batch, tc["pooled_projection_dim"], **bf),
                timestep=torch.full((batch,), 0.5, device=dev), img_ids=torch.zeros(L, 3, device=dev),
                txt_ids=torch.zeros(T, 3, device=dev),
                guidance=torch.full((batch,), 3.5, device=dev) if tc.get("guidance_embeds") else None)


def stage_forward(ctx) -> dict:
    tr = transformer(ctx)
    B = ctx["plan"]["facts"]["rollout_batch"]
    kw = inputs(ctx, B)
    times, peak = [], 0
    with torch.no_grad():
        for _ in range(2):
            with Peak(ctx["device"]) as pk:
                t0 = time.perf_counter()
                out = tr(**kw, return_dict=False)[0]
                sync(ctx["device"])
                times.append(time.perf_counter() - t0)
            peak = max(peak, pk.peak)
            del out
    pred = part(ctx["plan"]["phases"], "rollout", "transformer no-grad forward")
    return {"measured": {"forward_peak_gib": gib(peak), "first_s": round(times[0], 3),
                         "second_s": round(times[1], 3), "batch": B, "build_s": ctx["build_s"]},
            "predicted": {"forward_peak_gib": gib(pred), "seconds": None},
            "measured_over_predicted": round(peak / pred, 3) if peak else None}


def stage_backward(ctx) -> dict:
    from chunkgrpo.flux import use_training_attention

    use_training_attention(ctx["device"])
    tr = transformer(ctx)
    n = ctx["plan"]["facts"]["policy_inputs_per_forward"]
    tr.train().requires_grad_(True)
    tr.enable_gradient_checkpointing()
    for p in tr.parameters():  # pre-allocated, as the plan counts gradients apart from activations
        p.grad = torch.zeros_like(p)
    kw = inputs(ctx, n)
    with Peak(ctx["device"]) as pk:
        t0 = time.perf_counter()
        out = tr(**kw, return_dict=False)[0].float()
        out.square().mean().backward()
        sync(ctx["device"])
        seconds = time.perf_counter() - t0
    del out
    ctx.pop("transformer")
    del tr
    pred = part(ctx["plan"]["phases"], "policy", "policy forward+backward")
    return {"measured": {"forward_backward_peak_gib": gib(pk.peak), "s": round(seconds, 3), "inputs": n,
                         "gradient_checkpointing": True},
            "predicted": {"forward_backward_peak_gib": gib(pred), "seconds": None},
            "measured_over_predicted": round(pk.peak / pred, 3) if pk.peak else None}


def _mount(path: Path) -> str:
    best = ("", "")
    with open("/proc/mounts") as fp:
        for line in fp:
            _, mnt, fs = line.split()[:3]
            if str(path).startswith(mnt) and len(mnt) > len(best[0]):
                best = (mnt, fs)
    return f"{best[0]} ({best[1]})"


def stage_save(ctx) -> dict:
    from chunkgrpo.capacity.io import IO_BYTES_PER_S, io_phases

    nbytes = SIZES[ctx["size"]]["save_bytes"]
    out = Path(tempfile.mkdtemp(prefix="fsdp-gpu-check-", dir=ctx["out"]))
    if shutil.disk_usage(out).free < 1.05 * nbytes:
        shutil.rmtree(out)
        return {"skipped": f"{ctx['out']} has {shutil.disk_usage(ctx['out']).free / 1e9:.1f} GB free, "
                           f"the state dict needs {nbytes / 1e9:.1f} GB"}
    per = min(nbytes, 10**9 if ctx["size"] == "real" else 10**6) // 4
    sd = {f"tensor_{i:03d}": torch.empty(per, dtype=torch.float32).fill_(i)
          for i in range(nbytes // 4 // per)}
    f = out / "state_dict.pt"
    try:
        t0 = time.perf_counter()
        torch.save(sd, f)
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            write_s = time.perf_counter() - t0
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the hash reads the disk, not the cache
        finally:
            os.close(fd)
        size = f.stat().st_size
        t0 = time.perf_counter()
        h = hashlib.sha256()
        with open(f, "rb") as fp:
            while block := fp.read(16 * 2**20):
                h.update(block)
        hash_s = time.perf_counter() - t0
    finally:
        shutil.rmtree(out, ignore_errors=True)
    del sd
    save = next(p for p in io_phases(ctx["plan"]["cfg"], model_folder=0, checkpoint=size, final=0)
                if p.phase == "checkpoint save")
    return {"measured": {"bytes": size, "write_gb_per_s": round(size / write_s / 1e9, 3),
                         "sha256_gb_per_s": round(size / hash_s / 1e9, 3), "write_s": round(write_s, 2),
                         "sha256_s": round(hash_s, 2), "seconds": round(write_s + hash_s, 2),
                         "filesystem": _mount(out.resolve())},
            "predicted": {"write_gb_per_s": IO_BYTES_PER_S / 1e9, "sha256_gb_per_s": IO_BYTES_PER_S / 1e9,
                          "seconds": round(save.seconds, 1)}}


def stage_iteration(ctx) -> dict:
    remaining = ctx["budget_s"] - (time.perf_counter() - ctx["t0"])
    cmd = [sys.executable, str(REPO / "benchmarks" / "flux_gpu.py"), "--stages", "iteration",
           "--device", str(ctx["device"])]
    if ctx["size"] == "tiny":
        cmd += ["--size", "tiny", "--res", "64", "--steps", "5", "--group-size", "3"]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=max(1.0, remaining))
    except subprocess.TimeoutExpired:
        return {"skipped": f"flux_gpu.py ran past the budget ({remaining:.0f} s left)"}
    lines = {ln.split()[1]: json.loads(ln.split(" ", 2)[2]) for ln in run.stdout.splitlines()
             if ln.startswith("STAGE ")}
    if run.returncode or "iteration" not in lines or "memory" not in lines:
        tail = (run.stderr.strip().splitlines() or ["no output"])[-1][:300]
        raise RuntimeError(f"flux_gpu.py --stages iteration failed (exit {run.returncode}): {tail}")
    mem = lines["memory"]
    return {"measured": {**lines["iteration"], "peak_gib": mem["measured_peak_gib"],
                         "resident_before_iteration_gib": mem["resident_before_iteration_gib"]},
            "predicted": {"peak_gib": mem["predicted_peak_gib"], "phases_gib": mem["predicted_gib"]},
            "measured_over_predicted": mem["measured_over_predicted"], "command": " ".join(cmd[1:])}


RUN = {"load": stage_load, "decode": stage_decode, "forward": stage_forward, "backward": stage_backward,
       "save": stage_save, "iteration": stage_iteration}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="real", choices=["real", "tiny"])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, of {','.join(STAGES)}")
    ap.add_argument("--budget-s", type=float, default=480.0, help="skip stages that would overrun this")
    ap.add_argument("--out", default=tempfile.gettempdir(), help="folder on local disk for the save stage")
    ap.add_argument("--json", help="also write every stage's line here, as a JSON list")
    args = ap.parse_args(argv)
    stages = [s for s in args.stages.split(",") if s]
    bad = [s for s in stages if s not in STAGES]
    if bad or not stages:
        print(f"--stages {args.stages!r}: unknown stage {bad[0] if bad else '(none)'!r} "
              f"(choose from {','.join(STAGES)})", file=sys.stderr)
        return 2
    if "save" in stages and not Path(args.out).is_dir():
        print(f"--out {args.out}: not a folder", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here (use --device cpu)", file=sys.stderr)
        return 2
    if args.budget_s <= 0:
        print(f"--budget-s {args.budget_s}: must be positive", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    device = torch.device(args.device)
    results: list = []
    failed: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        arch = architecture(args.size, Path(tmp))
        plan = plan_for(recipe(args.size), arch)
        ctx = {"device": device, "arch": arch, "plan": plan, "size": args.size, "out": args.out,
               "budget_s": args.budget_s, "t0": t_start}
        emit("setup", {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                       "torch": torch.__version__, "size": args.size, "pool": plan["pool"],
                       "plan_s": round(time.perf_counter() - t_start, 2),
                       "transformer_params": plan["facts"]["transformer_params"]}, results)
        scale = 1.0 if args.size == "real" else 1 / 20
        for stage in stages:
            elapsed = time.perf_counter() - t_start
            if elapsed + EXPECTED_S[stage] * scale > args.budget_s:
                emit(stage, {"skipped": f"{elapsed:.0f} s elapsed + ~{EXPECTED_S[stage] * scale:.0f} s "
                                        f"would pass --budget-s {args.budget_s:.0f}"}, results)
                continue
            t0 = time.perf_counter()
            try:
                out = RUN[stage](ctx)
            except Exception as e:  # the next stages still run (a CUDA fault may fail them too)
                failed.append(stage)
                out = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            out.setdefault("seconds", round(time.perf_counter() - t0, 2))
            emit(stage, out, results)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    from chunkgrpo import startup

    startup.fewer_full_collections()  # as the entry points: fewer full collections while it loads
    sys.exit(main())

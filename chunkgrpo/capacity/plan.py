"""Capacity plan: per-rank GPU memory, host memory and bytes per volume of a training run, predicted
before any GPU time from the model's architecture (`capacity.arch`: instantiated on the meta device, no
weights), the recipe (`TrainConfig`) and the pool (`capacity.pool`: the training runtime's pod).

    plan = capacity_plan(TrainConfig.load("chunk_grpo_flux"), load_pool("h800"))
    print(render_table(plan)); plan.problems()   # ["GPU memory per rank (policy phase): needs … (+… over)"]

**Memory per rank** (P = trainable params, W = transformer params, n = world size, b_c = 2 for bf16
compute on GPU, 4 for fp32; every term in bytes):
  resident   = transformer weights (FSDP full FT: 4·W/n fp32 master shards; DDP full FT: 4·W;
               LoRA: b_base·W + 4·P) + AdamW 8·P (/n under FSDP) + EMA 4·P (/n) + VAE + reward models
               + prompt-embedding cache (every prompt of the run, kept on the device, model dtype)
  load       = the transformer as it loads (`capacity.load`; FSDP, LoRA or full: this rank's shards in the
               load dtype, ≈ b_base·W/n (+ the adapter's fp32 shards, 4·P/n); DDP: the whole transformer
               in the load dtype)
               + the frozen text encoders and VAE (bf16 under bf16 mixed precision, `frozen_dtype`)
               + reward models (loaded after the transformer is sharded)
  text enc.  = resident transformer weights + text encoders + VAE + reward models + embeddings + T5 forward
  rollout    = resident + trajectory 4·B·(N+1)·L·C + no-grad transformer forward of B = P·G inputs
               + FSDP's unsharded block params (current + prefetched, b_c each)
  decode     = resident + trajectory + VAE decode of the B images in one call (the VAE in the frozen dtype)
  policy     = resident + gradients 4·P (/n under FSDP; DDP: + 4·P flat all-reduce buffer; resident while a
               window's forward runs, as an accumulation window has several) + trajectory
               + forward+backward of n_pol inputs (chunk/step methods: the policy window,
               `grpo.policy_layout`; branching methods: P anchors with grad while their P·G·|λ| children
               complete without grad) + FSDP unsharded block params and fp32 block gradients
               (`fsdp_grad_sync=window` with more than one backward per window: + the unsharded fp32
               gradients of every FSDP unit, 4·P, kept between the window's backwards)
  every phase  + NCCL buffers (GPU, more than one rank) + a CUDA context per reward scored in a worker
               process on the rank's GPU (stated estimates: `capacity.io`)
The largest phase must fit the GPU's memory less `reserve_bytes` (the rank's own CUDA context, allocator
slack).

**I/O time per phase** (`capacity.io`): model fetch, checkpoint save, resume download and export at a stated
200 MB/s against the timeout each phase waits under (`io_wait_s` in the store, `dist_timeout_s` in a
collective): longer is a problem, over half of it a warning.

**Host memory per pod** = ranks × process baseline + max(load: every rank reads, concurrently, the frozen
components in their dtype (T5's `wo` in fp32) and, unless the load is sharded, the whole transformer in
the load dtype, before moving them to its device; the sharded load holds no copy of the transformer on the
host, only one tensor's rows (and a LoRA adapter's whole initial values, b_base·P), and its file pages are
page cache: at most one stored copy per node, reclaimable, not counted; checkpoint: rank 0 gathers
weights, AdamW state and EMA in fp32 on the host, under FSDP each rank's asynchronous save copies its
1/world share instead).

**Bytes per volume** (each path is placed on the pod volume whose mount is its longest prefix):
model cache ($CHUNKGRPO_CACHE, else $HOME/.cache/chunkgrpo) = the model folder (every component stored in
bf16; the pipeline's folders only) + every file each local reward downloads (its weights and the base
model it builds on: `reward_download_bytes`); `output_dir` = prompt
embeddings (every rank: prompts × (T·D_text + D_pooled) × model dtype) + checkpoints × (keep + 1: the new
one is complete before the oldest is deleted) + the final model. Checkpoint = weights 4·P + AdamW 8·P
(+ EMA 4·P). Every volume must fit its `sizeLimit`; disk-backed emptyDirs together the pod's
`ephemeral-storage` limit.

Validation: `tests/unit/test_capacity.py` runs a real rollout + policy step of the project's trainer on the
tiny and mid models on the CPU and compares the measured peak with this prediction.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from chunkgrpo.capacity.arch import (
    FLUX_DEV_STORED_BYTES,
    GiB,
    ModelArch,
    block_params,
    param_count,
    text_encode_peak,
    transformer_activation_peak,
    vae_decode_peak,
)
from chunkgrpo.capacity.io import (
    NCCL_BUFFER_BYTES,
    backwards_per_window,
    io_phases,
    io_problems,
    io_warnings,
    reward_worker_contexts,
)
from chunkgrpo.capacity.load import (
    adapter_shapes,
    frozen_host_bytes,
    stored_bytes,
    tensor_shapes,
    transformer_load,
)
from chunkgrpo.capacity.pool import Pool
from chunkgrpo.chunks import training_plan
from chunkgrpo.errors import UserError
from chunkgrpo.k8s.jobspec import JobSpec
from chunkgrpo.recipes import BRANCHING_METHODS

# Reward models resident on the rank's device while training: (parameters, bytes per parameter as loaded).
# Published model sizes: HPSv3 = Qwen2-VL-7B-Instruct backbone (bf16); HPSv2.1, PickScore and the CLIP
# scorer = OpenCLIP ViT-H-14 (fp32, the scorers' default dtype); ImageReward = BLIP ViT-L + BERT (fp32).
REWARD_MODELS = {"hpsv3": (8_291_375_616, 2), "hpsv2.1": (986_109_697, 4), "hpsv2": (986_109_697, 4),
                 "pickscore": (986_109_697, 4), "clip": (986_109_697, 4), "imagereward": (447_000_000, 4)}
# What a reward downloads into the model cache besides its own weights: the base model it builds on before
# loading its checkpoint (HPSv3: Qwen2-VL-7B-Instruct, the `hpsv3.processor` weights, bf16, ~16.6 GB).
REWARD_BASE_DOWNLOADS = {"hpsv3": REWARD_MODELS["hpsv3"][0] * 2}
PROCESS_HOST_BYTES = 3 * GiB  # host memory of one rank's Python + torch + CUDA runtime, before the model
# Seconds of one training iteration (rollout + decode + policy windows + optimizer steps) assumed when sizing
# a reward server's throughput; the config has no such field, so the plan states it with the rate.
ASSUMED_ITERATION_S = 120.0


def reward_download_bytes(name: str) -> int:
    """Bytes reward `name` puts into the model cache: its weights (published checkpoints in 16-bit) and the
    base model it builds on (`REWARD_BASE_DOWNLOADS`)."""
    return REWARD_MODELS.get(name, (0, 0))[0] * 2 + REWARD_BASE_DOWNLOADS.get(name, 0)


# ------------------------------------------------------------------------------ the plan
@dataclasses.dataclass
class Item:
    resource: str           # e.g. "GPU memory per rank"
    what: str               # e.g. "policy phase"
    need: int
    have: int | None        # None = unlimited / not checked
    parts: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return self.have is None or self.need <= self.have


@dataclasses.dataclass
class CapacityPlan:
    preset: str
    pool: Pool
    world: int
    facts: dict
    items: list[Item]
    io: list = dataclasses.field(default_factory=list)  # capacity.io.IoPhase per single-rank I/O phase

    def problems(self) -> list[str]:
        """One sentence per resource that does not fit, naming it and by how much, and per I/O phase
        longer than the timeout it waits under."""
        return [f"{i.resource} ({i.what}): needs {_gib(i.need)} of {_gib(i.have)} "
                f"(+{_gib(i.need - i.have)} over)"
                for i in self.items if not i.fits] + io_problems(self.io)

    def warnings(self) -> list[str]:
        return io_warnings(self.io)

    def to_dict(self) -> dict:
        pool = {k: v for k, v in dataclasses.asdict(self.pool).items() if k != "env"}
        return {
            "preset": self.preset,
            "pool": pool,
            "world": self.world,
            "facts": self.facts,
            "fits": not self.problems(),
            "problems": self.problems(),
            "warnings": self.warnings(),
            "io": [{**dataclasses.asdict(p), "fits": p.fits} for p in self.io],
            "items": [{**dataclasses.asdict(i), "fits": i.fits} for i in self.items],
        }


def _gib(n: int | None) -> str:
    return "unlimited" if n is None else f"{n / GiB:.1f} GiB"


def capacity_plan(cfg, pool: Pool, *, nodes: int = 1, output_dir: str = "", preset: str = "",
                  device: str = "cuda", reserve_bytes: int = 3 * GiB, arch: ModelArch | None = None,
                  prompts: int = 0, iteration_s: float = ASSUMED_ITERATION_S) -> CapacityPlan:
    """The plan of TrainConfig `cfg` on `nodes` pods of `pool` (one rank per GPU; `device="cpu"` = one CPU
    rank).

    `output_dir` is the trainer's output folder in the pod ('' = the launcher's default,
    `JobSpec.output_dir`); `prompts` the number of distinct training prompts (0 = unknown: every prompt of
    the run is distinct). A reward with a `url` is served (`chunkgrpo reward-server` on its own GPU): its
    model is on no training rank and in no model cache; the plan sizes its server instead (the model's GPU
    memory and the images per second the run sends it, assuming `iteration_s` seconds per iteration)."""
    arch = arch or ModelArch.for_model(cfg.model)
    gpu = device != "cpu"
    ranks_per_node = max(1, pool.gpus_per_node) if gpu else 1
    world = ranks_per_node * nodes
    bf16 = cfg.mixed_precision == "bf16" or (cfg.mixed_precision == "auto" and gpu)
    b_c = 2 if bf16 else 4                                   # compute (activation) bytes
    lora = cfg.lora.enabled
    b_base = 2 if (bf16 and lora) else 4  # load dtype of the transformer (`Trainer.setup`)
    b_frozen = 2 if bf16 else 4  # text encoders + VAE (`load_flux(frozen_dtype=)`)
    fsdp = cfg.distributed == "fsdp" and world > 1
    shard = world if fsdp else 1
    s = cfg.sampling
    compute_dtype = torch.bfloat16 if bf16 else torch.float32

    tr = arch.build("transformer", compute_dtype)
    W = param_count(tr)
    shapes = tensor_shapes(tr)  # the base transformer's tensors, before any adapter
    adapters: list[torch.Size] = []
    if lora:  # the adapter on the meta transformer: its activations are traced, only it gets gradients
        from peft import LoraConfig

        with torch.device("meta"):
            tr.add_adapter(
                LoraConfig(
                    r=cfg.lora.rank,
                    lora_alpha=cfg.lora.alpha,
                    lora_dropout=cfg.lora.dropout,
                    target_modules=list(cfg.lora.targets),
                    init_lora_weights=True,
                )
            )
        adapters = adapter_shapes(tr)
        tr.to(compute_dtype)
        for n, p in tr.named_parameters():
            p.requires_grad_("lora_" in n)
        P = sum(p.numel() for p in tr.parameters() if p.requires_grad)
        if not P:
            raise UserError(f"lora.targets {cfg.lora.targets} match no module of the transformer")
    else:
        tr.requires_grad_(True)
        P = W
    counts = {n: param_count(arch.build(n)) for n in ("text_encoder", "text_encoder_2", "vae")}
    vae_scale = 2 ** (len(arch.vae["block_out_channels"]) - 1)
    if s.height % (2 * vae_scale) or s.width % (2 * vae_scale):
        raise UserError(f"resolution {s.height}x{s.width} must be a multiple of {2 * vae_scale}")
    L = (s.height // vae_scale // 2) * (s.width // vae_scale // 2)
    C = tr.config.in_channels
    T = s.max_sequence_length
    D_txt, D_pool = tr.config.joint_attention_dim, tr.config.pooled_projection_dim
    N = s.num_steps
    sizes = training_plan(cfg.method, cfg.chunks, N - 1, read_plan_file=False).sizes
    G, Pp = cfg.group_size, cfg.prompts_per_rank
    B = Pp * G
    branching = cfg.method in BRANCHING_METHODS
    iterations = cfg.max_iterations or math.ceil(cfg.max_steps / max(1, _steps_per_iteration(cfg)))
    n_prompts = Pp * iterations if not prompts else min(prompts, Pp * iterations)

    # ---- activations, simulated on meta at the run's shapes
    roll_fwd, _ = transformer_activation_peak(tr, B, L, T, compute_dtype, grad=False, checkpointing=False)
    if branching:
        grans = len(cfg.granularities) if cfg.method == "granular" else 1
        n_pol = Pp
        pol_peak, pol_saved = transformer_activation_peak(tr, Pp, L, T, compute_dtype, grad=True,
                                                          checkpointing=cfg.gradient_checkpointing)
        complete_fwd, _ = transformer_activation_peak(tr, B * grans, L, T, compute_dtype, grad=False,
                                                      checkpointing=False)
        policy_act = max(pol_peak, pol_saved + complete_fwd)
        decode_batch = B
    else:
        if fsdp:  # a fixed number of whole units per forward (`grpo.policy_layout`)
            n_pol = max(sizes) * max(1, cfg.policy_batch // max(sizes))
        elif cfg.chunk_backward == "graph":  # whole units packed up to the budget; a bigger unit goes whole
            n_pol = max(max(sizes), cfg.policy_batch)
        else:  # auto / accumulate / per_step: at most `policy_batch` inputs in one graph
            n_pol = cfg.policy_batch
        n_pol = min(n_pol, B * (N - 1))
        policy_act, pol_saved = transformer_activation_peak(tr, n_pol, L, T, compute_dtype, grad=True,
                                                            checkpointing=cfg.gradient_checkpointing)
        decode_batch = B
    frozen_dtype = torch.bfloat16 if b_frozen == 2 else torch.float32
    vae = arch.build("vae", frozen_dtype)
    decode = vae_decode_peak(vae, decode_batch, s.height, s.width, frozen_dtype)
    t5 = arch.build("text_encoder_2", frozen_dtype)
    encode = text_encode_peak(t5, min(8, n_prompts), T)
    blocks = len(getattr(tr, "transformer_blocks", [])) + len(getattr(tr, "single_transformer_blocks", []))
    # what autograd keeps per token and block without checkpointing (the saved set of one forward, batch 1)
    _, saved_1 = transformer_activation_peak(tr, 1, L, T, compute_dtype, grad=True, checkpointing=False,
                                             backward=False)
    per_token_block = saved_1 / ((L + T) * max(1, blocks))

    # ---- per-rank GPU memory
    local_rewards = [r for r in cfg.rewards if not r.url]  # a served reward's model is on its server's GPU
    rewards = sum(math.prod(REWARD_MODELS.get(r.name, (0, 0))) for r in local_rewards)
    freed = sum(math.prod(REWARD_MODELS.get(r.name, (0, 0))) for r in cfg.rewards if r.url)
    # with every reward served, no phase has a reward part at all; otherwise the local ones' sum
    reward_part = {} if (freed and not rewards) else {"reward models": rewards}
    # stated estimates (`capacity.io`): on the device in every phase, from process start
    contexts = reward_worker_contexts(cfg.rewards, gpu)
    reward_part.update({"reward worker CUDA contexts": contexts} if contexts else {})
    reward_part.update({"NCCL buffers": NCCL_BUFFER_BYTES} if (gpu and world > 1) else {})
    weights = (4 * W // shard) if not lora else (b_base * W + 4 * P) // shard
    adam = 8 * P // shard
    ema = (4 * P // shard) if cfg.ema.decay > 0 else 0
    embeds = n_prompts * (T * D_txt + D_pool) * b_base
    vae_w = counts["vae"] * b_frozen
    resident = {"transformer weights": weights, "AdamW state": adam, "EMA": ema, "VAE": vae_w,
                **reward_part, "prompt embeddings": embeds}
    traj = 4 * B * (N + 1) * L * C + 4 * B * N
    block = block_params(tr)
    unsharded_fwd = 2 * block * b_c if fsdp else 0
    grads = 4 * P // shard + (4 * P if (not fsdp and world > 1) else 0)
    # the transformer as `train.model_load` reads it: sharded (FSDP, LoRA or full fine-tuning) or whole
    sharded = fsdp
    b_stored = (stored_bytes(arch.source, FLUX_DEV_STORED_BYTES) if Path(arch.source).is_dir()
                else FLUX_DEV_STORED_BYTES)
    tr_load = transformer_load(shapes, world=shard, sharded=sharded, load_bytes=b_base, stored_bytes=b_stored,
                               fsdp=fsdp, adapters=adapters)
    frozen_w = sum(counts.values()) * b_frozen
    load = {**tr_load["parts"], "text encoders + VAE": frozen_w, **reward_part}
    text_encoders = (counts["text_encoder"] + counts["text_encoder_2"]) * b_frozen
    encode_phase = {"transformer weights": weights, "text encoders": text_encoders, "VAE": vae_w,
                    **reward_part, "prompt embeddings": embeds, "T5 forward": encode}
    rollout = {**resident, "trajectory": traj, "transformer no-grad forward": roll_fwd,
               "FSDP unsharded blocks": unsharded_fwd}
    decoding = {**resident, "trajectory": traj, f"VAE decode of {decode_batch} images": decode}
    if branching:  # gradients accumulate across the branching steps, between the children's completions
        rollout["gradients"] = decoding["gradients"] = grads
    # gradients are resident while a window's forward runs: an accumulation window has several forwards
    policy = {**resident, "gradients": grads, "trajectory": traj, "policy forward+backward": policy_act,
              "FSDP unsharded blocks + block grads": (unsharded_fwd + 4 * block) if fsdp else 0}
    backwards = backwards_per_window(cfg, sizes, fsdp, branching)
    if fsdp and getattr(cfg, "fsdp_grad_sync", "window") == "window" and backwards > 1:
        policy["FSDP no-sync gradients (every unit, fp32)"] = 4 * P
    phases = (("load", load), ("text encoding", encode_phase), ("rollout", rollout), ("decode", decoding),
              ("policy", policy))
    cap = (pool.gpu_memory - reserve_bytes) if (gpu and pool.gpu_memory) else None
    items = [Item("GPU memory per rank", f"{phase} phase", sum(parts.values()), cap, parts)
             for phase, parts in phases]

    # ---- host memory per pod
    frozen_host = frozen_w + frozen_host_bytes(t5, b_frozen)  # read on the host, then moved
    load_host = max(tr_load["host"], frozen_host) if sharded else tr_load["host"] + frozen_host
    ckpt_host = 4 * P + 8 * P + (4 * P if cfg.ema.decay > 0 else 0)
    if fsdp:  # sharded: each rank's asynchronous save copies its own share to host memory, nothing gathers
        ckpt_host = ranks_per_node * -(-ckpt_host // world)
    host = {"processes": ranks_per_node * PROCESS_HOST_BYTES,
            "peak of load / checkpoint": max(ranks_per_node * load_host, ckpt_host)}
    items.append(
        Item("host memory per pod", "load or checkpoint", sum(host.values()), pool.memory_limit, host)
    )

    # ---- bytes per volume
    stored = FLUX_DEV_STORED_BYTES
    model_folder = (W + sum(counts.values())) * stored
    if arch.folder_bytes is not None:
        model_folder = arch.folder_bytes
    reward_files = sum(reward_download_bytes(r.name) for r in local_rewards)
    checkpoint = 4 * P + 8 * P + (4 * P if cfg.ema.decay > 0 else 0)
    keep = cfg.checkpoint.keep
    total_steps = iterations * _steps_per_iteration(cfg)
    n_ckpt = (keep + 1) if keep else max(1, math.ceil(total_steps / max(1, cfg.checkpoint.every or 10**9)))
    out_dir = output_dir or _default_output_dir()
    home = pool.env.get("HOME", str(Path.home()))
    cache_dir = pool.env.get("CHUNKGRPO_CACHE") or f"{home.rstrip('/')}/.cache/chunkgrpo"
    embed_dir = cfg.embed_cache_dir or f"{out_dir.rstrip('/')}/embeds"
    paths = {
        "model cache": (cache_dir, model_folder + reward_files),
        "prompt embeddings": (embed_dir, ranks_per_node * embeds),
        f"checkpoints × {n_ckpt}": (f"{out_dir.rstrip('/')}/checkpoints", n_ckpt * checkpoint),
        "final model": (f"{out_dir.rstrip('/')}/final", 4 * P),
    }
    per_volume: dict[str, dict[str, int]] = {}
    for what, (path, nbytes) in paths.items():
        v = pool.volume_for(path) if pool.volumes else None
        key = (
            f"{v.name} ({v.mount})" if v else ("no volume: root filesystem" if pool.volumes else "local disk")
        )
        per_volume.setdefault(key, {})[f"{what}: {path}"] = nbytes
    disk_total = 0
    for key, parts in per_volume.items():
        v = next((x for x in pool.volumes if key.startswith(x.name + " (")), None)
        have = v.size_limit if v else (0 if pool.volumes else None)  # the root filesystem is read-only
        items.append(
            Item(f"volume {key}", "sizeLimit" if v else "read-only root", sum(parts.values()), have, parts)
        )
        if v is None or v.medium in ("", "other"):
            disk_total += sum(parts.values())
    if pool.ephemeral_limit is not None:
        items.append(
            Item("ephemeral storage per pod", "disk-backed emptyDirs", disk_total, pool.ephemeral_limit)
        )
    # ---- reward servers: one per served reward, on a GPU of the pool's kind
    images_per_iteration = B * world
    services = []
    for r in cfg.rewards:
        if not r.url:
            continue
        gpu_bytes = math.prod(REWARD_MODELS.get(r.name, (0, 0)))
        services.append({"name": r.name, "url": r.url, "gpu_bytes": gpu_bytes,
                         "images_per_iteration": images_per_iteration, "iteration_s": iteration_s,
                         "images_per_s": images_per_iteration / iteration_s})
        items.append(Item(f"reward server {r.name}", "GPU memory (model)", gpu_bytes, cap,
                          {f"{r.name} weights": gpu_bytes}))
    facts = {
        "architecture": arch.source,
        "transformer_params": W,
        "trainable_params": P,
        "text_encoder_params": counts["text_encoder"],
        "text_encoder_2_params": counts["text_encoder_2"],
        "vae_params": counts["vae"],
        "image_tokens": L,
        "text_tokens": T,
        "rollout_batch": B,
        "policy_inputs_per_forward": n_pol,
        "world": world,
        "ranks_per_node": ranks_per_node,
        "fsdp": fsdp,
        "lora": lora,
        "compute_dtype": "bf16" if bf16 else "fp32",
        "load_dtype": "bf16" if b_base == 2 else "fp32",
        "load_path": "sharded" if sharded else "whole",
        "transformer_load_device_bytes": tr_load["device"],
        "transformer_load_host_bytes": tr_load["host"],
        "gradient_checkpointing": cfg.gradient_checkpointing,
        "activation_bytes_per_token_per_block": per_token_block,
        "checkpoint_bytes": checkpoint,
        "gpu_reserve_bytes": reserve_bytes if gpu else 0,
        "prompts_per_rank_in_run": n_prompts,
        "reward_bytes_freed_per_rank": freed,
        "reward_services": services,
    }
    facts["backwards_per_window"] = backwards
    io = io_phases(cfg, model_folder=model_folder, checkpoint=checkpoint, final=4 * P,
                   writers=world if fsdp else 1)
    return CapacityPlan(preset, pool, world, facts, items, io)


def _steps_per_iteration(cfg) -> int:
    from chunkgrpo.train.methods import get_method

    return get_method(cfg.method).steps_per_iteration(cfg)


def _default_output_dir() -> str:
    return next(f.default for f in dataclasses.fields(JobSpec) if f.name == "output_dir")


# ------------------------------------------------------------------------------ output


def _service_line(svc: dict) -> str:
    return (f"reward server {svc['name']} ({svc['url']}): {_gib(svc['gpu_bytes'])} of GPU memory for the "
            f"model, off every training rank; throughput needed {svc['images_per_s']:.2f} images/s = "
            f"{svc['images_per_iteration']} images per iteration / {svc['iteration_s']:g} s per iteration "
            "(assumed)")


def render_table(plan: CapacityPlan) -> str:
    f = plan.facts
    head = (
        f"capacity plan: {plan.preset or 'config'} on pool {plan.pool.name} ({plan.pool.source}); "
        f"{f['world']} rank(s), {f['ranks_per_node']} per node, {plan.pool.gpu_product or 'CPU'}; "
        f"{'FSDP' if f['fsdp'] else 'DDP/single'}, {'LoRA' if f['lora'] else 'full FT'}, "
        f"compute {f['compute_dtype']}, load {f['load_dtype']}; "
        f"transformer {f['transformer_params']:,} params, "
        f"trainable {f['trainable_params']:,}; "
        f"{f['image_tokens']} image + {f['text_tokens']} text tokens; rollout batch {f['rollout_batch']}, "
        f"policy inputs per forward {f['policy_inputs_per_forward']}"
    )
    rows = [("resource", "phase / limit", "need", "have", "fits", "largest parts")]
    for i in plan.items:
        top = sorted(i.parts.items(), key=lambda kv: -kv[1])[:3]
        rows.append((i.resource, i.what, _gib(i.need), _gib(i.have), "yes" if i.fits else "NO",
                     ", ".join(f"{k} {_gib(v)}" for k, v in top if v)))
    widths = [max(len(r[c]) for r in rows) for c in range(5)]
    lines = [head, ""]
    for n, r in enumerate(rows):
        lines.append("  ".join(r[c].ljust(widths[c]) for c in range(5)) + "  " + r[5])
        if n == 0:
            lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 13)
    if f.get("reward_bytes_freed_per_rank"):
        lines.append(f"served rewards free {_gib(f['reward_bytes_freed_per_rank'])} of GPU memory per rank")
    lines += [_service_line(svc) for svc in f.get("reward_services", [])]
    lines += ["I/O " + p.line() for p in plan.io]
    probs = plan.problems()
    lines += [f"warning: {w}" for w in plan.warnings()]
    lines += ["", "FITS" if not probs else "DOES NOT FIT: " + "; ".join(probs)]
    return "\n".join(lines)


def render_markdown(plan: CapacityPlan) -> str:
    f = plan.facts
    rows = "\n".join(
        f"| {i.resource} | {i.what} | {_gib(i.need)} | {_gib(i.have)} | {'yes' if i.fits else '**NO**'} | "
        + ", ".join(f"{k} {_gib(v)}" for k, v in sorted(i.parts.items(), key=lambda kv: -kv[1]) if v) + " |"
        for i in plan.items)
    probs = plan.problems()
    verdict = "**fits**" if not probs else "**does not fit**: " + "; ".join(probs)
    return (f"# Capacity plan: {plan.preset or 'config'} on {plan.pool.name}\n\n{verdict}\n\n"
            f"{f['world']} rank(s) ({f['ranks_per_node']} per node, {plan.pool.gpu_product or 'CPU'}), "
            f"{'FSDP' if f['fsdp'] else 'DDP'}, {'LoRA' if f['lora'] else 'full fine-tuning'}, "
            f"compute {f['compute_dtype']}; "
            f"transformer {f['transformer_params']:,} parameters ({f['architecture']}), trainable "
            f"{f['trainable_params']:,}; pool from {plan.pool.source}.\n\n"
            f"| resource | phase / limit | need | have | fits | parts |\n|---|---|---|---|---|---|\n{rows}\n"
            + (f"\nServed rewards free {_gib(f['reward_bytes_freed_per_rank'])} of GPU memory per rank.\n"
               if f.get("reward_bytes_freed_per_rank") else "")
            + "".join(f"\n{_service_line(svc)}\n" for svc in f.get("reward_services", []))
            + ("\nSingle-rank I/O (estimated):\n\n" + "".join(f"- {p.line()}\n" for p in plan.io)
               if plan.io else "")
            + "".join(f"\n**warning**: {w}\n" for w in plan.warnings()))

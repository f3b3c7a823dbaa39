"""Capacity plan: per-rank GPU memory, host memory and bytes per volume of a training run, predicted
before any GPU time from the model's architecture (instantiated on the meta device: no weights), the
recipe (`TrainConfig`) and the pool (the training runtime's pod: GPUs, memory, volumes).

    plan = capacity_plan(TrainConfig.load("chunk_grpo_flux"), load_pool("h800"))
    print(render_table(plan)); plan.problems()   # ["GPU memory per rank (policy phase): needs … (+… over)"]

**Architecture.** `ModelArch` holds the four component configs (FLUX transformer, CLIP-L text, T5 text,
VAE): those of a local diffusers folder, else FLUX.1-dev's published ones (`FLUX_DEV`). Each is built
on the meta device (`torch.device("meta")`: shapes only), so parameter counts are exact, e.g.
FLUX.1-dev's transformer has exactly `FLUX_DEV_TRANSFORMER_PARAMS` = 11,901,408,320 parameters.

**Activations are simulated, not guessed.** The transformer (and the VAE decoder, the T5 encoder) runs
its real diffusers forward on meta tensors at the run's exact shapes (batch, image tokens
L_img = (H/16)·(W/16), text tokens T = max_sequence_length) under `LiveBytes`, a dispatch mode that
adds every new storage's bytes when an op creates it and removes them when the last tensor using it
dies; autograd's saved tensors are kept visible (a pass-through saved-tensors hook), so the peak is
the exact peak of live activation bytes of the computation — with or without gradient checkpointing,
which changes what is saved (block inputs only, then one block recomputed in backward). Parameter
gradients are pre-allocated outside the count (they are accounted below, sharded or not); the
transient gradient tensors of each op are inside it. Attention is counted as a flash / memory-efficient
kernel: it keeps q, k, v, the output and an fp32 log-sum-exp (B, H, L) — O(L), never the L×L matrix
(what PyTorch's CUDA SDPA and its CPU flash kernel do). The plan reports the result as
`activation_bytes_per_token_per_block`: what autograd keeps per token (image + text) and block without
checkpointing (FLUX.1-dev in bf16: 162,415 bytes ≈ 26 × the 3072-wide hidden state in bf16).

**Memory per rank** (P = trainable params, W = transformer params, n = world size, b_c = 2 for bf16
compute on GPU, 4 for fp32; every term in bytes):
  resident   = transformer weights (FSDP full FT: 4·W/n fp32 master shards; DDP full FT: 4·W;
               LoRA: b_base·W + 4·P) + AdamW 8·P (/n under FSDP) + EMA 4·P (/n) + VAE + reward models
               + prompt-embedding cache (every prompt of the run, kept on the device, model dtype)
  load       = every pipeline component at once (`load_flux` moves the whole pipeline to the device before
               FSDP sharding): the transformer in the load dtype (fp32 for full fine-tuning), the frozen
               text encoders and VAE in bf16 under bf16 mixed precision (`frozen_dtype`) + reward models
  text enc.  = resident transformer weights + text encoders + VAE + reward models + embeddings + T5 forward
  rollout    = resident + trajectory 4·B·(N+1)·L·C + no-grad transformer forward of B = P·G inputs
               + FSDP's unsharded block params (current + prefetched, b_c each)
  decode     = resident + trajectory + VAE decode of the B images in one call (the VAE in the frozen dtype)
  policy     = resident + gradients 4·P (/n under FSDP; DDP: + 4·P flat all-reduce buffer; resident while a
               window's forward runs, as an accumulation window has several) + trajectory
               + forward+backward of n_pol inputs (chunk/step methods: the policy window,
               `grpo.policy_layout`; branching methods: P anchors with grad while their P·G·|λ| children
               complete without grad) + FSDP unsharded block params and fp32 block gradients
The largest phase must fit the GPU's memory less `reserve_bytes` (CUDA context, NCCL, allocator slack).

**Host memory per pod** = ranks × process baseline + max(load: every rank builds the pipeline on the host
in the load dtype before moving it, concurrently; checkpoint: rank 0 gathers weights, AdamW state and EMA
in fp32 on the host).

**Bytes per volume** (each path is placed on the pod volume whose mount is its longest prefix):
model cache ($CHUNKGRPO_CACHE, else $HOME/.cache/chunkgrpo) = the model folder (every component stored in
bf16 + for FLUX.1-dev the hub snapshot's single-file copies) + reward weights; `output_dir` = prompt
embeddings (every rank: prompts × (T·D_text + D_pooled) × model dtype) + checkpoints × (keep + 1: the new
one is complete before the oldest is deleted) + the final model. Checkpoint = weights 4·P + AdamW 8·P
(+ EMA 4·P). Every volume must fit its `sizeLimit`; disk-backed emptyDirs together the pod's
`ephemeral-storage` limit.

Validation: `tests/test_capacity.py` runs a real rollout + policy step of the project's trainer on the
tiny and mid models on the CPU and compares the measured peak with this prediction.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import weakref
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from chunkgrpo.chunks import training_plan
from chunkgrpo.errors import UserError
from chunkgrpo.recipes import BRANCHING_METHODS

GiB = 2**30

# ------------------------------------------------------------------------------ published configs
# FLUX.1-dev as published on the Hugging Face hub, repo black-forest-labs/FLUX.1-dev: the values of
# transformer/config.json, text_encoder/config.json (CLIP ViT-L/14 text tower), text_encoder_2/config.json
# (T5 v1.1 XXL encoder, google/t5-v1_1-xxl) and vae/config.json, as the diffusers/transformers classes
# take them. Defaults of the classes are not repeated.
FLUX_DEV = {
    "transformer": dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                        num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                        guidance_embeds=True, axes_dims_rope=[16, 56, 56]),
    "text_encoder": dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_attention_heads=12,
                         num_hidden_layers=12, max_position_embeddings=77, projection_dim=768,
                         hidden_act="quick_gelu"),
    "text_encoder_2": dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                           feed_forward_proj="gated-gelu", relative_attention_num_buckets=32,
                           relative_attention_max_distance=128, tie_word_embeddings=False),
    "vae": dict(in_channels=3, out_channels=3, latent_channels=16, down_block_types=["DownEncoderBlock2D"] * 4,
                up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[128, 256, 512, 512],
                layers_per_block=2, norm_num_groups=32, sample_size=1024, use_quant_conv=False,
                use_post_quant_conv=False, scaling_factor=0.3611, shift_factor=0.1159, act_fn="silu"),
}
FLUX_DEV_TRANSFORMER_PARAMS = 11_901_408_320  # the published count ("12 billion parameters")
FLUX_DEV_STORED_BYTES = 2  # every component of the hub folder is stored in bf16
# The hub snapshot also holds the single-file checkpoints flux1-dev.safetensors (transformer, bf16) and
# ae.safetensors (VAE, fp32); `chunkgrpo models sync` copies the snapshot whole.
FLUX_DEV_SINGLE_FILES = {"transformer": 2, "vae": 4}

# Total memory of the GPU products named by the pools' node selectors (nvidia.com/gpu.product, GPU
# Feature Discovery). 81559 MiB is what nvidia-smi reports for the 80 GB HBM3 SXM parts (H100 and H800).
GPU_MEMORY = {"NVIDIA-H800": 81559 * 2**20, "NVIDIA-H100-80GB-HBM3": 81559 * 2**20}
# Reward models resident on the rank's device while training: (parameters, bytes per parameter as loaded).
# Published model sizes: HPSv3 = Qwen2-VL-7B-Instruct backbone (bf16); HPSv2.1, PickScore and the CLIP
# scorer = OpenCLIP ViT-H-14 (fp32, the scorers' default dtype); ImageReward = BLIP ViT-L + BERT (fp32).
REWARD_MODELS = {"hpsv3": (8_291_375_616, 2), "hpsv2.1": (986_109_697, 4), "hpsv2": (986_109_697, 4),
                 "pickscore": (986_109_697, 4), "clip": (986_109_697, 4), "imagereward": (447_000_000, 4)}
PROCESS_HOST_BYTES = 3 * GiB  # host memory of one rank's Python + torch + CUDA runtime, before the model


# ------------------------------------------------------------------------------ meta-device tracing
class LiveBytes(TorchDispatchMode):
    """Bytes of live tensor storage created inside the mode (current and peak). A storage is counted once,
    when the first op creates it, and released when the last tensor seen with it is freed; views of
    storages made outside the mode (parameters, inputs) are not counted."""

    def __init__(self):
        super().__init__()
        self.refs: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.live = 0
        self.peak = 0

    def _release(self, key: int) -> None:
        self.refs[key] -= 1
        if not self.refs[key]:
            self.live -= self.sizes.pop(key)
            del self.refs[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                key = t.untyped_storage()._cdata
                if key in inputs and key not in self.refs:
                    continue  # a view of (or in-place on) a storage that existed before: parameters, inputs
                if key not in self.refs:
                    self.refs[key], self.sizes[key] = 0, t.untyped_storage().nbytes()
                    self.live += self.sizes[key]
                self.refs[key] += 1
                weakref.finalize(t, self._release, key)
        self.peak = max(self.peak, self.live)
        return out


class _FlashAttention(torch.autograd.Function):
    """Shapes of a flash / memory-efficient attention kernel: output like q (v's head dim), saves q, k, v,
    output and the fp32 log-sum-exp (B, H, Lq); backward returns dq, dk, dv."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = q.new_empty(q.shape[:-1] + v.shape[-1:])
        ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:-1], dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _flash_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if query.device.type != "meta":
        return _ORIGINAL_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                              scale=scale, enable_gqa=enable_gqa)
    return _FlashAttention.apply(query, key, value)


_ORIGINAL_SDPA = torch.nn.functional.scaled_dot_product_attention


@contextmanager
def _traced(grad: bool):
    """LiveBytes over a block of meta computation, attention counted as a flash kernel."""
    torch.nn.functional.scaled_dot_product_attention = _flash_sdpa
    mode = LiveBytes()
    try:
        keep_saved = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        with torch.set_grad_enabled(grad), keep_saved, mode:
            yield mode
    finally:
        torch.nn.functional.scaled_dot_product_attention = _ORIGINAL_SDPA


def _quiet():
    import diffusers.utils.logging as dlog
    import transformers.utils.logging as tlog

    dlog.set_verbosity_error()
    tlog.set_verbosity_error()


@dataclasses.dataclass
class ModelArch:
    """The four component configs of a FLUX pipeline and where they came from."""

    transformer: dict
    text_encoder: dict
    text_encoder_2: dict
    vae: dict
    source: str = "FLUX.1-dev (published configs)"
    hub_snapshot: bool = True  # the cached folder is the hub snapshot (single-file copies included)
    folder_bytes: int | None = None  # the model folder's size when known (an S3 folder artifact's manifest)

    @classmethod
    def from_folder(cls, path: str | os.PathLike) -> "ModelArch":
        root = Path(path)
        cfgs = {}
        for name in ("transformer", "text_encoder", "text_encoder_2", "vae"):
            f = root / name / "config.json"
            if not f.is_file():
                raise UserError(f"model {root} has no {name}/config.json (expected a diffusers FLUX pipeline folder)")
            d = json.loads(f.read_text())
            cfgs[name] = {k: v for k, v in d.items() if not k.startswith("_")}
        return cls(**cfgs, source=str(root), hub_snapshot=False)

    @classmethod
    def from_s3(cls, uri: str, store=None) -> "ModelArch":
        """The configs of an s3:// folder artifact of the model cache (four small reads + its manifest)."""
        from chunkgrpo.store import ArtifactStore

        store = store or ArtifactStore()
        base = uri.rstrip("/")
        cfgs = {n: {k: v for k, v in store.get_json(f"{base}/{n}/config.json").items() if not k.startswith("_")}
                for n in ("transformer", "text_encoder", "text_encoder_2", "vae")}
        manifest = store.read_manifest(base)
        return cls(**cfgs, source=uri, hub_snapshot=False,
                   folder_bytes=manifest.total_bytes if manifest is not None else None)

    @classmethod
    def for_model(cls, model: str) -> "ModelArch":
        """A local diffusers folder's configs, an s3:// folder artifact's (when S3 is configured and has
        them); anything else (a hub id, '', S3 unreachable) = FLUX.1-dev's published configs."""
        if model and not model.startswith("s3://") and (Path(model).expanduser() / "model_index.json").is_file():
            return cls.from_folder(Path(model).expanduser())
        if model.startswith("s3://") and os.environ.get("AWS_ACCESS_KEY_ID"):
            try:
                return cls.from_s3(model)
            except Exception as e:  # noqa: BLE001 - said in the plan's `architecture` line, never silent
                return cls(**FLUX_DEV, source=f"FLUX.1-dev (published configs; {model} unreadable: "
                                              f"{type(e).__name__})")
        return cls(**FLUX_DEV)

    def build(self, name: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
        """Component `name` on the meta device (no memory), in `dtype`."""
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        _quiet()
        with torch.device("meta"):
            if name == "transformer":
                from diffusers import FluxTransformer2DModel

                m = FluxTransformer2DModel.from_config(self.transformer)
            elif name == "vae":
                from diffusers import AutoencoderKL

                m = AutoencoderKL.from_config(self.vae)
            elif name == "text_encoder":
                from transformers import CLIPTextConfig, CLIPTextModel

                m = CLIPTextModel(CLIPTextConfig(**self.text_encoder))
            elif name == "text_encoder_2":
                from transformers import T5Config, T5EncoderModel

                m = T5EncoderModel(T5Config(**self.text_encoder_2))
            else:
                raise ValueError(name)
        return m.to(dtype)


def param_count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _block_params(transformer: torch.nn.Module) -> int:
    blocks = [*getattr(transformer, "transformer_blocks", []), *getattr(transformer, "single_transformer_blocks", [])]
    return max((param_count(b) for b in blocks), default=param_count(transformer))


def transformer_activation_peak(tr: torch.nn.Module, batch: int, img_tokens: int, txt_tokens: int,
                                dtype: torch.dtype, *, grad: bool, checkpointing: bool,
                                count_grads: bool = False, backward: bool = True) -> tuple[int, int]:
    """(peak, after-forward) live activation bytes of one transformer call on `batch` inputs, simulated on
    the meta device; with `grad` the backward is included. Parameter gradients are pre-allocated (not
    counted: FSDP shards them) unless `count_grads`, when they are allocated as backward produces them
    (in the parameters' dtype) and counted. The transformer must be on meta, in the compute dtype; only
    parameters with `requires_grad` (LoRA: the adapters) get gradients."""
    cfg = tr.config
    trainable = [p.requires_grad for p in tr.parameters()]
    if not grad:
        tr.requires_grad_(False)
    if checkpointing and grad:
        tr.enable_gradient_checkpointing()
    elif getattr(tr, "gradient_checkpointing", False):
        tr.disable_gradient_checkpointing()
    if grad and not count_grads:
        for p in tr.parameters():
            if p.requires_grad:
                p.grad = torch.empty_like(p)
    with torch.device("meta"):
        kw = dict(hidden_states=torch.empty(batch, img_tokens, cfg.in_channels, dtype=dtype),
                  encoder_hidden_states=torch.empty(batch, txt_tokens, cfg.joint_attention_dim, dtype=dtype),
                  pooled_projections=torch.empty(batch, cfg.pooled_projection_dim, dtype=dtype),
                  timestep=torch.empty(batch), img_ids=torch.empty(img_tokens, 3), txt_ids=torch.empty(txt_tokens, 3),
                  guidance=torch.empty(batch) if cfg.guidance_embeds else None)
    after = 0
    with _traced(grad) as m:
        out = tr(**kw, return_dict=False)[0].float()
        if grad:
            after = m.live
            if backward:
                out.sum().backward()
        del out
    for p, flag in zip(tr.parameters(), trainable):
        p.grad = None
        p.requires_grad_(flag)
    return m.peak, after


def vae_decode_peak(vae: torch.nn.Module, batch: int, height: int, width: int, dtype: torch.dtype) -> int:
    """Live bytes of decoding `batch` latents to height × width images (no grad), on meta."""
    scale = 2 ** (len(vae.config.block_out_channels) - 1)
    with torch.device("meta"):
        z = torch.empty(batch, vae.config.latent_channels, height // scale, width // scale, dtype=dtype)
    with _traced(False) as m:
        vae.decode(z, return_dict=False)
    return m.peak


def text_encode_peak(t5: torch.nn.Module, batch: int, tokens: int) -> int:
    with torch.device("meta"):
        ids = torch.zeros(batch, tokens, dtype=torch.long)
    with _traced(False) as m:
        t5(input_ids=ids)
    return m.peak


# ------------------------------------------------------------------------------ the pool
@dataclasses.dataclass
class Volume:
    name: str
    mount: str
    size_limit: int | None  # bytes; None = no limit
    medium: str = ""        # "Memory" = tmpfs (counts against the memory limit)


@dataclasses.dataclass
class Pool:
    """One training pod of a GPU pool, as the training runtime defines it."""

    name: str
    gpu_product: str
    gpu_memory: int
    gpus_per_node: int
    memory_limit: int | None
    ephemeral_limit: int | None
    volumes: list[Volume]
    env: dict[str, str]
    source: str

    def volume_for(self, path: str) -> Volume | None:
        best = None
        for v in self.volumes:
            m = v.mount.rstrip("/") or "/"
            if (path == m or path.startswith(m + "/")) and (best is None or len(m) > len(best.mount)):
                best = v
        return best


def _quantity(value) -> int | None:
    if value in (None, ""):
        return None
    from kubernetes.utils import parse_quantity

    return int(parse_quantity(str(value)))


def pool_from_runtime(runtime: dict, name: str = "", source: str = "") -> Pool:
    """The Pool of a ClusterTrainingRuntime object (a dict): the first replicated job's pod, its first
    container's limits, env and volume mounts, the GPU product of its node selector."""
    try:
        pod = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
        c = pod["containers"][0]
    except (KeyError, IndexError, TypeError):
        raise UserError(f"{source or 'runtime'}: not a ClusterTrainingRuntime with a pod template") from None
    limits = (c.get("resources") or {}).get("limits") or {}
    gpus = int(_quantity(limits.get("nvidia.com/gpu")) or 0)
    product = (pod.get("nodeSelector") or {}).get("nvidia.com/gpu.product", "")
    if gpus and product not in GPU_MEMORY:
        raise UserError(f"{source or 'runtime'}: GPU product {product!r} has no known memory size "
                        f"(known: {', '.join(sorted(GPU_MEMORY))})")
    env = {e["name"]: str(e.get("value", "")) for e in c.get("env") or [] if "value" in e}
    specs = {v["name"]: v for v in pod.get("volumes") or []}
    vols = []
    for m in c.get("volumeMounts") or []:
        spec = specs.get(m["name"], {})
        ed = spec.get("emptyDir")
        size = _quantity(ed.get("sizeLimit")) if ed is not None else None
        eph = (spec.get("ephemeral") or {}).get("volumeClaimTemplate", {}).get("spec", {})
        pvc = _quantity((eph.get("resources") or {}).get("requests", {}).get("storage")) if eph else None
        vols.append(Volume(m["name"], m["mountPath"], size if ed is not None else pvc,
                           (ed or {}).get("medium", "") if ed is not None else ("pvc" if eph else "other")))
    return Pool(name=name or product or "cpu", gpu_product=product, gpu_memory=GPU_MEMORY.get(product, 0),
                gpus_per_node=gpus, memory_limit=_quantity(limits.get("memory")),
                ephemeral_limit=_quantity(limits.get("ephemeral-storage")), volumes=vols, env=env, source=source)


def _runtime_doc(docs: list[dict], where: str) -> dict:
    for d in docs:
        if d and d.get("kind") == "ClusterTrainingRuntime" and d.get("metadata", {}).get("name") == "chunkgrpo-torch":
            return d
    raise UserError(f"{where} has no ClusterTrainingRuntime chunkgrpo-torch")


def manifests_dir() -> Path | None:
    """The repository's manifests/ next to the package (a source checkout), else None (an installed image)."""
    d = Path(__file__).resolve().parents[1] / "manifests"
    return d if (d / "overlays").is_dir() else None


def load_pool(pool: str, runtime: str = "") -> Pool:
    """Pool `pool` (h800, h100, ...): from `runtime` (a YAML file: a rendered overlay or
    `kubectl get clustertrainingruntime chunkgrpo-torch -o yaml`), else the repository's overlay
    manifests/overlays/prod-<pool> rendered with `kubectl kustomize`, else (in a pod, no manifests) the
    live ClusterTrainingRuntime read through the Kubernetes API."""
    import yaml

    if runtime:
        p = Path(runtime)
        if not p.is_file():
            raise UserError(f"--runtime {runtime} does not exist (a YAML file with the ClusterTrainingRuntime)")
        return pool_from_runtime(_runtime_doc(list(yaml.safe_load_all(p.read_text())), runtime), pool, runtime)
    root = manifests_dir()
    if root is not None:
        overlay = root / "overlays" / f"prod-{pool}"
        if not overlay.is_dir():
            known = sorted(d.name.removeprefix("prod-") for d in (root / "overlays").glob("prod-*"))
            raise UserError(f"--pool {pool}: no overlay {overlay} (pools: {', '.join(known)})")
        return pool_from_runtime(_runtime_doc(_kustomize(overlay), str(overlay)), pool, f"{overlay} (rendered)")
    try:
        from kubernetes import client, config

        config.load_incluster_config()
        from chunkgrpo.k8s.trainjob import read_runtime

        doc = read_runtime(client.CustomObjectsApi())
    except Exception as e:  # noqa: BLE001 - not in a cluster, no RBAC: one line
        raise UserError(f"--pool {pool}: no manifests/ here and the cluster's ClusterTrainingRuntime chunkgrpo-torch "
                        f"is not readable ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}); "
                        "pass --runtime FILE") from None
    return pool_from_runtime(doc, pool, "cluster: ClusterTrainingRuntime chunkgrpo-torch")


def _kustomize(overlay: Path) -> list[dict]:
    import shutil
    import subprocess
    import sys

    import yaml

    venv = Path(sys.executable).parent / "kubectl"
    kubectl = str(venv) if venv.exists() else shutil.which("kubectl")
    if not kubectl:
        raise UserError(f"rendering {overlay} needs kubectl (kustomize); or pass --runtime FILE")
    out = subprocess.run([kubectl, "kustomize", str(overlay)], capture_output=True, text=True, timeout=120)
    if out.returncode:
        raise UserError(f"kubectl kustomize {overlay} failed: {out.stderr.strip().splitlines()[-1][:200]}")
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def local_pool(gpu_memory: int = 0, memory: int | None = None) -> Pool:
    """This machine as a pool (for CPU runs and tests): no volumes, nothing limited unless given."""
    return Pool("local", "", gpu_memory, 0, memory, None, [], dict(os.environ), "this machine")


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

    def problems(self) -> list[str]:
        """One sentence per resource that does not fit, naming it and by how much."""
        return [f"{i.resource} ({i.what}): needs {_gib(i.need)} of {_gib(i.have)} "
                f"(+{_gib(i.need - i.have)} over)"
                for i in self.items if not i.fits]

    def to_dict(self) -> dict:
        pool = {k: v for k, v in dataclasses.asdict(self.pool).items() if k != "env"}
        return {"preset": self.preset, "pool": pool,
                "world": self.world, "facts": self.facts, "fits": not self.problems(), "problems": self.problems(),
                "items": [{**dataclasses.asdict(i), "fits": i.fits} for i in self.items]}


def _gib(n: int | None) -> str:
    return "unlimited" if n is None else f"{n / GiB:.1f} GiB"


def capacity_plan(cfg, pool: Pool, *, nodes: int = 1, output_dir: str = "", preset: str = "",
                  device: str = "cuda", reserve_bytes: int = 3 * GiB, arch: ModelArch | None = None,
                  prompts: int = 0) -> CapacityPlan:
    """The plan of TrainConfig `cfg` on `nodes` pods of `pool` (one rank per GPU; `device="cpu"` = one CPU rank).

    `output_dir` is the trainer's output folder in the pod ('' = the launcher's default, `JobSpec.output_dir`);
    `prompts` the number of distinct training prompts (0 = unknown: every prompt of the run is distinct)."""
    arch = arch or ModelArch.for_model(cfg.model)
    gpu = device != "cpu"
    ranks_per_node = max(1, pool.gpus_per_node) if gpu else 1
    world = ranks_per_node * nodes
    bf16 = cfg.mixed_precision == "bf16" or (cfg.mixed_precision == "auto" and gpu)
    b_c = 2 if bf16 else 4                                   # compute (activation) bytes
    lora = cfg.lora.enabled
    b_base = 2 if (bf16 and lora) else 4                     # load dtype of the transformer (`Trainer.setup`)
    b_frozen = 2 if bf16 else 4                              # text encoders + VAE (`load_flux(frozen_dtype=)`)
    fsdp = cfg.distributed == "fsdp" and world > 1
    shard = world if fsdp else 1
    s = cfg.sampling
    compute_dtype = torch.bfloat16 if bf16 else torch.float32

    tr = arch.build("transformer", compute_dtype)
    W = param_count(tr)
    if lora:  # the adapter on the meta transformer: its activations are traced, only it gets gradients
        from peft import LoraConfig

        with torch.device("meta"):
            tr.add_adapter(LoraConfig(r=cfg.lora.rank, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                                      target_modules=list(cfg.lora.targets), init_lora_weights=True))
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
    rewards = sum(math.prod(REWARD_MODELS.get(r.name, (0, 0))) for r in cfg.rewards)
    weights = (4 * W // shard) if not lora else (b_base * W + 4 * P) // shard
    adam = 8 * P // shard
    ema = (4 * P // shard) if cfg.ema.decay > 0 else 0
    embeds = n_prompts * (T * D_txt + D_pool) * b_base
    vae_w = counts["vae"] * b_frozen
    resident = {"transformer weights": weights, "AdamW state": adam, "EMA": ema, "VAE": vae_w,
                "reward models": rewards, "prompt embeddings": embeds}
    traj = 4 * B * (N + 1) * L * C + 4 * B * N
    block = _block_params(tr)
    unsharded_fwd = 2 * block * b_c if fsdp else 0
    grads = 4 * P // shard + (4 * P if (not fsdp and world > 1) else 0)
    load = {"pipeline in load dtype": W * b_base + sum(counts.values()) * b_frozen, "reward models": rewards}
    text_encoders = (counts["text_encoder"] + counts["text_encoder_2"]) * b_frozen
    encode_phase = {"transformer weights": weights, "text encoders": text_encoders, "VAE": vae_w,
                    "reward models": rewards, "prompt embeddings": embeds, "T5 forward": encode}
    rollout = {**resident, "trajectory": traj, "transformer no-grad forward": roll_fwd,
               "FSDP unsharded blocks": unsharded_fwd}
    decoding = {**resident, "trajectory": traj, f"VAE decode of {decode_batch} images": decode}
    if branching:  # gradients accumulate across the branching steps, between the children's completions
        rollout["gradients"] = decoding["gradients"] = grads
    # gradients are resident while a window's forward runs: an accumulation window has several forwards
    policy = {**resident, "gradients": grads, "trajectory": traj, "policy forward+backward": policy_act,
              "FSDP unsharded blocks + block grads": (unsharded_fwd + 4 * block) if fsdp else 0}
    phases = (("load", load), ("text encoding", encode_phase), ("rollout", rollout), ("decode", decoding),
              ("policy", policy))
    cap = (pool.gpu_memory - reserve_bytes) if (gpu and pool.gpu_memory) else None
    items = [Item("GPU memory per rank", f"{phase} phase", sum(parts.values()), cap, parts)
             for phase, parts in phases]

    # ---- host memory per pod
    load_host = W * b_base + sum(counts.values()) * b_frozen
    ckpt_host = 4 * P + 8 * P + (4 * P if cfg.ema.decay > 0 else 0)
    host = {"processes": ranks_per_node * PROCESS_HOST_BYTES,
            "peak of load / checkpoint": max(ranks_per_node * load_host, ckpt_host)}
    items.append(Item("host memory per pod", "load or checkpoint", sum(host.values()), pool.memory_limit, host))

    # ---- bytes per volume
    stored = FLUX_DEV_STORED_BYTES
    model_folder = (W + sum(counts.values())) * stored
    if arch.hub_snapshot:
        model_folder += W * FLUX_DEV_SINGLE_FILES["transformer"] + counts["vae"] * FLUX_DEV_SINGLE_FILES["vae"]
    if arch.folder_bytes is not None:
        model_folder = arch.folder_bytes
    reward_files = sum(REWARD_MODELS.get(r.name, (0, 0))[0] * 2 for r in cfg.rewards)
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
        key = f"{v.name} ({v.mount})" if v else ("no volume: root filesystem" if pool.volumes else "local disk")
        per_volume.setdefault(key, {})[f"{what}: {path}"] = nbytes
    disk_total = 0
    for key, parts in per_volume.items():
        v = next((x for x in pool.volumes if key.startswith(x.name + " (")), None)
        have = v.size_limit if v else (0 if pool.volumes else None)  # the root filesystem is read-only
        items.append(Item(f"volume {key}", "sizeLimit" if v else "read-only root", sum(parts.values()), have, parts))
        if v is None or v.medium in ("", "other"):
            disk_total += sum(parts.values())
    if pool.ephemeral_limit is not None:
        items.append(Item("ephemeral storage per pod", "disk-backed emptyDirs", disk_total, pool.ephemeral_limit))
    facts = {"architecture": arch.source, "transformer_params": W, "trainable_params": P,
             "text_encoder_params": counts["text_encoder"], "text_encoder_2_params": counts["text_encoder_2"],
             "vae_params": counts["vae"], "image_tokens": L, "text_tokens": T, "rollout_batch": B,
             "policy_inputs_per_forward": n_pol, "world": world, "ranks_per_node": ranks_per_node,
             "fsdp": fsdp, "lora": lora, "compute_dtype": "bf16" if bf16 else "fp32",
             "load_dtype": "bf16" if b_base == 2 else "fp32", "gradient_checkpointing": cfg.gradient_checkpointing,
             "activation_bytes_per_token_per_block": per_token_block, "checkpoint_bytes": checkpoint,
             "gpu_reserve_bytes": reserve_bytes if gpu else 0, "prompts_per_rank_in_run": n_prompts}
    return CapacityPlan(preset, pool, world, facts, items)


def _steps_per_iteration(cfg) -> int:
    from chunkgrpo.train.methods import get_method

    return get_method(cfg.method).steps_per_iteration(cfg)


def _default_output_dir() -> str:
    from chunkgrpo.k8s.trainjob import JobSpec

    return next(f.default for f in dataclasses.fields(JobSpec) if f.name == "output_dir")


# ------------------------------------------------------------------------------ output
def render_table(plan: CapacityPlan) -> str:
    f = plan.facts
    head = (f"capacity plan: {plan.preset or 'config'} on pool {plan.pool.name} ({plan.pool.source}); "
            f"{f['world']} rank(s), {f['ranks_per_node']} per node, {plan.pool.gpu_product or 'CPU'}; "
            f"{'FSDP' if f['fsdp'] else 'DDP/single'}, {'LoRA' if f['lora'] else 'full FT'}, "
            f"compute {f['compute_dtype']}, load {f['load_dtype']}; transformer {f['transformer_params']:,} params, "
            f"trainable {f['trainable_params']:,}; "
            f"{f['image_tokens']} image + {f['text_tokens']} text tokens; rollout batch {f['rollout_batch']}, "
            f"policy inputs per forward {f['policy_inputs_per_forward']}")
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
    probs = plan.problems()
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
            f"| resource | phase / limit | need | have | fits | parts |\n|---|---|---|---|---|---|\n{rows}\n")

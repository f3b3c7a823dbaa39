"""The model side of the capacity plan: FLUX's component configs (a local folder's, an S3 folder
artifact's or FLUX.1-dev's published ones), built on the meta device for exact parameter counts, and the
peak live activation bytes of its forward (and backward) simulated at a run's exact shapes.

**Architecture.** `ModelArch` holds the four component configs (FLUX transformer, CLIP-L text, T5 text,
VAE): those of a local diffusers folder, else FLUX.1-dev's published ones (`FLUX_DEV`); a folder of another
architecture (its model_index.json / transformer config name other classes) is refused. Each is built
on the meta device (`torch.device("meta")`: shapes only), so parameter counts are exact, e.g.
FLUX.1-dev's transformer has exactly `FLUX_DEV_TRANSFORMER_PARAMS` = 11,901,408,320 parameters.

**Activations are simulated, not guessed.** The transformer (and the VAE decoder, the T5 encoder) runs
its real diffusers forward on meta tensors at the run's exact shapes (batch, image tokens
L_img = (H/16)·(W/16), text tokens T = max_sequence_length) under `LiveBytes`, a dispatch mode that
adds every new storage's bytes when an op creates it and removes them when the last tensor using it
dies; autograd's saved tensors are kept visible (a pass-through saved-tensors hook), so the peak is
the exact peak of live activation bytes of the computation — with or without gradient checkpointing,
which changes what is saved (block inputs only, then one block recomputed in backward). Parameter
gradients are pre-allocated outside the count (`capacity.plan` accounts them, sharded or not); the
transient gradient tensors of each op are inside it. Attention is counted as a flash / memory-efficient
kernel: it keeps q, k, v, the output and an fp32 log-sum-exp (B, H, L) — O(L), never the L×L matrix
(what PyTorch's CUDA SDPA and its CPU flash kernel do). The plan reports the result as
`activation_bytes_per_token_per_block`: what autograd keeps per token (image + text) and block without
checkpointing (FLUX.1-dev in bf16: 162,415 bytes ≈ 26 × the 3072-wide hidden state in bf16).
"""

from __future__ import annotations

import dataclasses
import json
import os
import weakref
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from chunkgrpo.errors import UserError

GiB = 2**30

# ------------------------------------------------------------------------------ published configs
# FLUX.1-dev as published on the Hugging Face hub, repo black-forest-labs/FLUX.1-dev: the values of
# transformer/config.json, text_encoder/config.json (CLIP ViT-L/14 text tower), text_encoder_2/config.json
# (T5 v1.1 XXL encoder, google/t5-v1_1-xxl) and vae/config.json, as the diffusers/transformers classes
# take them. Defaults of the classes are not repeated.
FLUX_DEV = {
    "transformer": dict(
        patch_size=1,
        in_channels=64,
        num_layers=19,
        num_single_layers=38,
        attention_head_dim=128,
        num_attention_heads=24,
        joint_attention_dim=4096,
        pooled_projection_dim=768,
        guidance_embeds=True,
        axes_dims_rope=[16, 56, 56],
    ),
    "text_encoder": dict(
        vocab_size=49408,
        hidden_size=768,
        intermediate_size=3072,
        num_attention_heads=12,
        num_hidden_layers=12,
        max_position_embeddings=77,
        projection_dim=768,
        hidden_act="quick_gelu",
    ),
    "text_encoder_2": dict(
        vocab_size=32128,
        d_model=4096,
        d_kv=64,
        d_ff=10240,
        num_layers=24,
        num_heads=64,
        feed_forward_proj="gated-gelu",
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        tie_word_embeddings=False,
    ),
    "vae": dict(
        in_channels=3,
        out_channels=3,
        latent_channels=16,
        down_block_types=["DownEncoderBlock2D"] * 4,
        up_block_types=["UpDecoderBlock2D"] * 4,
        block_out_channels=[128, 256, 512, 512],
        layers_per_block=2,
        norm_num_groups=32,
        sample_size=1024,
        use_quant_conv=False,
        use_post_quant_conv=False,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        act_fn="silu",
    ),
}
FLUX_DEV_TRANSFORMER_PARAMS = 11_901_408_320  # the published count ("12 billion parameters")
FLUX_DEV_STORED_BYTES = 2  # every component of the hub folder is stored in bf16
# The model cache holds the pipeline's folders only: `chunkgrpo models sync` leaves out the hub repo's
# single-file copies (flux1-dev.safetensors, ae.safetensors), which nothing loads.


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


def _flash_sdpa(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    if query.device.type != "meta":
        return _ORIGINAL_SDPA(
            query,
            key,
            value,
            attn_mask=attn_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )
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
    folder_bytes: int | None = None  # the model folder's size when known (an S3 folder artifact's manifest)

    @classmethod
    def from_folder(cls, path: str | os.PathLike) -> "ModelArch":
        from chunkgrpo.flux import check_model_folder

        root = Path(path)
        check_model_folder(root)  # another architecture's configs would not fit FLUX's classes
        cfgs = {}
        for name in ("transformer", "text_encoder", "text_encoder_2", "vae"):
            f = root / name / "config.json"
            if not f.is_file():
                raise UserError(
                    f"model {root} has no {name}/config.json (expected a diffusers FLUX pipeline folder)"
                )
            d = json.loads(f.read_text())
            cfgs[name] = {k: v for k, v in d.items() if not k.startswith("_")}
        return cls(**cfgs, source=str(root))

    @classmethod
    def from_s3(cls, uri: str, store=None) -> "ModelArch":
        """The configs of an s3:// folder artifact of the model cache (small reads of model_index.json and
        the four configs, + its manifest); another architecture is refused (`flux.check_architecture`)."""
        from chunkgrpo.flux import check_architecture
        from chunkgrpo.store.client import ArtifactStore

        store = store or ArtifactStore()
        base = uri.rstrip("/")
        check_architecture(json.loads(store.get_bytes(f"{base}/model_index.json")),
                           json.loads(store.get_bytes(f"{base}/transformer/config.json")), uri)
        cfgs = {
            n: {
                k: v
                for k, v in json.loads(store.get_bytes(f"{base}/{n}/config.json")).items()
                if not k.startswith("_")
            }
            for n in ("transformer", "text_encoder", "text_encoder_2", "vae")
        }
        manifest = store.read_manifest(base)
        return cls(**cfgs, source=uri, folder_bytes=manifest.total_bytes if manifest is not None else None)

    @classmethod
    def for_model(cls, model: str) -> "ModelArch":
        """A local diffusers folder's configs, an s3:// folder artifact's (when S3 is configured and has
        them); anything else (a hub id, '', S3 unreachable) = FLUX.1-dev's published configs."""
        if (
            model
            and not model.startswith("s3://")
            and (Path(model).expanduser() / "model_index.json").is_file()
        ):
            return cls.from_folder(Path(model).expanduser())
        if model.startswith("s3://") and os.environ.get("AWS_ACCESS_KEY_ID"):
            try:
                return cls.from_s3(model)
            except UserError:  # read, and not a supported architecture
                raise
            except Exception as e:
                return cls(**FLUX_DEV, source=f"FLUX.1-dev (published configs; {model} unreadable: "
                                              f"{type(e).__name__})")
        return cls(**FLUX_DEV)

    def build(self, name: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "meta"
              ) -> torch.nn.Module:
        """Component `name` constructed in `dtype` on `device`: the meta device by default (no memory);
        another device gets random initial values there, made in `dtype` (no fp32 copy first)."""
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        _quiet()
        old = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
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
        finally:
            torch.set_default_dtype(old)
        return m.to(dtype)


def param_count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def block_params(transformer: torch.nn.Module) -> int:
    blocks = [
        *getattr(transformer, "transformer_blocks", []),
        *getattr(transformer, "single_transformer_blocks", []),
    ]
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
        kw = dict(
            hidden_states=torch.empty(batch, img_tokens, cfg.in_channels, dtype=dtype),
            encoder_hidden_states=torch.empty(batch, txt_tokens, cfg.joint_attention_dim, dtype=dtype),
            pooled_projections=torch.empty(batch, cfg.pooled_projection_dim, dtype=dtype),
            timestep=torch.empty(batch),
            img_ids=torch.empty(img_tokens, 3),
            txt_ids=torch.empty(txt_tokens, 3),
            guidance=torch.empty(batch) if cfg.guidance_embeds else None,
        )
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

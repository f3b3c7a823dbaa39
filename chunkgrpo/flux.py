"""Loading a FLUX model and calling it the way the sampling maths needs.

`load_flux(source)` takes a local diffusers folder, an `s3://bucket/prefix` (downloaded through the
artifact store into a local cache first), or a hub repo id resolved from the local hub cache only
(`local_files_only=True`; nothing is downloaded at run time). The tiny random-weight FLUX built by
`chunkgrpo.testing.tiny` and a real FLUX.1-dev folder go through the same code.

Only the FLUX.1 architecture is taken (`check_architecture`: `FluxPipeline` with `FluxTransformer2DModel`,
read from the folder's `model_index.json` and `transformer/config.json` before anything loads); another
model folder (Stable Diffusion 3, Qwen-Image, ...) is refused in one line.

`FluxModel` wraps the components: prompt encoding, latent packing, the velocity call (with the
integer-timestep convention of the shift schedule), x̂0 decoding, and a transformer call counter.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from chunkgrpo.errors import UserError


@dataclass
class PromptEmbeds:
    """Text conditioning for a batch: T5 sequence (B, T, D), CLIP pooled (B, Dp), txt ids (T, 3)."""

    prompt_embeds: torch.Tensor
    pooled: torch.Tensor
    text_ids: torch.Tensor

    def __len__(self) -> int:
        return self.prompt_embeds.shape[0]

    def index(self, idx) -> "PromptEmbeds":
        return PromptEmbeds(self.prompt_embeds[idx], self.pooled[idx], self.text_ids)

    def repeat_interleave(self, n: int) -> "PromptEmbeds":
        return PromptEmbeds(
            self.prompt_embeds.repeat_interleave(n, 0), self.pooled.repeat_interleave(n, 0), self.text_ids
        )

    def to(self, device=None, dtype=None) -> "PromptEmbeds":
        return PromptEmbeds(self.prompt_embeds.to(device=device, dtype=dtype),
                            self.pooled.to(device=device, dtype=dtype), self.text_ids.to(device=device))

    @staticmethod
    def cat(items: list["PromptEmbeds"]) -> "PromptEmbeds":
        return PromptEmbeds(torch.cat([i.prompt_embeds for i in items]), torch.cat([i.pooled for i in items]),
                            items[0].text_ids)


class CallCounter:
    """Counts transformer forward calls (and samples through them) with and without grad."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.forward = 0
        self.forward_grad = 0
        self.samples = 0

    def record(self, batch: int) -> None:
        self.forward += 1
        self.samples += batch
        if torch.is_grad_enabled():
            self.forward_grad += 1

    def as_dict(self) -> dict:
        return {"transformer_forward": self.forward, "transformer_forward_with_grad": self.forward_grad,
                "transformer_samples": self.samples}


class exact_time_embedding:
    """Feed the transformer's time/guidance embedding the fp32 values `t·1000` and `g·1000` for one call.

    A forward pre-hook on `time_text_embed` (registered once per transformer) replaces its timestep and
    guidance arguments, which diffusers has cast to the activation dtype and FSDP's mixed precision to
    bf16, by the same product computed in fp32 from the uncast inputs. Outside this context (or for a
    transformer without `time_text_embed`) the hook passes everything through unchanged."""

    def __init__(self, transformer, t: torch.Tensor, g: torch.Tensor | None):
        self.embed = getattr(transformer, "time_text_embed", None)
        self.values = (t * 1000.0, None if g is None else g * 1000.0)  # fp32, like diffusers' `t·1000`

    def __enter__(self):
        if self.embed is not None:
            if not getattr(self.embed, "_chunkgrpo_exact_hook", False):
                self.embed.register_forward_pre_hook(_exact_time_hook)
                self.embed._chunkgrpo_exact_hook = True
            self.embed._chunkgrpo_exact = self.values
        return self

    def __exit__(self, *exc):
        if self.embed is not None:
            self.embed._chunkgrpo_exact = None


def _exact_time_hook(module, args):
    values = getattr(module, "_chunkgrpo_exact", None)
    if values is None:
        return None
    t, g = values
    args = list(args)
    if args and torch.is_tensor(args[0]) and args[0].shape == t.shape:
        args[0] = t.to(args[0].device)
    if g is not None and len(args) == 3 and torch.is_tensor(args[1]) and args[1].shape == g.shape:
        args[1] = g.to(args[1].device)
    return tuple(args)


def _not_a_view(t):
    """`t`, or a copy when it is a view of another tensor. torch.compile guards a view input on its base's
    shape (`x._base.size()[0] == x.size()[0]`), so a rollout batch sliced from a larger tensor after one that
    was not (or the reverse) compiled the transformer again, once more per grad mode; FLUX.1-dev compiles
    for minutes. The copies (latents, text embeddings) are small beside one transformer call."""
    return t.clone() if torch.is_tensor(t) and t._is_view() else t


# The architecture the sampling maths, the LoRA targets and the capacity model are written for: the
# diffusers FLUX.1 text-to-image pipeline (FLUX.1-dev, FLUX.1-schnell and fine-tunes saved in its format).
SUPPORTED_PIPELINES = ("FluxPipeline",)
SUPPORTED_TRANSFORMERS = ("FluxTransformer2DModel",)


def check_architecture(model_index: dict | None, transformer_config: dict | None, where: str) -> None:
    """Refuse a model folder of another architecture (one line naming the classes found and the supported
    ones), from its `model_index.json` and `transformer/config.json` alone: nothing is loaded. A class name
    that is absent is not judged here (loading reports what is missing)."""
    index = model_index if isinstance(model_index, dict) else {}
    config = transformer_config if isinstance(transformer_config, dict) else {}
    pipeline = index.get("_class_name")
    entry = index.get("transformer")
    listed = entry[1] if isinstance(entry, (list, tuple)) and len(entry) == 2 else None
    transformers = {c for c in (listed, config.get("_class_name")) if c}
    bad_pipeline = pipeline is not None and pipeline not in SUPPORTED_PIPELINES
    bad_transformer = bool(transformers - set(SUPPORTED_TRANSFORMERS))
    if bad_pipeline or bad_transformer:
        found = str(pipeline or "a pipeline")
        if transformers:
            found += f" with transformer {', '.join(sorted(map(str, transformers)))}"
        raise UserError(f"model {where} is {found}; supported: {' / '.join(SUPPORTED_PIPELINES)} with "
                        f"{' / '.join(SUPPORTED_TRANSFORMERS)} (FLUX.1-dev, FLUX.1-schnell and their "
                        "fine-tunes in diffusers format)")


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"{path} is not readable JSON ({type(e).__name__}: {e})") from None


def check_model_folder(path: str | os.PathLike) -> None:
    """`check_architecture` on a local diffusers pipeline folder."""
    root = Path(path)
    index = _read_json(root / "model_index.json")
    check_architecture(index, _read_json(root / "transformer" / "config.json"), str(root))


def resolve_model_source(source: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> str:
    """A local folder path for `source` (local dir, s3:// URI, or hub id from the local cache)."""
    s = str(source)
    if s.startswith("s3://"):
        from chunkgrpo.store.cache import cached_folder  # lazy: only the S3 path needs minio

        target = cached_folder(s, "models", cache_dir)
        return resolve_model_source(target)
    p = Path(s).expanduser()
    if p.exists():
        if not (p / "model_index.json").exists():
            raise UserError(
                f"model dir {p} has no model_index.json (expected a diffusers FLUX pipeline folder)"
            )
        check_model_folder(p)
        return str(p)
    if s.startswith((".", "/", "~")) or os.sep in s and s.count("/") != 1:
        raise UserError(f"model dir {s} does not exist (expected a diffusers FLUX pipeline folder)")
    try:  # a hub repo id: resolve from the local cache only, never download
        from huggingface_hub import snapshot_download

        path = snapshot_download(s, local_files_only=True)
    except Exception as e:
        raise UserError(
            f"model {s!r} is not a local folder and not in the local hub cache ({type(e).__name__}); "
            "pass a folder, an s3:// URI, or pre-populate HF_HOME"
        ) from None
    check_model_folder(path)
    return path


def quiet_library_progress() -> None:
    """Switch off diffusers' and transformers' own carriage-return bars (loading checkpoint shards, writing
    model shards): they would write into every task's log; our own bars go through `chunkgrpo.progress`."""
    import diffusers.utils.logging as dlog
    import transformers.utils.logging as tlog

    dlog.disable_progress_bar()
    tlog.disable_progress_bar()


def use_training_attention(device: str | torch.device) -> bool:
    """Keep cuDNN's fused attention out of training on a GPU; returns whether it was switched off.

    Measured on an H200 (torch 2.11 + CUDA 13, FLUX.1-dev's transformer, 720² = 2,025 image + 512 text
    tokens, head dim 128, bf16): with gradients, PyTorch's SDPA picks the cuDNN backend and its kernel
    fails ("mha_graph.execute … is_good()" under CUDA_LAUNCH_BLOCKING, otherwise an illegal memory
    access), with LoRA or full fine-tuning, with or without gradient checkpointing, and on a 6-block
    model of the same widths. Without it SDPA uses flash attention and the iteration runs
    (`benchmarks/flux_gpu.py`, `benchmarks/results/flux-gpu/`). Sampling without gradients was unaffected,
    so evaluation keeps the default choice."""
    if torch.device(device).type != "cuda":
        return False
    torch.backends.cuda.enable_cudnn_sdp(False)
    return True


def load_flux(
    source: str | os.PathLike,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    with_text_encoders: bool = True,
    with_vae: bool = True,
    frozen_dtype: torch.dtype | None = None,
    transformer: torch.nn.Module | None = None,
) -> "FluxModel":
    """Load a FLUX pipeline folder (see `resolve_model_source`) into a `FluxModel`.

    `frozen_dtype`: the dtype of the components that are never trained (CLIP, T5, VAE), in which they are
    read from the folder (never materialised in `dtype` first) and cast again before they move to `device`
    (default: `dtype`). Full fine-tuning loads the transformer in fp32 (master weights) but its frozen text
    encoders in bf16: T5-XXL in fp32 alone is 19 GB per GPU and per rank's host memory, the difference
    between fitting an 80 GB GPU and not (`chunkgrpo capacity`, load phase). Their outputs are cast to
    `dtype`. The second cast brings the modules transformers keeps in fp32 while loading (T5's `wo`) to
    `frozen_dtype` too, so the weights are those of a load in `dtype` followed by a cast.

    `transformer`: a transformer already built and loaded by the caller (the FSDP path builds it sharded,
    `chunkgrpo.train.model_load`); it is used as given (device, dtype, grad flags untouched) and the folder's
    transformer weights are not read here."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from diffusers import FluxPipeline

    quiet_library_progress()
    path = resolve_model_source(source)
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    frozen = frozen_dtype or dtype
    kwargs = {}
    if not with_text_encoders:
        kwargs.update(text_encoder=None, text_encoder_2=None)
    if not with_vae:
        kwargs["vae"] = None
    try:
        if transformer is not None:
            kwargs["transformer"] = transformer
        elif frozen != dtype:  # the transformer in its own dtype, the pipeline around it in the frozen one
            from diffusers import FluxTransformer2DModel

            kwargs["transformer"] = FluxTransformer2DModel.from_pretrained(Path(path) / "transformer",
                                                                           dtype=dtype)
        pipe = FluxPipeline.from_pretrained(path, dtype=frozen, **kwargs)
    except Exception as e:
        if isinstance(e, (UserError, MemoryError)) or (isinstance(e, RuntimeError) and "CUDA" in str(e)):
            raise
        text = " ".join(str(e).split())[:240]
        raise UserError(f"model dir {path} is not a loadable FLUX pipeline folder "
                        f"({type(e).__name__}: {text})") from None
    pipe.set_progress_bar_config(disable=True)
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2"):
        module = getattr(pipe, name, None)
        if name == "transformer" and transformer is not None:
            continue
        if module is not None:
            if frozen_dtype is not None and name != "transformer":
                module.to(frozen_dtype)
            module.to(device)
            module.requires_grad_(False)
            module.eval()
    return FluxModel(pipe, device=device, dtype=dtype, source=str(source), path=path)


class FluxModel:
    """The pieces of a FluxPipeline the GRPO engine calls, with a transformer call counter."""

    def __init__(self, pipe, *, device: torch.device, dtype: torch.dtype, source: str = "", path: str = ""):
        self.pipe = pipe
        self.transformer = pipe.transformer
        self.device = device
        self.dtype = dtype
        self.source = source
        self.path = path
        self.counter = CallCounter()
        self._compiled = None
        self.vae_scale_factor = getattr(pipe, "vae_scale_factor", 8)
        self.guidance_embeds = bool(getattr(self.transformer.config, "guidance_embeds", False))

    # ---------------------------------------------------------------- text
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], max_sequence_length: int = 512) -> PromptEmbeds:
        if self.pipe.text_encoder is None or self.pipe.text_encoder_2 is None:
            raise RuntimeError("text encoders were not loaded (load_flux(with_text_encoders=True))")
        embeds, pooled, text_ids = self.pipe.encode_prompt(
            prompt=list(prompts), prompt_2=None, device=self.device, num_images_per_prompt=1,
            max_sequence_length=max_sequence_length)
        return PromptEmbeds(embeds.to(self.dtype), pooled.to(self.dtype), text_ids)

    # ---------------------------------------------------------------- latents
    def check_resolution(self, height: int, width: int) -> None:
        m = self.vae_scale_factor * 2
        if height % m or width % m or height <= 0 or width <= 0:
            raise UserError(f"resolution {height}x{width} must be a positive multiple of {m} for this model")

    def latent_shape(self, height: int, width: int) -> tuple[int, int]:
        """Packed latent (tokens, channels) for an image of height × width."""
        self.check_resolution(height, width)
        h, w = height // self.vae_scale_factor, width // self.vae_scale_factor
        return (h // 2) * (w // 2), self.transformer.config.in_channels

    def img_ids(self, height: int, width: int) -> torch.Tensor:
        h, w = height // self.vae_scale_factor, width // self.vae_scale_factor
        return self.pipe._prepare_latent_image_ids(1, h // 2, w // 2, self.device, self.dtype)

    def initial_noise(self, batch: int, height: int, width: int, generator: torch.Generator) -> torch.Tensor:
        """(B, L, C) float32 rollout noise drawn directly in the packed layout (training's random stream;
        evaluation draws `pipeline_noise` instead)."""
        L, C = self.latent_shape(height, width)
        return torch.randn((batch, L, C), generator=generator, dtype=torch.float32).to(self.device)

    def pipeline_noise(self, batch: int, height: int, width: int,
                       generator: torch.Generator | list[torch.Generator]) -> torch.Tensor:
        """(B, L, C) float32 initial noise, the same numbers `diffusers.FluxPipeline` starts from for the same
        `generator` (one generator, or one per image): `prepare_latents` draws `randn_tensor` in the unpacked
        layout (B, C/4, 2·⌊H/16⌋, 2·⌊W/16⌋) in the prompt embeddings' dtype (the model dtype here), on the
        generator's device, then packs it into 2×2 patches (`_pack_latents`). So an image sampled from this
        noise is the image `FluxPipeline(..., generator=torch.Generator().manual_seed(s))` gives."""
        from diffusers.utils.torch_utils import randn_tensor

        self.check_resolution(height, width)
        channels = self.transformer.config.in_channels // 4
        h = 2 * (height // (self.vae_scale_factor * 2))
        w = 2 * (width // (self.vae_scale_factor * 2))
        lat = randn_tensor((batch, channels, h, w), generator=generator, device=self.device, dtype=self.dtype)
        return self.pipe._pack_latents(lat, batch, channels, h, w).float()

    # ---------------------------------------------------------------- the velocity call
    def velocity(self, x: torch.Tensor, timesteps: torch.Tensor, cond: PromptEmbeds, img_ids: torch.Tensor,
                 *, guidance: float = 3.5, transformer=None) -> torch.Tensor:
        """v_θ(x, t, c). `timesteps` (B,) in [0, 1000] (already quantized when the recipe does);
        FLUX receives t/1000. Output in float32.

        The time (and guidance) embedding sees the exact fp32 values `fp32(t/1000)·1000` whatever the
        activation dtype: diffusers casts the timestep to the dtype of the image embedding (bf16 under
        autocast or with bf16 weights) and FSDP's MixedPrecisionPolicy casts every forward input, which
        would feed FLUX 980 instead of 979; `exact_time_embedding` restores the fp32 values at the
        embedding's input (method.md §1: the transformer receives int(σ·1000)/1000)."""
        model = transformer if transformer is not None else self.transformer
        B = x.shape[0]
        # int(σ·1000)/1000 rounded once to fp32 (as the references' long/1000), never through bf16
        t = (timesteps.to(device=self.device, dtype=torch.float64).expand(B) / 1000.0).float()
        g = (
            torch.full((B,), guidance, device=self.device, dtype=torch.float32)
            if self.guidance_embeds
            else None
        )
        self.counter.record(B)
        inputs = dict(hidden_states=x.to(self.dtype), timestep=t, guidance=g, pooled_projections=cond.pooled,
                      encoder_hidden_states=cond.prompt_embeds, txt_ids=cond.text_ids, img_ids=img_ids)
        if model is self._compiled:
            inputs = {k: _not_a_view(v) for k, v in inputs.items()}
        with exact_time_embedding(model, t, g):
            out = model(**inputs, return_dict=False)[0]
        return out.float()

    def compiled(self, backend: str = "inductor"):
        """The transformer under `torch.compile(backend=backend)`, built once and passed as `transformer=`.
        It shares the parameters (LoRA and optimizer updates are seen). Compiled with a dynamic batch size:
        one compile per grad mode (rollout, training) serves every batch the engine makes."""
        if self._compiled is None:
            self._compiled = torch.compile(self.transformer, dynamic=True, backend=backend)
        return self._compiled

    # ---------------------------------------------------------------- decoding
    @torch.no_grad()
    def decode(self, x0: torch.Tensor, height: int, width: int):
        """Packed clean latents → list of PIL images."""
        vae = self.pipe.vae
        if vae is None:
            raise RuntimeError("VAE was not loaded")
        lat = self.pipe._unpack_latents(x0.to(vae.dtype), height, width, self.vae_scale_factor)
        lat = lat / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(lat, return_dict=False)[0]
        return self.pipe.image_processor.postprocess(image.float(), output_type="pil")

    def drop_text_encoders(self) -> None:
        """Free the (large) text encoders once prompt embeddings are cached."""
        self.pipe.text_encoder = None
        self.pipe.text_encoder_2 = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

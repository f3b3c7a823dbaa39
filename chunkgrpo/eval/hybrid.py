"""Hybrid inference (MixGRPO, method.md §5): the first K of N ODE steps with the trained model, the rest
with the base model — the reward-hacking countermeasure MixGRPO and Chunk-GRPO evaluate with (late,
low-noise steps are handed back to the base model).

    trained = load_trained("runs/x/final")                 # or s3://…/final, or a model-pointer .json
    sampler = HybridSampler.load(trained.base_model, trained, device="cuda")
    cfg = HybridConfig(num_steps=50, trained_steps=30, height=1024, width=1024, guidance=3.5)
    images = sampler.generate(prompts, seeds, cfg)                     # hybrid (trained → base)
    both = sampler.generate_modes(prompts, seeds, cfg, ("hybrid", "base"))  # same noise per seed

Memory:
- **LoRA**: ONE transformer. The adapter is loaded into the base transformer (`load_lora_adapter`)
  and switched on/off per step (`BaseTunerLayer.enable_adapters`), so trained = base + adapter and
  base = adapter disabled; there is never a second copy (`benchmarks/hybrid_memory.py` measures it).
  The adapter's scale alpha/rank is restored from `chunkgrpo_model.json` when the file has no peft
  metadata (diffusers then loads LoRAs with alpha = rank, i.e. scale 1).
- **Full fine-tune**: two transformers (base from the base pipeline, trained from `final/transformer`);
  with `offload=True` the inactive one waits on the CPU (each switch moves one transformer).

Determinism: the initial noise of every image comes from its own seed (`torch.Generator("cpu")
.manual_seed(seed)`), so an image does not depend on batching and the base and trained models
start from the same noise for the same seed (fair side-by-side comparison). It is drawn as
`diffusers.FluxPipeline` draws it (unpacked layout, then packed): stock diffusers with the exported LoRA
and `generator=torch.Generator().manual_seed(seed)` starts from the same noise (docs/diffusers.md).
Training's rollouts keep their own stream (`FluxModel.initial_noise`, drawn packed).

Schedule: `schedule="dynamic"` with float timesteps is the stock diffusers FLUX pipeline schedule
(FlowMatchEulerDiscreteScheduler with dynamic shifting, as FLUX.1-dev ships it), which MixGRPO's
`DualFluxPipeline` uses; `schedule="shift"` gives the training-time schedule instead.

Verification hooks: `sampler.trace` lists `(step, phase)` of the last call, `sampler.calls` counts
transformer calls per phase, and `sampler.probe(step, phase, transformer)` (if set) is called before
every transformer call.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from chunkgrpo.config import option
from chunkgrpo.errors import UserError
from chunkgrpo.rollout import SamplingConfig

log = logging.getLogger(__name__)

META_FILE = "chunkgrpo_model.json"
LORA_FILE = "pytorch_lora_weights.safetensors"
ADAPTER_NAME = "chunkgrpo_trained"
MODES = ("hybrid", "base", "trained")


# --------------------------------------------------------------------------------------------------
# config


@dataclasses.dataclass
class HybridConfig(SamplingConfig):
    """How evaluation images are sampled: `SamplingConfig`'s fields with the paper's evaluation defaults,
    plus `trained_steps` (ODE; the first `trained_steps` steps with the trained model).

    The SDE fields (`eta`, `rule`, `same_noise`, `stochastic`) are inherited but unused: hybrid inference
    is the deterministic ODE sampler, so they are not validated and not part of `to_dict()` (the
    `sampling` entry of metrics.json and the generation fingerprint)."""

    num_steps: int = option(50, "sampling steps N (MixGRPO / Chunk-GRPO evaluation: 50)")
    trained_steps: int = option(
        30,
        "steps 0..K-1 use the trained model, K..N-1 the base model (paper: 30 of 50; "
        "K = N is trained-only, K = 0 base-only)",
    )
    schedule: Literal["dynamic", "shift"] = option(
        "dynamic",
        "σ schedule: 'dynamic' (stock diffusers FLUX pipeline, used by MixGRPO's hybrid inference) or "
        "'shift' (the training schedule)",
    )
    shift: float = option(3.0, "shift s of the 'shift' schedule (ignored by 'dynamic')")
    quantize_timesteps: bool = option(
        False,
        "give the transformer int(σ·1000) (shift recipes) instead of σ·1000 (diffusers pipeline: float)",
    )
    height: int = option(1024, "image height in pixels")
    width: int = option(1024, "image width in pixels")
    guidance: float = option(3.5, "FLUX-dev guidance embedding value")
    max_sequence_length: int = option(512, "T5 tokens per prompt (diffusers pipeline default 512)")

    SDE_FIELDS = ("eta", "rule", "same_noise", "stochastic")

    def __post_init__(self) -> None:  # the ODE sampler's own checks (N = 1 is a valid ODE)
        if self.num_steps < 1:
            raise UserError(f"num_steps={self.num_steps} must be >= 1")
        if not 0 <= self.trained_steps <= self.num_steps:
            raise UserError(f"trained_steps={self.trained_steps} must be in 0..num_steps ({self.num_steps}); "
                            "it is the number of initial steps sampled with the trained model")
        if self.height <= 0 or self.width <= 0:
            raise UserError(f"height/width must be positive, got {self.height}x{self.width}")
        if self.max_sequence_length < 1:
            raise UserError(f"max_sequence_length={self.max_sequence_length} must be >= 1")
        if self.schedule == "shift" and not self.shift > 0:
            raise UserError(f"shift={self.shift} must be > 0")

    def to_dict(self) -> dict:
        return {k: v for k, v in super().to_dict().items() if k not in self.SDE_FIELDS}

    def phase_of(self, step: int, mode: str = "hybrid") -> str:
        """'trained' or 'base': which weights step `step` uses in `mode`."""
        if mode == "base":
            return "base"
        if mode == "trained":
            return "trained"
        return "trained" if step < self.trained_steps else "base"


# --------------------------------------------------------------------------------------------------
# trained model folders


@dataclasses.dataclass
class TrainedModel:
    """A trained model folder: kind 'lora' (diffusers LoRA file) or 'full' (`transformer/` subfolder)."""

    kind: Literal["lora", "full"]
    path: Path
    base_model: str
    meta: dict
    source: str

    @property
    def lora_scale(self) -> float | None:
        """alpha / rank the adapter was trained with (from chunkgrpo_model.json), if recorded."""
        lora = self.meta.get("lora") or {}
        try:
            return float(lora["alpha"]) / float(lora["rank"])
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            return None

    def describe(self) -> dict:
        return {
            "source": self.source,
            "path": str(self.path),
            "kind": self.kind,
            "base_model": self.base_model,
            "method": self.meta.get("method"),
            "chunk_sizes": self.meta.get("chunk_sizes"),
            "optimizer_steps": self.meta.get("optimizer_steps"),
            "lora_scale": self.lora_scale,
        }


def _download(uri: str, cache_dir: str | os.PathLike | None) -> Path:
    from chunkgrpo.store.cache import cached_folder

    return cached_folder(uri, "trained", cache_dir)


def _verify_trained_files(path: Path, kind: str) -> None:
    """A trained folder is checked before any GPU time: every file against the folder's MANIFEST.json
    when it has one (the trainer writes it), and its safetensors weights readable (a truncated file
    fails its header/length check) — a UserError naming the file, never a traceback mid-evaluation."""
    from safetensors import safe_open

    from chunkgrpo.store.manifest import MANIFEST_NAME, file_sha256

    if (path / MANIFEST_NAME).is_file():
        try:
            files = json.loads((path / MANIFEST_NAME).read_text(encoding="utf-8"))["files"]
            entries = [(rel, int(e["size"]), str(e["sha256"])) for rel, e in files.items()]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise UserError(f"{path / MANIFEST_NAME} is not a readable manifest "
                            f"({type(e).__name__})") from None
        for rel, size, sha in entries:
            f = path / rel
            if not f.is_file():
                raise UserError(f"{f}: missing (listed in {MANIFEST_NAME})")
            if f.stat().st_size != size:
                raise UserError(f"{f}: {f.stat().st_size} bytes, {MANIFEST_NAME} says {size} "
                                "(truncated or replaced)")
            if file_sha256(f) != sha:
                raise UserError(f"{f}: sha256 differs from {MANIFEST_NAME} (damaged or replaced)")
    weights = [path / LORA_FILE] if kind == "lora" else sorted((path / "transformer").glob("*.safetensors"))
    for f in weights:
        try:
            with safe_open(str(f), framework="pt") as fh:
                for key in fh.keys():
                    fh.get_slice(key)
        except Exception as e:
            raise UserError(f"{f} is not a readable safetensors file ({' '.join(str(e).split())[:160]}); "
                            "truncated or damaged?") from None


def load_trained(source: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None) -> TrainedModel:
    """Resolve a trained model: a local folder (the trainer's `final/`, or its output_dir holding `final/`),
    an `s3://` folder artifact (downloaded and checksum-verified into a cache), or a model-pointer JSON file
    (`chunkgrpo.store.manifest.make_pointer`). Reads `chunkgrpo_model.json`; a plain diffusers LoRA folder
    without it is accepted as kind 'lora' with an unknown base model."""
    text = str(source).strip()
    if not text:
        raise UserError("no trained model given (model=DIR | s3://… | pointer.json)")
    pointer: dict | None = None
    if text.endswith(".json") and not text.startswith("s3://"):
        from chunkgrpo.store.manifest import read_pointer

        p = Path(text).expanduser()
        if not p.is_file():
            raise UserError(f"model pointer file {text!r} does not exist")
        pointer = read_pointer(p.read_text())
        text = pointer["uri"]
    if text.startswith("s3://"):
        path = _download(text, cache_dir)
        if pointer is not None:
            stamp = (path / ".manifest-sha256").read_text()
            if stamp != pointer["manifest_sha256"]:
                raise UserError(
                    f"{text}: manifest sha256 {stamp[:12]}… does not match the pointer's "
                    f"{pointer['manifest_sha256'][:12]}… (the folder was replaced after the pointer was made)"
                )
    else:
        path = Path(text).expanduser()
        if not path.is_dir():
            raise UserError(f"trained model folder {text!r} does not exist")
    if not (path / META_FILE).exists() and (path / "final" / META_FILE).exists():
        path = path / "final"  # a training output_dir
    meta: dict = {}
    if (path / META_FILE).exists():
        try:
            meta = json.loads((path / META_FILE).read_text())
        except json.JSONDecodeError as e:
            raise UserError(f"{path / META_FILE}: invalid JSON ({e})") from None
    kind = meta.get("kind") or (pointer or {}).get("kind")
    if kind is None:
        if (path / LORA_FILE).exists():
            kind = "lora"
        elif (path / "transformer" / "config.json").exists():
            kind = "full"
        else:
            raise UserError(
                f"{path} is not a trained model folder: no {META_FILE}, {LORA_FILE} or transformer/"
            )
    if kind not in ("lora", "full"):
        raise UserError(f"{path / META_FILE}: kind {kind!r} must be 'lora' or 'full'")
    if kind == "lora" and not (path / LORA_FILE).exists():
        raise UserError(f"{path}: kind 'lora' but {LORA_FILE} is missing")
    if kind == "full" and not (path / "transformer" / "config.json").exists():
        raise UserError(f"{path}: kind 'full' but transformer/config.json is missing")
    _verify_trained_files(path, kind)
    base = str(meta.get("base_model") or (pointer or {}).get("base_model") or "")
    return TrainedModel(kind=kind, path=path, base_model=base, meta=meta, source=str(source))


# --------------------------------------------------------------------------------------------------
# sampler


def _tuner_layers(transformer) -> list:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in transformer.modules() if isinstance(m, BaseTunerLayer)]


def noise_for_seeds(model, seeds: Sequence[int], height: int, width: int) -> torch.Tensor:
    """(B, L, C) initial noise, image b drawn from its own CPU generator seeded with seeds[b], in the layout
    and dtype `diffusers.FluxPipeline` draws it (`FluxModel.pipeline_noise`): the evaluation image of seed s
    starts from the noise of `FluxPipeline(..., generator=torch.Generator().manual_seed(s))`."""
    gens = [torch.Generator("cpu").manual_seed(int(s)) for s in seeds]
    return model.pipeline_noise(len(gens), height, width, gens)


class HybridSampler:
    """Samples with the trained model for the first K steps and the base model for the rest.

    `model` is a `chunkgrpo.flux.FluxModel` of the BASE model; `trained` a `TrainedModel` (or None: only
    mode 'base' is available)."""

    def __init__(self, model, trained: TrainedModel | None = None, *, offload: bool = False,
                 adapter_name: str = ADAPTER_NAME) -> None:
        self.model = model
        self.trained = trained
        self.offload = bool(offload)
        self.adapter_name = adapter_name
        self.probe: Callable[[int, str, Any], None] | None = None
        self.trace: list[tuple[int, str]] = []
        self.calls = {"trained": 0, "base": 0}
        self.switches = 0
        self._layers: list = []
        self._lora_params: list[torch.nn.Parameter] = []
        self._trained_transformer = None
        self._phase: str | None = None
        if trained is not None:
            if trained.kind == "lora":
                self._attach_lora(trained)
            else:
                self._load_full(trained)

    # ------------------------------------------------------------------ construction
    @classmethod
    def load(cls, base_model: str | os.PathLike, trained: TrainedModel | str | None = None, *,
             device: str | torch.device = "cpu", dtype: torch.dtype | None = None, offload: bool = False,
             cache_dir: str | os.PathLike | None = None) -> "HybridSampler":
        """Load the base pipeline once and attach the trained weights."""
        from chunkgrpo.flux import load_flux

        if isinstance(trained, (str, os.PathLike)) and str(trained):
            trained = load_trained(trained, cache_dir=cache_dir)
        model = load_flux(base_model, device=device, dtype=dtype)
        return cls(model, trained or None, offload=offload)

    def _attach_lora(self, trained: TrainedModel) -> None:
        tr = self.model.transformer
        try:
            tr.load_lora_adapter(str(trained.path), prefix="transformer", adapter_name=self.adapter_name,
                                 weight_name=LORA_FILE, local_files_only=True)
        except (ValueError, RuntimeError, KeyError) as e:
            raise UserError(
                f"cannot load the LoRA adapter {trained.path / LORA_FILE} into the base transformer "
                f"({type(e).__name__}: {e}); is base_model the model it was trained on?"
            ) from None
        self._layers = [m for m in _tuner_layers(tr) if self.adapter_name in getattr(m, "scaling", {})]
        if not self._layers:
            raise UserError(f"{trained.path / LORA_FILE} matched no module of the base transformer "
                            "(wrong base model?)")
        want = trained.lora_scale
        if want is not None:
            fixed = 0
            for m in self._layers:
                have = m.scaling[self.adapter_name]
                if abs(have - want) > 1e-6 * max(1.0, abs(want)):
                    m.scaling[self.adapter_name] = want
                    fixed += 1
            if fixed:
                log.info(
                    "LoRA scale set to alpha/rank = %g on %d layers (the file carried no alpha)", want, fixed
                )
        self._lora_params = [p for n, p in tr.named_parameters() if "lora_" in n]
        for p in self._lora_params:
            p.requires_grad_(False)
        self._set_adapter(False)
        self._phase = "base"

    def _load_full(self, trained: TrainedModel) -> None:
        from diffusers import FluxTransformer2DModel

        device = torch.device("cpu") if self.offload else self.model.device
        tr = FluxTransformer2DModel.from_pretrained(str(trained.path / "transformer"), dtype=self.model.dtype)
        tr.to(device)
        tr.requires_grad_(False)
        tr.eval()
        self._trained_transformer = tr
        self._phase = "base"

    # ------------------------------------------------------------------ switching weights
    def _set_adapter(self, enabled: bool) -> None:
        for m in self._layers:
            m.enable_adapters(enabled)
        if enabled:  # peft re-enables grads on the active adapter; inference never needs them
            for p in self._lora_params:
                p.requires_grad_(False)

    def adapter_enabled(self) -> bool | None:
        """Whether the LoRA adapter is active right now (None for full / base-only samplers)."""
        if not self._layers:
            return None
        return not self._layers[0].disable_adapters

    def transformers(self) -> list:
        """The distinct transformer modules this sampler holds (1 for LoRA / base-only, 2 for full)."""
        out = [self.model.transformer]
        if self._trained_transformer is not None:
            out.append(self._trained_transformer)
        return out

    def activate(self, phase: str):
        """Make `phase` ('trained' | 'base') the active weights; returns the transformer to call."""
        if phase not in ("trained", "base"):
            raise ValueError(f"phase {phase!r}")
        if phase == "trained" and self.trained is None:
            raise UserError("no trained model loaded: only mode 'base' is available")
        if self.trained is None:
            return self.model.transformer
        if self.trained.kind == "lora":
            if self._phase != phase:
                self._set_adapter(phase == "trained")
                self.switches += 1
            self._phase = phase
            return self.model.transformer
        active = self._trained_transformer if phase == "trained" else self.model.transformer
        if self._phase != phase:
            if self.offload and self.model.device.type != "cpu":
                inactive = self.model.transformer if phase == "trained" else self._trained_transformer
                inactive.to("cpu")
                active.to(self.model.device)
            self.switches += 1
        self._phase = phase
        return active

    # ------------------------------------------------------------------ sampling
    @torch.no_grad()
    def sample_latents(
        self, cond, x_init: torch.Tensor, cfg: HybridConfig, mode: str = "hybrid"
    ) -> torch.Tensor:
        """ODE-integrate `x_init` (B, L, C) under `cond` (a PromptEmbeds); returns x̂0 (B, L, C) of the last
        step."""
        if mode not in MODES:
            raise UserError(f"mode {mode!r} is not one of {', '.join(MODES)}")
        from chunkgrpo import sde

        model = self.model
        L = x_init.shape[1]
        sigmas = cfg.sigmas(image_seq_len=L)
        timesteps = cfg.timesteps(sigmas)
        img_ids = model.img_ids(cfg.height, cfg.width)
        x = x_init.float()
        x0 = x
        N = sigmas.numel() - 1
        for i in range(N):
            phase = cfg.phase_of(i, mode)
            tr = self.activate(phase)
            if self.probe is not None:
                self.probe(i, phase, tr)
            self.trace.append((i, phase))
            self.calls[phase] += 1
            v = model.velocity(
                x, timesteps[i].reshape(1), cond, img_ids, guidance=cfg.guidance, transformer=tr
            )
            s, sn = float(sigmas[i]), float(sigmas[i + 1])
            if i == N - 1:
                x0 = x - s * v
            else:
                x = sde.ode_step(x, v, s, sn)
        return x0

    def generate_modes(self, prompts: Sequence[str], seeds: Sequence[int], cfg: HybridConfig,
                       modes: Sequence[str] = ("hybrid", "base"), *, batch_size: int = 4,
                       on_batch: Callable[[str, list[int], list], None] | None = None) -> dict[str, list]:
        """Images for every mode, prompt i with seed i (same noise in every mode); prompts are encoded once
        per batch. `on_batch(mode, indices, images)` is called after each batch (e.g. to save files)."""
        prompts, seeds = list(prompts), list(seeds)
        if len(prompts) != len(seeds):
            raise UserError(f"got {len(prompts)} prompts and {len(seeds)} seeds; pass one seed per prompt")
        if batch_size < 1:
            raise UserError(f"batch_size={batch_size} must be >= 1")
        for m in modes:
            if m not in MODES:
                raise UserError(f"mode {m!r} is not one of {', '.join(MODES)}")
            if m != "base" and self.trained is None and not (m == "hybrid" and cfg.trained_steps == 0):
                raise UserError(f"mode {m!r} needs a trained model")
        self.model.check_resolution(cfg.height, cfg.width)
        self.trace = []
        # order the modes so the trained weights are active first (fewer switches / offload moves)
        order = sorted(modes, key=lambda m: {"trained": 0, "hybrid": 1, "base": 2}[m])
        out: dict[str, list] = {m: [] for m in modes}
        for start in range(0, len(prompts), batch_size):
            idx = list(range(start, min(start + batch_size, len(prompts))))
            cond = self.model.encode_prompts([prompts[i] for i in idx], cfg.max_sequence_length)
            x_init = noise_for_seeds(self.model, [seeds[i] for i in idx], cfg.height, cfg.width)
            for m in order:
                x0 = self.sample_latents(cond, x_init, cfg, m)
                images = self.model.decode(x0, cfg.height, cfg.width)
                out[m] += images
                if on_batch is not None:
                    on_batch(m, idx, images)
        return out

    def generate(
        self,
        prompts: Sequence[str],
        seeds: Sequence[int],
        cfg: HybridConfig,
        mode: str = "hybrid",
        *,
        batch_size: int = 4,
    ) -> list:
        """Images (PIL) for one mode: 'hybrid' (trained for K steps, then base), 'base' or 'trained'."""
        return self.generate_modes(prompts, seeds, cfg, (mode,), batch_size=batch_size)[mode]

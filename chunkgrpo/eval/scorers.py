"""Reward / preference scorers behind one batch API.

    scorer = get_scorer("pickscore", weights="/models/PickScore_v1", processor="/models/CLIP-ViT-H-14-laion2B")
    scores = scorer.score(images, prompts)      # float32 tensor, shape (n,), on CPU
    scorer.info                                 # name, model, weights, preprocessing, scale, backend, ...

Names: `hpsv3`, `imagereward`, `hpsv2.1` (and `hpsv2` = v2.0), `pickscore`, `clip`.

Scales (what `score` returns; recorded in `info["scale"]`):
- pickscore : `logit_scale.exp() * cos(text, image)`, the raw PickScore logit as reported in papers
              (logit_scale.exp() is read from the checkpoint, 100.0 for PickScore_v1; FLUX ~ 22-23). Not the
              Flow-GRPO `/26` or MixGRPO `(s-18)/8` training normalisations.
- clip      : plain cosine of L2-normalised CLIP embeddings (x `multiplier`, default 1.0), the
              DanceGRPO / MixGRPO / GCPO convention Chunk-GRPO compares against (~0.2-0.4). Use
              `multiplier=100` for the torchmetrics "CLIPScore" convention (without its max(.,0)).
- hpsv2.1   : cosine of HPSv2.1's L2-normalised open_clip ViT-H-14 features, as `hpsv2.score` returns
              (~0.2-0.37; the HPSv2 benchmark prints x100).
- hpsv3     : mu (column 0) of HPSv3's predicted (mu, sigma), ~10-11 for FLUX.1-dev.
- imagereward: ImageReward's standardised reward ((r - 0.1672) / 1.0333), ~N(0,1) over its data.

CLIP and PickScore run on `transformers` CLIPModel in the main venv; their image preprocessing is
implemented here with PIL + torch (`ClipPreprocess`; no torchvision). HPSv2, HPSv3 and ImageReward
need their own packages (`hpsv2`, `hpsv3`, `image-reward`), whose pins conflict with the main
stack: they are imported lazily and exist only in the evaluation image (images/eval).

Weights always come from a local directory/file or an `s3://` prefix (downloaded once into a
cache dir); hub ids are never resolved (`local_files_only=True`, `HF_HUB_OFFLINE=1`).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import importlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
from PIL import Image

from chunkgrpo.config import Config, option
from chunkgrpo.errors import UserError

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
CACHE_ENV = "CHUNKGRPO_CACHE_DIR"
EVAL_IMAGE_HINT = "the evaluation image (images/eval)"

Fetch = Callable[[str, Path], Any]
"""A weights fetch hook: `fetch(uri, dest_dir)` downloads everything under `uri` into `dest_dir`."""


# --------------------------------------------------------------------------------------------------
# configuration


@dataclasses.dataclass
class ScorerConfig(Config):
    """How to build one scorer (`get_scorer(**cfg.to_dict())`)."""

    name: str = option("pickscore", "scorer name: hpsv3, imagereward, hpsv2.1, hpsv2, pickscore, clip")
    weights: str | None = option(
        None,
        "local directory/file or s3:// prefix with the scorer weights (hpsv2.1: the .pt file or its folder; "
        "hpsv3: folder with HPSv3.safetensors; imagereward: folder with ImageReward.pt + med_config.json; "
        "pickscore/clip: a transformers CLIP folder). Hub ids are never downloaded.",
    )
    processor: str | None = option(
        None,
        "pickscore/clip: folder (or s3:// prefix) with tokenizer + preprocessor_config.json when they are not "
        "in `weights` (PickScore_v1 uses laion/CLIP-ViT-H-14-laion2B-s32B-b79K's processor); "
        "hpsv3: local Qwen2-VL-7B-Instruct folder (base model)",
    )
    device: str = option("auto", "torch device: auto (cuda if available), cpu, cuda, cuda:1 ...")
    dtype: str = option("float32", "model dtype for pickscore/clip: float32, bfloat16, float16")
    batch_size: int = option(16, "images per forward pass")
    cache_dir: str | None = option(None, f"where s3:// weights are downloaded (default ${CACHE_ENV} or ~/.cache/chunkgrpo)")
    multiplier: float = option(1.0, "clip only: multiply the cosine by this (1.0 = plain cosine, 100 = torchmetrics)")

    def __post_init__(self) -> None:
        self.name = canonical_name(self.name)
        if self.batch_size < 1:
            raise UserError(f"scorer batch_size={self.batch_size} must be >= 1")
        if self.dtype not in _DTYPES:
            raise UserError(f"scorer dtype={self.dtype!r} is not one of {sorted(_DTYPES)}")
        if self.multiplier <= 0:
            raise UserError(f"scorer multiplier={self.multiplier} must be > 0")
        if self.multiplier != 1.0 and self.name != "clip":
            raise UserError(f"multiplier={self.multiplier} only applies to the 'clip' scorer, not {self.name!r}")


_DTYPES = {"float32", "bfloat16", "float16"}


# --------------------------------------------------------------------------------------------------
# helpers: images, devices, weights


def to_pil_list(images: Any) -> list[Image.Image]:
    """Accept a list of PIL images / HWC uint8 arrays, or a float tensor (n,3,H,W) in [0,1]; return RGB PILs."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is always present where scorers run
        torch = None
    if torch is not None and isinstance(images, torch.Tensor):
        if images.ndim != 4 or images.shape[1] != 3:
            raise UserError(f"image tensor must be (n,3,H,W) in [0,1], got shape {tuple(images.shape)}")
        arr = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
        return [Image.fromarray(a) for a in arr]
    out = []
    for i, im in enumerate(images):
        if isinstance(im, Image.Image):
            out.append(im if im.mode == "RGB" else im.convert("RGB"))
        elif isinstance(im, np.ndarray) and im.ndim == 3 and im.dtype == np.uint8:
            out.append(Image.fromarray(im).convert("RGB"))
        else:
            raise UserError(f"images[{i}] is a {type(im).__name__}; expected a PIL image or an HWC uint8 array")
    return out


def _check_pairs(images: Sequence, prompts: Sequence[str]) -> None:
    if isinstance(prompts, str):
        raise UserError("prompts must be a list of strings (one per image), not a single string")
    if len(images) != len(prompts):
        raise UserError(f"got {len(images)} images but {len(prompts)} prompts; pass one prompt per image")


def resolve_device(device: str = "auto") -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def _torch_dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _default_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "chunkgrpo")


def _s3_download(uri: str, dest: Path) -> None:
    """Download `s3://bucket/prefix` into `dest` with `chunkgrpo.store.ArtifactStore` (endpoint and
    credentials from the environment, see chunkgrpo.store). A complete folder artifact (with MANIFEST.json)
    is fetched with checksum verification; otherwise every object under the prefix is copied (or the single
    object when the URI names a file, e.g. `.../HPS_v2.1_compressed.pt`)."""
    from chunkgrpo.store import ArtifactStore, parse_s3_uri, s3_uri

    store = ArtifactStore()
    if store.is_complete(uri):
        store.get_folder(uri, dest)
        return
    bucket, key = parse_s3_uri(uri)
    base = key.rstrip("/") + "/" if key else ""
    entries = [e for e in store.list(s3_uri(bucket, base)) if not e.is_dir]
    if entries:
        for e in entries:
            store.get_file(s3_uri(bucket, e.key), dest / e.key[len(base):])
        return
    if key and store.exists(uri):
        store.get_file(uri, dest / key.rstrip("/").rsplit("/", 1)[-1])
        return
    raise UserError(f"nothing is stored under {uri}")


def resolve_weights(
    source: str | os.PathLike | None,
    *,
    what: str,
    cache_dir: str | os.PathLike | None = None,
    fetch: Fetch | None = None,
) -> Path:
    """A local path for `source`: an existing local file/dir, or an `s3://` prefix downloaded once into
    `<cache_dir>/weights/<hash>` (a `.complete` marker makes later calls free). Hub ids are rejected."""
    if source is None or str(source).strip() == "":
        raise UserError(f"{what}: no weights given; set `weights` to a local directory or an s3:// prefix")
    text = str(source)
    if text.startswith("s3://"):
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        dest = Path(cache_dir or _default_cache_dir()) / "weights" / f"{text.rstrip('/').rsplit('/', 1)[-1]}-{digest}"
        marker = dest / ".complete"
        if marker.exists():
            return dest
        tmp = dest.with_name(dest.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        (fetch or _s3_download)(text, tmp)
        if not any(tmp.iterdir()):
            shutil.rmtree(tmp, ignore_errors=True)
            raise UserError(f"{what}: {text} is empty (nothing was downloaded)")
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
        marker.write_text(text + "\n")
        return dest
    if "://" in text:
        raise UserError(f"{what}: unsupported weights URI {text!r}; use a local path or s3://bucket/prefix")
    path = Path(text).expanduser()
    if not path.exists():
        hint = (
            " (this looks like a hub id; hub downloads are disabled: download it in advance and pass the folder)"
            if text.count("/") == 1 and not text.startswith((".", "/", "~"))
            else ""
        )
        raise UserError(f"{what}: weights path {text!r} does not exist{hint}")
    return path


def _require(module: str, scorer: str, pip_spec: str) -> Any:
    """Import an evaluation-image-only package, or raise an actionable UserError."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise UserError(
            f"scorer {scorer!r} needs the `{module}` package, which is not importable here ({e}). It lives only "
            f"in {EVAL_IMAGE_HINT} because its pins conflict with the training stack: run this scorer there, "
            f"or `pip install {pip_spec}` in a separate venv (never the main one)."
        ) from None


def _offline() -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


# --------------------------------------------------------------------------------------------------
# CLIP image preprocessing in PIL + torch


@dataclasses.dataclass(frozen=True)
class ClipPreprocess:
    """Resize the shortest side to `size` (PIL bicubic), centre-crop `crop`, scale to [0,1], normalise.

    `crop_rounding="floor"` matches transformers' CLIPImageProcessor ((h-c)//2); `"round"` matches
    torchvision's CenterCrop (round((h-c)/2)) as used by open_clip / HPSv2 / GenEval's colour CLIP.
    """

    size: int = 224
    crop: int = 224
    mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    std: tuple[float, float, float] = OPENAI_CLIP_STD
    resample: int = 3  # PIL.Image.BICUBIC
    crop_rounding: str = "floor"

    @classmethod
    def from_dir(cls, folder: Path, crop_rounding: str = "floor") -> "ClipPreprocess":
        """Read a transformers `preprocessor_config.json` (defaults: OpenAI CLIP 224)."""
        cfg_path = Path(folder) / "preprocessor_config.json"
        if not cfg_path.exists():
            return cls(crop_rounding=crop_rounding)
        cfg = json.loads(cfg_path.read_text())
        size = cfg.get("size", 224)
        if isinstance(size, dict):
            size = size.get("shortest_edge") or size.get("height") or 224
        crop = cfg.get("crop_size", size)
        if isinstance(crop, dict):
            crop = crop.get("height") or crop.get("shortest_edge") or size
        if cfg.get("do_center_crop", True) is False:
            crop = size
        return cls(
            size=int(size),
            crop=int(crop),
            mean=tuple(cfg.get("image_mean", OPENAI_CLIP_MEAN)),
            std=tuple(cfg.get("image_std", OPENAI_CLIP_STD)),
            resample=int(cfg.get("resample", 3)),
            crop_rounding=crop_rounding,
        )

    def one(self, image: Image.Image):
        import torch

        image = image.convert("RGB")
        w, h = image.size
        short, long = (w, h) if w <= h else (h, w)
        new_short, new_long = self.size, int(self.size * long / short)
        new_w, new_h = (new_short, new_long) if w <= h else (new_long, new_short)
        if (new_w, new_h) != (w, h):
            image = image.resize((new_w, new_h), resample=self.resample)
        arr = np.asarray(image, dtype=np.float32) / 255.0
        c = self.crop
        if new_h < c or new_w < c:  # pad like transformers (zeros) so tiny images still work
            padded = np.zeros((max(new_h, c), max(new_w, c), 3), np.float32)
            top, left = (padded.shape[0] - new_h) // 2, (padded.shape[1] - new_w) // 2
            padded[top : top + new_h, left : left + new_w] = arr
            arr, new_h, new_w = padded, padded.shape[0], padded.shape[1]
        if self.crop_rounding == "round":
            top, left = int(round((new_h - c) / 2.0)), int(round((new_w - c) / 2.0))
        else:
            top, left = (new_h - c) // 2, (new_w - c) // 2
        arr = arr[top : top + c, left : left + c]
        arr = (arr - np.asarray(self.mean, np.float32)) / np.asarray(self.std, np.float32)
        return torch.from_numpy(np.ascontiguousarray(arr.transpose(2, 0, 1)))

    def __call__(self, images: Sequence[Image.Image]):
        import torch

        return torch.stack([self.one(im) for im in images])

    def describe(self) -> str:
        return (
            f"RGB; resize shortest side to {self.size} (PIL bicubic={self.resample == 3}); center-crop "
            f"{self.crop} ({self.crop_rounding}); /255; normalise mean={list(self.mean)} std={list(self.std)}"
        )


# --------------------------------------------------------------------------------------------------
# scorers


class Scorer:
    """Base class: `score(images, prompts) -> torch.FloatTensor (n,)` on CPU; `info` describes it."""

    name: str = ""
    batch_size: int = 16

    def score(self, images: Sequence[Image.Image], prompts: Sequence[str]):
        import torch

        _check_pairs(images, prompts)
        images = to_pil_list(images)
        if not images:
            return torch.zeros(0, dtype=torch.float32)
        out = []
        for i in range(0, len(images), self.batch_size):
            with torch.inference_mode():
                s = self._score_batch(images[i : i + self.batch_size], list(prompts[i : i + self.batch_size]))
            out.append(torch.as_tensor(s).detach().float().reshape(-1).cpu())
        scores = torch.cat(out)
        if scores.shape != (len(images),):
            raise RuntimeError(f"{self.name}: backend returned {tuple(scores.shape)} scores for {len(images)} images")
        return scores

    __call__ = score

    def _score_batch(self, images: list[Image.Image], prompts: list[str]):  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def info(self) -> dict:
        raise NotImplementedError


class _HFClipScorer(Scorer):
    """Shared transformers-CLIP path for `clip` and `pickscore`."""

    model_label = "CLIP"

    def __init__(self, model_dir: Path, processor_dir: Path | None = None, *, device: str = "auto",
                 dtype: str = "float32", batch_size: int = 16, weights_source: str | None = None) -> None:
        _offline()
        import torch
        from transformers import AutoTokenizer, CLIPModel

        self.device = resolve_device(device)
        self.dtype = dtype
        self.batch_size = batch_size
        self.model_dir = Path(model_dir)
        self.processor_dir = Path(processor_dir) if processor_dir else self.model_dir
        self.weights_source = weights_source or str(model_dir)
        try:
            self.model = CLIPModel.from_pretrained(str(self.model_dir), local_files_only=True,
                                                   dtype=_torch_dtype(dtype))
        except (OSError, ValueError) as e:
            raise UserError(f"{self.name}: cannot load a transformers CLIP model from {str(self.model_dir)!r}: {e}") from None
        self.model.eval().requires_grad_(False).to(self.device)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(self.processor_dir), local_files_only=True)
        except (OSError, ValueError) as e:
            raise UserError(
                f"{self.name}: no tokenizer in {str(self.processor_dir)!r} ({e}); pass `processor=` pointing at the "
                "folder with the CLIP tokenizer + preprocessor_config.json"
            ) from None
        self.preprocess = ClipPreprocess.from_dir(self.processor_dir, crop_rounding="floor")
        self.max_length = min(int(self.model.config.text_config.max_position_embeddings), 77)
        self._torch = torch

    def embed_text(self, prompts: list[str]):
        tok = self.tokenizer(list(prompts), padding=True, truncation=True, max_length=self.max_length,
                             return_tensors="pt")
        m = self.model
        out = m.text_model(input_ids=tok["input_ids"].to(self.device),
                           attention_mask=tok["attention_mask"].to(self.device))
        feats = m.text_projection(out.pooler_output).float()
        return feats / feats.norm(dim=-1, keepdim=True)

    def embed_images(self, images: list[Image.Image]):
        m = self.model
        pixels = self.preprocess(images).to(self.device, dtype=_torch_dtype(self.dtype))
        out = m.vision_model(pixel_values=pixels)
        feats = m.visual_projection(out.pooler_output).float()
        return feats / feats.norm(dim=-1, keepdim=True)

    def cosine(self, images: list[Image.Image], prompts: list[str]):
        return (self.embed_images(images) * self.embed_text(prompts)).sum(-1)

    def _base_info(self) -> dict:
        return {
            "name": self.name,
            "backend": "transformers CLIPModel",
            "weights": self.weights_source,
            "processor": str(self.processor_dir),
            "preprocessing": self.preprocess.describe() + f"; text: CLIP BPE, truncate to {self.max_length} tokens",
            "device": self.device,
            "dtype": self.dtype,
            "higher_is_better": True,
        }


class ClipScorer(_HFClipScorer):
    name = "clip"

    def __init__(self, *args: Any, multiplier: float = 1.0, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.multiplier = float(multiplier)

    def _score_batch(self, images, prompts):
        return self.cosine(images, prompts) * self.multiplier

    @property
    def info(self) -> dict:
        scale = "cosine of L2-normalised CLIP embeddings, range [-1,1] (typically 0.2-0.4)"
        if self.multiplier != 1.0:
            scale = f"{self.multiplier:g} x " + scale
        return {**self._base_info(), "scale": scale, "multiplier": self.multiplier}


class PickScoreScorer(_HFClipScorer):
    name = "pickscore"

    def _score_batch(self, images, prompts):
        return self.model.logit_scale.exp().float() * self.cosine(images, prompts)

    @property
    def info(self) -> dict:
        ls = float(self.model.logit_scale.exp())
        return {**self._base_info(), "logit_scale_exp": ls,
                "scale": f"logit_scale.exp() ({ls:g}) x cosine: the raw PickScore logit (FLUX.1-dev ~22-23); "
                         "no /26 or (s-18)/8 normalisation"}


class HPSv2Scorer(Scorer):
    """HPSv2 / HPSv2.1 through the `hpsv2` package's vendored open_clip (ViT-H-14, no pretrained download)."""

    def __init__(self, checkpoint: Path, *, version: str = "v2.1", device: str = "auto", batch_size: int = 16,
                 weights_source: str | None = None) -> None:
        self.name = "hpsv2.1" if version == "v2.1" else "hpsv2"
        self.version = version
        self.batch_size = batch_size
        _require("hpsv2", self.name, "hpsv2  # + copy open_clip's bpe_simple_vocab_16e6.txt.gz into hpsv2/src/open_clip/")
        _offline()
        import torch

        oc = _require("hpsv2.src.open_clip", self.name, "hpsv2")
        checkpoint = Path(checkpoint)
        if checkpoint.is_dir():
            fname = "HPS_v2.1_compressed.pt" if version == "v2.1" else "HPS_v2_compressed.pt"
            checkpoint = checkpoint / fname
        if not checkpoint.is_file():
            raise UserError(f"{self.name}: checkpoint {str(checkpoint)!r} not found")
        self.device = resolve_device(device)
        self.checkpoint = checkpoint
        self.weights_source = weights_source or str(checkpoint)
        model, _, preprocess_val = oc.create_model_and_transforms(
            "ViT-H-14", None, precision="amp", device=self.device, jit=False, force_quick_gelu=False,
            force_custom_text=False, force_patch_dropout=False, force_image_size=None, pretrained_image=False,
            image_mean=None, image_std=None, light_augmentation=True, aug_cfg={}, output_dict=True,
            with_score_predictor=False, with_region_predictor=False,
        )
        state = torch.load(str(checkpoint), map_location="cpu", weights_only=True)
        model.load_state_dict(state.get("state_dict", state) if isinstance(state, dict) else state)
        self.model = model.to(self.device).eval()
        self.preprocess_val = preprocess_val
        try:
            self.tokenizer = oc.get_tokenizer("ViT-H-14")
            self.tokenizer(["probe"])
        except FileNotFoundError as e:
            raise UserError(
                f"{self.name}: the hpsv2 wheel lacks open_clip's BPE vocab ({e}); copy "
                "open_clip/bpe_simple_vocab_16e6.txt.gz from open-clip-torch into hpsv2/src/open_clip/ "
                f"(done in {EVAL_IMAGE_HINT})"
            ) from None

    def _score_batch(self, images, prompts):
        import torch

        pixels = torch.stack([self.preprocess_val(im) for im in images]).to(self.device)
        text = self.tokenizer(prompts).to(self.device)
        with torch.autocast(device_type="cuda" if str(self.device).startswith("cuda") else "cpu",
                            enabled=str(self.device).startswith("cuda")):
            out = self.model(pixels, text)
        img, txt = out["image_features"], out["text_features"]
        return (img.float() * txt.float()).sum(-1)  # == diag(img @ txt.T)

    @property
    def info(self) -> dict:
        return {
            "name": self.name, "backend": "hpsv2 package (vendored open_clip ViT-H-14)",
            "weights": self.weights_source, "device": self.device, "higher_is_better": True,
            "preprocessing": "open_clip preprocess_val: resize shortest side 224 bicubic, center-crop 224 (round), "
                             "OpenAI CLIP mean/std; text: open_clip SimpleTokenizer, 77 tokens; amp on CUDA",
            "scale": "cosine of L2-normalised features, as hpsv2.score returns (~0.2-0.37; x100 in HPSv2 tables)",
        }


class HPSv3Scorer(Scorer):
    """HPSv3 (Qwen2-VL-7B reward model) through the `hpsv3` package; returns mu of (mu, sigma)."""

    name = "hpsv3"

    def __init__(self, weights: Path, *, base_model: Path | None = None, device: str = "auto",
                 batch_size: int = 4, cache_dir: str | None = None, weights_source: str | None = None) -> None:
        hpsv3 = _require("hpsv3", "hpsv3", "hpsv3 matplotlib tensorboard")
        _offline()
        weights = Path(weights)
        ckpt = weights / "HPSv3.safetensors" if weights.is_dir() else weights
        if not ckpt.is_file():
            raise UserError(f"hpsv3: checkpoint {str(ckpt)!r} not found (expected HPSv3.safetensors)")
        self.device = resolve_device(device)
        self.batch_size = batch_size
        self.weights_source = weights_source or str(ckpt)
        if base_model is None and weights.is_dir() and (weights / "Qwen2-VL-7B-Instruct").is_dir():
            base_model = weights / "Qwen2-VL-7B-Instruct"
        self.base_model = str(base_model) if base_model else "Qwen/Qwen2-VL-7B-Instruct (HF cache)"
        config_path = self._config_with_base(hpsv3, base_model, cache_dir) if base_model else None
        self.inferencer = hpsv3.HPSv3RewardInferencer(config_path=config_path, checkpoint_path=str(ckpt),
                                                      device=self.device)

    @staticmethod
    def _config_with_base(hpsv3: Any, base_model: Path, cache_dir: str | None) -> str:
        import yaml

        src = Path(hpsv3.__file__).parent / "config" / "HPSv3_7B.yaml"
        cfg = yaml.safe_load(src.read_text()) if src.exists() else {}
        cfg["model_name_or_path"] = str(base_model)
        out = Path(cache_dir or _default_cache_dir()) / "hpsv3" / "HPSv3_7B.yaml"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(yaml.safe_dump(cfg, sort_keys=False))
        return str(out)

    def _score_batch(self, images, prompts):
        import torch

        r = torch.as_tensor(self.inferencer.reward(images, prompts))
        return r[:, 0] if r.ndim == 2 else r

    @property
    def info(self) -> dict:
        return {
            "name": self.name, "backend": "hpsv3 package (HPSv3RewardInferencer, Qwen2-VL-7B, bf16)",
            "weights": self.weights_source, "base_model": self.base_model, "device": self.device,
            "higher_is_better": True,
            "preprocessing": "qwen_vl_utils: resize to 256*28*28 = 200,704 pixels (min=max); HPSv3 instruction prompt",
            "scale": "mu of the predicted (mu, sigma) (column 0); FLUX.1-dev ~10-11",
        }


class ImageRewardScorer(Scorer):
    """ImageReward-v1.0 through the `image-reward` package (import name `ImageReward`)."""

    name = "imagereward"

    def __init__(self, weights: Path, *, device: str = "auto", batch_size: int = 16,
                 weights_source: str | None = None) -> None:
        rm = _require("ImageReward", "imagereward",
                      "image-reward --no-deps fairscale openai-clip  # see docs: its timm/transformers pins")
        _offline()
        weights = Path(weights)
        ckpt = weights / "ImageReward.pt" if weights.is_dir() else weights
        med = ckpt.parent / "med_config.json"
        for p in (ckpt, med):
            if not p.is_file():
                raise UserError(f"imagereward: {str(p)!r} not found (need ImageReward.pt and med_config.json)")
        self.device = resolve_device(device)
        self.batch_size = batch_size
        self.weights_source = weights_source or str(ckpt)
        self.model = rm.load(str(ckpt), device=self.device, med_config=str(med))
        self.model.eval()

    def _score_batch(self, images, prompts):
        import torch

        # ImageReward.score(prompt, image) scores one (prompt, image) pair; prompts differ per image.
        return torch.tensor([float(self.model.score(p, im)) for im, p in zip(images, prompts)])

    @property
    def info(self) -> dict:
        return {
            "name": self.name, "backend": "image-reward package (BLIP ViT-L + BERT, MLP head)",
            "weights": self.weights_source, "device": self.device, "higher_is_better": True,
            "preprocessing": "resize 224 bicubic + center-crop 224, OpenAI CLIP mean/std; text truncated to 35 tokens "
                             "(bert-base-uncased tokenizer from the HF cache)",
            "scale": "standardised reward (r - 0.16717) / 1.03334 (ImageReward-v1.0 output)",
        }


# --------------------------------------------------------------------------------------------------
# registry

SCORER_NAMES = ("hpsv3", "imagereward", "hpsv2.1", "hpsv2", "pickscore", "clip")
_ALIASES = {"hpsv2_1": "hpsv2.1", "hpsv21": "hpsv2.1", "hps": "hpsv2.1", "image_reward": "imagereward",
            "image-reward": "imagereward", "pick": "pickscore", "pick_score": "pickscore", "clipscore": "clip",
            "clip_score": "clip"}


def canonical_name(name: str) -> str:
    key = str(name).strip().lower()
    key = _ALIASES.get(key, key)
    if key not in SCORER_NAMES:
        close = difflib.get_close_matches(key, SCORER_NAMES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UserError(f"unknown scorer {name!r}{hint}; known: {', '.join(SCORER_NAMES)}")
    return key


def get_scorer(name: str, *, fetch: Fetch | None = None, **cfg: Any) -> Scorer:
    """Build a scorer by name. `cfg` keys are `ScorerConfig` fields (weights, processor, device, dtype,
    batch_size, cache_dir, multiplier). `fetch(uri, dest_dir)` downloads `s3://` weights when given."""
    conf = ScorerConfig.from_dict({"name": name, **cfg})
    n = conf.name
    kw = {"device": conf.device, "batch_size": conf.batch_size}
    if n == "hpsv3":
        _require("hpsv3", n, "hpsv3 matplotlib tensorboard")
    elif n == "imagereward":
        _require("ImageReward", n, "image-reward --no-deps fairscale openai-clip")
    elif n.startswith("hpsv2"):
        _require("hpsv2", n, "hpsv2")
    w = resolve_weights(conf.weights, what=n, cache_dir=conf.cache_dir, fetch=fetch)
    src = str(conf.weights)
    if n in ("clip", "pickscore"):
        proc = resolve_weights(conf.processor, what=f"{n} processor", cache_dir=conf.cache_dir, fetch=fetch) \
            if conf.processor else None
        cls = ClipScorer if n == "clip" else PickScoreScorer
        extra = {"multiplier": conf.multiplier} if n == "clip" else {}
        return cls(w, proc, dtype=conf.dtype, weights_source=src, **kw, **extra)
    if n.startswith("hpsv2"):
        return HPSv2Scorer(w, version="v2.1" if n == "hpsv2.1" else "v2.0", weights_source=src, **kw)
    if n == "hpsv3":
        base = resolve_weights(conf.processor, what="hpsv3 base model", cache_dir=conf.cache_dir, fetch=fetch) \
            if conf.processor else None
        return HPSv3Scorer(w, base_model=base, cache_dir=conf.cache_dir, weights_source=src, **kw)
    return ImageRewardScorer(w, weights_source=src, **kw)


# --------------------------------------------------------------------------------------------------
# tiny random-weight CLIP for tests

from chunkgrpo.bpe import bytes_to_unicode  # noqa: E402


def build_clip_bpe(words: Sequence[str] = ("a", "photo", "of", "the", "cat", "dog", "red", "blue")) -> tuple[dict, list]:
    """A small byte-level CLIP BPE: 256 byte chars + their `</w>` forms + merges spelling `words` whole."""
    chars = list(bytes_to_unicode().values())
    vocab_list = chars + [c + "</w>" for c in chars]
    merges: list[str] = []
    for word in words:
        parts = list(word[:-1]) + [word[-1] + "</w>"]
        while len(parts) > 1:
            a, b = parts[0], parts[1]
            merged = a + b
            if f"{a} {b}" not in merges:
                merges.append(f"{a} {b}")
            if merged not in vocab_list:
                vocab_list.append(merged)
            parts = [merged] + parts[2:]
    vocab_list += ["<|startoftext|>", "<|endoftext|>"]
    return {tok: i for i, tok in enumerate(vocab_list)}, merges


def make_tiny_clip(folder: str | os.PathLike, *, seed: int = 0, image_size: int = 32, hidden: int = 32,
                   projection_dim: int = 16, logit_scale: float = 4.6052) -> Path:
    """Save a random-weight tiny `CLIPModel` + a locally built `CLIPTokenizer` + `preprocessor_config.json`
    to `folder` (offline; ~1 MB). Loadable by `get_scorer("clip"|"pickscore", weights=folder)`."""
    import torch
    from transformers import CLIPConfig, CLIPModel, CLIPTokenizer

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab, merges = build_clip_bpe()
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    tok = CLIPTokenizer(vocab=str(folder / "vocab.json"), merges=str(folder / "merges.txt"), model_max_length=77)
    tok.save_pretrained(str(folder))
    eos = vocab["<|endoftext|>"]
    torch.manual_seed(seed)
    config = CLIPConfig(
        text_config=dict(vocab_size=len(vocab), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=77,
                         bos_token_id=vocab["<|startoftext|>"], eos_token_id=eos, pad_token_id=eos),
        vision_config=dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                           num_attention_heads=4, image_size=image_size, patch_size=8),
        projection_dim=projection_dim, logit_scale_init_value=logit_scale,
    )
    CLIPModel(config).save_pretrained(str(folder))
    (folder / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "CLIPImageProcessor", "do_resize": True, "size": {"shortest_edge": image_size},
        "do_center_crop": True, "crop_size": {"height": image_size, "width": image_size}, "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": list(OPENAI_CLIP_MEAN),
        "image_std": list(OPENAI_CLIP_STD), "resample": 3, "do_convert_rgb": True,
    }, indent=2))
    return folder

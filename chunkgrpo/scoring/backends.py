"""The reward-model backends the scorer worker runs: one class per package, each loading its model once.

    backend = load_backend("hpsv2.1", {"weights": "/models/HPS_v2.1_compressed.pt", "device": "cpu"})
    backend.score(images, prompts)      # float64 array (n,)
    check("imagereward")                # what stops the package from loading here ([] = nothing)

`ClipBackend` (transformers CLIP: `clip`, `pickscore`), `HPSv2Backend` (the `hpsv2` package's open_clip),
`ImageRewardBackend` (`image-reward`), `HPSv3Backend` (`hpsv3`, Qwen2-VL), with `ClipPreprocess` (CLIP image
preprocessing in PIL + numpy). Staged with `chunkgrpo.scoring.worker` into the reward venvs, where chunkgrpo
is not installed: like the worker, this module imports only the standard library, numpy and PIL at import
time, and torch + the scorer's package lazily. The same classes run in-process when no venv is configured
(`chunkgrpo.scoring.scorers`), so both paths share one implementation.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from PIL import Image

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

# scorer -> (import name, distribution name) of the package the scorer runs
PACKAGES = {
    "hpsv2": ("hpsv2", "hpsv2"),
    "hpsv2.1": ("hpsv2", "hpsv2"),
    "imagereward": ("ImageReward", "image-reward"),
    "hpsv3": ("hpsv3", "hpsv3"),
    "clip": ("transformers", "transformers"),
    "pickscore": ("transformers", "transformers"),
}


class SpecError(ValueError):
    """A configuration problem the user can fix (missing file, missing tokenizer in the HF cache, package
    not installed). The parent turns it into `chunkgrpo.errors.UserError`."""


# --------------------------------------------------------------------------------------------------
# helpers


def offline() -> None:
    """Never resolve hub ids: every file comes from a local folder or an already-populated HF cache."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


def resolve_device(device: str = "auto") -> str:
    """`device` resolved to cuda/cuda:N/cpu. A GPU that was asked for (`cuda...`, or `auto` in a task given
    GPUs) and that this environment's torch cannot use is a SpecError naming the driver and torch's CUDA
    (`chunkgrpo.gpu`), never a silent run on the CPU; a reward venv's torch may need a newer driver than
    the main environment's."""
    from chunkgrpo import gpu
    from chunkgrpo.errors import UserError

    try:
        return gpu.require(device)
    except UserError as e:
        raise SpecError(f"{e} [torch of {sys.prefix}]") from None


def torch_dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def import_package(scorer: str):
    """Import the scorer's package; SpecError (not a traceback) when it is missing or broken."""
    module, dist = PACKAGES[scorer]
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise SpecError(
            f"scorer {scorer!r}: package `{dist}` is not importable by {sys.executable} ({e})"
        ) from None


def _file(p: Any, what: str) -> Path:
    path = Path(str(p)) if p else None
    if path is None or not path.is_file():
        raise SpecError(f"{what} {str(p)!r} not found")
    return path


def safe_torch_load(path: Path, what: str):
    """torch.load restricted to tensors and plain containers (weights_only=True): a checkpoint that
    carries pickled code is refused instead of executed."""
    import pickle

    import torch

    try:
        return torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SpecError(
            f"{what} {str(path)!r} holds pickled objects other than tensors and is refused "
            "(weights_only=True): "
            f"{first}. Re-save it as a plain state_dict (torch.save(model.state_dict(), ...))."
        ) from None


# --------------------------------------------------------------------------------------------------
# CLIP image preprocessing in PIL + numpy (+ torch for the tensor)


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
        return cls(size=int(size), crop=int(crop), mean=tuple(cfg.get("image_mean", OPENAI_CLIP_MEAN)),
                   std=tuple(cfg.get("image_std", OPENAI_CLIP_STD)), resample=int(cfg.get("resample", 3)),
                   crop_rounding=crop_rounding)

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
# backends: each loads its model once; score(images, prompts) -> float64 array (n,)


class Backend:
    name = ""
    model: Any = None

    def score(self, images: list[Image.Image], prompts: list[str]) -> np.ndarray:
        import torch

        with torch.inference_mode():
            out = self._score(images, prompts)
        return np.asarray(torch.as_tensor(out).detach().float().cpu().numpy(), dtype=np.float64).reshape(-1)

    def _score(self, images, prompts):  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def info(self) -> dict:  # pragma: no cover - abstract
        raise NotImplementedError


class ClipBackend(Backend):
    """transformers `CLIPModel` for `clip` (cosine x multiplier) and `pickscore` (logit_scale.exp() x
    cosine)."""

    def __init__(self, name: str, model_dir: str, processor_dir: str | None = None, *, device: str = "auto",
                 dtype: str = "float32", multiplier: float = 1.0) -> None:
        offline()
        import torch  # noqa: F401
        from transformers import AutoTokenizer, CLIPModel

        self.name = name
        self.device = resolve_device(device)
        self.dtype = dtype
        self.multiplier = float(multiplier)
        self.model_dir = Path(model_dir)
        self.processor_dir = Path(processor_dir) if processor_dir else self.model_dir
        try:
            self.model = CLIPModel.from_pretrained(
                str(self.model_dir), local_files_only=True, dtype=torch_dtype(dtype)
            )
        except (OSError, ValueError) as e:
            raise SpecError(
                f"{name}: cannot load a transformers CLIP model from {str(self.model_dir)!r}: {e}"
            ) from None
        self.model.eval().requires_grad_(False).to(self.device)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(self.processor_dir), local_files_only=True)
        except (OSError, ValueError) as e:
            raise SpecError(
                f"{name}: no tokenizer in {str(self.processor_dir)!r} ({e}); pass `processor=` pointing at "
                "the folder with the CLIP tokenizer + preprocessor_config.json"
            ) from None
        self.preprocess = ClipPreprocess.from_dir(self.processor_dir, crop_rounding="floor")
        self.max_length = min(int(self.model.config.text_config.max_position_embeddings), 77)

    def embed_text(self, prompts: list[str]):
        tok = self.tokenizer(
            list(prompts), padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        )
        out = self.model.text_model(input_ids=tok["input_ids"].to(self.device),
                                    attention_mask=tok["attention_mask"].to(self.device))
        feats = self.model.text_projection(out.pooler_output).float()
        return feats / feats.norm(dim=-1, keepdim=True)

    def embed_images(self, images: list[Image.Image]):
        pixels = self.preprocess(images).to(self.device, dtype=torch_dtype(self.dtype))
        feats = self.model.visual_projection(
            self.model.vision_model(pixel_values=pixels).pooler_output
        ).float()
        return feats / feats.norm(dim=-1, keepdim=True)

    def cosine(self, images: list[Image.Image], prompts: list[str]):
        return (self.embed_images(images) * self.embed_text(prompts)).sum(-1)

    def _score(self, images, prompts):
        if self.name == "pickscore":  # PickScore: logit_scale.exp() * cos(text, image)
            return self.model.logit_scale.exp().float() * self.cosine(images, prompts)
        return self.cosine(images, prompts) * self.multiplier  # CLIP score: cosine (x multiplier)

    @property
    def info(self) -> dict:
        base = {
            "name": self.name,
            "backend": "transformers CLIPModel",
            "processor": str(self.processor_dir),
            "preprocessing": self.preprocess.describe()
            + f"; text: CLIP BPE, truncate to {self.max_length} tokens",
            "device": self.device,
            "dtype": self.dtype,
            "higher_is_better": True,
        }
        if self.name == "pickscore":
            ls = float(self.model.logit_scale.exp())
            return {
                **base,
                "logit_scale_exp": ls,
                "scale": f"logit_scale.exp() ({ls:g}) x cosine: the raw PickScore logit (FLUX.1-dev ~22-23); "
                "no /26 or (s-18)/8 normalisation",
            }
        scale = "cosine of L2-normalised CLIP embeddings, range [-1,1] (typically 0.2-0.4)"
        if self.multiplier != 1.0:
            scale = f"{self.multiplier:g} x " + scale
        return {**base, "scale": scale, "multiplier": self.multiplier}


class HPSv2Backend(Backend):
    """HPSv2 / HPSv2.1: the `hpsv2` package's vendored open_clip model, its `preprocess_val`, its tokenizer,
    scored as `hpsv2.img_score.score` does (diag(image_features @ text_features.T)) but batched and with the
    checkpoint loaded once. `model_config` builds another open_clip architecture than ViT-H-14 (reduced
    models for tests)."""

    def __init__(
        self, name: str, checkpoint: str, *, device: str = "auto", model_config: str | None = None
    ) -> None:
        offline()
        import torch  # noqa: F401

        self.name = name
        ckpt = _file(checkpoint, f"{name}: checkpoint")
        import_package(name)
        try:
            oc = importlib.import_module("hpsv2.src.open_clip")
        except FileNotFoundError as e:  # the wheel lacks its BPE vocabulary: open_clip opens it at import
            raise SpecError(_HPSV2_VOCAB_HINT.format(err=e)) from None
        arch = "ViT-H-14"
        if model_config:
            cfg = _file(model_config, f"{name}: model_config")
            oc.add_model_config(cfg)
            arch = cfg.stem
        self.device = resolve_device(device)
        self.arch = arch
        self.checkpoint = str(ckpt)
        # pretrained=None where the package passes 'laion2B-s32B-b79K': those weights would be downloaded
        # only to be overwritten by the HPS checkpoint below.
        model, _, self.preprocess_val = oc.create_model_and_transforms(
            arch, None, precision="amp", device=self.device, jit=False, force_quick_gelu=False,
            force_custom_text=False, force_patch_dropout=False, force_image_size=None, pretrained_image=False,
            image_mean=None, image_std=None, light_augmentation=True, aug_cfg={}, output_dict=True,
            with_score_predictor=False, with_region_predictor=False)
        state = safe_torch_load(ckpt, f"{name}: checkpoint")
        state = state["state_dict"] if isinstance(state, dict) and "state_dict" in state else state
        try:
            model.load_state_dict(state)
        except RuntimeError as e:
            raise SpecError(f"{name}: checkpoint {str(ckpt)!r} does not fit the {arch} model: "
                            f"{str(e).splitlines()[0]}") from None
        self.model = model.to(self.device).eval()
        self.tokenizer = oc.get_tokenizer(arch)

    def _score(self, images, prompts):
        import torch

        pixels = torch.stack([self.preprocess_val(im) for im in images]).to(self.device)
        text = self.tokenizer(list(prompts)).to(self.device)
        cuda = str(self.device).startswith("cuda")
        with torch.autocast(device_type="cuda" if cuda else "cpu", enabled=cuda):
            out = self.model(pixels, text)
        img, txt = out["image_features"], out["text_features"]
        return (img.float() * txt.float()).sum(-1)  # == diag(img @ txt.T), one prompt per image

    @property
    def info(self) -> dict:
        return {
            "name": self.name,
            "backend": f"hpsv2 package (vendored open_clip {self.arch})",
            "device": self.device,
            "higher_is_better": True,
            "preprocessing": (
                "hpsv2 preprocess_val (light_augmentation=True, as hpsv2.score): RGB to "
                "a float tensor, resize the LONGEST side to 224 (bicubic on the tensor, "
                "torchvision's antialias), pad the other side to 224 with 0 (black), "
                "centred, no crop; OpenAI CLIP mean/std; text: open_clip SimpleTokenizer, "
                "77 tokens; amp on CUDA"
            ),
            "scale": (
                "cosine of L2-normalised features, as hpsv2.score returns (~0.2-0.37; x100 in HPSv2 tables)"
            ),
        }


_HPSV2_VOCAB_HINT = (
    "hpsv2: the hpsv2 wheel lacks open_clip's BPE vocabulary ({err}); copy bpe_simple_vocab_16e6.txt.gz from "
    "the open-clip-torch package into hpsv2/src/open_clip/ "
    "(scripts/reward-envs.sh and the eval image do this)"
)


def load_state_strict(model, state: Any, what: str, *, assign: bool = False) -> None:
    """`model.load_state_dict(state, strict=True)`, failing in one line that names what does not fit: the
    weights the checkpoint lacks (a truncated or different checkpoint would otherwise leave them at their
    random initialisation and still score), those it has in excess, or a shape that differs.

    `assign=True` is for a model whose parameters were built empty (meta): they take the checkpoint's
    tensors (`load_state_dict(assign=True)`), each cast to the dtype the model declared, so the model
    computes in the dtype it would have after a copying load."""
    if not isinstance(state, dict):
        raise SpecError(f"{what} is not a state dict (got {type(state).__name__})")
    expected = set(model.state_dict())
    missing = sorted(expected - set(state))
    unexpected = sorted(set(state) - expected)

    def some(keys: list[str]) -> str:
        return ", ".join(keys[:8]) + (f", … (+{len(keys) - 8})" if len(keys) > 8 else "")

    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"lacks {len(missing)} of the model's {len(expected)} weights ({some(missing)})")
        if unexpected:
            parts.append(f"has {len(unexpected)} weights the model does not ({some(unexpected)})")
        raise SpecError(f"{what} does not fit the model: it {' and '.join(parts)}")
    if assign:
        import torch

        declared = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        state = {k: v.to(declared[k].dtype) if torch.is_tensor(v) and v.is_floating_point() else v
                 for k, v in state.items()}
    try:
        model.load_state_dict(state, strict=True, assign=assign)
    except RuntimeError as e:  # shapes
        msg = " ".join(ln.strip() for ln in str(e).splitlines()[1:3] if ln.strip()) or str(e).splitlines()[0]
        raise SpecError(f"{what} does not fit the model: {msg[:400]}") from None


class ImageRewardBackend(Backend):
    """ImageReward-v1.0 with the `image-reward` package's own `ImageReward` model (BLIP ViT-L + BERT + MLP
    head, built from `med_config.json`), loaded as `ImageReward.load(<checkpoint>, med_config=...)` does but
    with the checkpoint read by `safe_torch_load` and loaded **strictly** (the package passes strict=False,
    which scores a checkpoint missing its head with random weights): see `load_state_strict`. A batch is
    scored per prompt with `inference_rank(prompt, images)` (a single image with `score(prompt, image)`)."""

    name = "imagereward"

    def __init__(
        self, name: str, checkpoint: str, *, med_config: str | None = None, tokenizer: str | None = None,
        device: str = "auto",
    ) -> None:
        offline()
        ckpt = _file(checkpoint, "imagereward: checkpoint")
        med = _file(med_config or ckpt.parent / "med_config.json", "imagereward: med_config.json")
        if tokenizer:  # the package loads it by hub name: install the cached folder under that name
            from chunkgrpo.scoring.hub_cache import install_snapshot

            try:
                install_snapshot("bert-base-uncased", tokenizer)
            except ValueError as e:
                raise SpecError(f"imagereward: tokenizer {e}") from None
        rm = import_package("imagereward")
        problem = bert_tokenizer_problem()
        if problem:
            raise SpecError(problem)
        self.device = resolve_device(device)
        state = safe_torch_load(ckpt, "imagereward: checkpoint")
        from accelerate import init_empty_weights  # a dependency of image-reward

        # the parameters are built empty (meta) and then take the checkpoint's tensors: a random
        # initialisation of ViT-L + BERT that the strict load would overwrite costs seconds of CPU
        with init_empty_weights(include_buffers=False):
            model = rm.ImageReward(device=self.device, med_config=str(med))
        load_state_strict(model, state, f"imagereward: checkpoint {str(ckpt)!r}", assign=True)
        self.model = model.to(self.device).eval()

    def _score(self, images, prompts):
        import torch

        out = [0.0] * len(images)
        groups: dict[str, list[int]] = {}
        for i, p in enumerate(prompts):
            groups.setdefault(p, []).append(i)
        for prompt, idx in groups.items():
            if len(idx) == 1:
                vals = [self.model.score(prompt, images[idx[0]])]
            else:  # one text encoding, every image of the group
                _, vals = self.model.inference_rank(prompt, [images[i] for i in idx])
            for i, v in zip(idx, vals):
                out[i] = float(v)
        return torch.tensor(out, dtype=torch.float64)

    @property
    def info(self) -> dict:
        return {
            "name": self.name,
            "backend": "image-reward package (BLIP ViT-L + BERT, MLP head)",
            "device": self.device,
            "higher_is_better": True,
            "preprocessing": "resize 224 bicubic + center-crop 224, OpenAI CLIP mean/std; text truncated to "
            "35 tokens (bert-base-uncased tokenizer from the HF cache)",
            "scale": "standardised reward (r - 0.16717) / 1.03334 (ImageReward-v1.0 output)",
        }


def bert_tokenizer_problem() -> str | None:
    """ImageReward builds `BertTokenizer.from_pretrained('bert-base-uncased')`: offline, that needs the files
    in the Hugging Face cache. None when they are there, else an actionable message."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError as e:  # pragma: no cover - huggingface_hub is a dependency of image-reward
        return f"imagereward: huggingface_hub is not importable ({e})"
    found = try_to_load_from_cache("bert-base-uncased", "vocab.txt")
    if isinstance(found, str) and os.path.isfile(found):
        return None
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return (
        "imagereward: the `bert-base-uncased` tokenizer (vocab.txt) is not in the Hugging Face cache "
        f"(HF_HOME={home}); ImageReward loads it by name at model build and downloads are disabled. Populate "
        "the model cache (`chunkgrpo models sync --defaults` puts google-bert/bert-base-uncased's tokenizer "
        "there) and pass it as the scorer's `processor` (scorer_weights key 'imagereward.processor')"
    )


class HPSv3Backend(Backend):
    """HPSv3 through the `hpsv3` package: `HPSv3RewardInferencer(config_path, checkpoint_path, device)` builds
    `Qwen2VLRewardModelBT` on the base model named in the config and loads HPSv3.safetensors strictly;
    `reward(images, prompts)` (images first) -> (mu, sigma) per image; the score is mu."""

    name = "hpsv3"

    def __init__(self, name: str, checkpoint: str, *, base_model: str | None = None, device: str = "auto",
                 config_dir: str | None = None) -> None:
        offline()
        ckpt = _file(checkpoint, "hpsv3: checkpoint")
        hpsv3 = import_package("hpsv3")
        self.device = resolve_device(device)
        self.checkpoint = str(ckpt)
        self.base_model = str(base_model) if base_model else "Qwen/Qwen2-VL-7B-Instruct (HF cache)"
        # the package's config with the base model path; on CPU in float32: its rm_head runs under a
        # CUDA-only autocast, so bf16 hidden states would meet the float32 head on CPU.
        import yaml  # a dependency of hpsv3 (its configs are YAML)

        cfg = yaml.safe_load((Path(hpsv3.__file__).parent / "config" / "HPSv3_7B.yaml").read_text())
        if base_model:
            cfg["model_name_or_path"] = str(base_model)
        if not self.device.startswith("cuda"):
            cfg.update(bf16=False, torch_dtype="float32")
        self.dtype = "bfloat16" if self.device.startswith("cuda") else "float32"
        fd, cfg_path = tempfile.mkstemp(prefix="HPSv3_7B-", suffix=".yaml", dir=config_dir)
        try:
            with os.fdopen(fd, "w") as f:
                yaml.safe_dump(cfg, f, sort_keys=False)
            self.inferencer = hpsv3.HPSv3RewardInferencer(config_path=cfg_path, checkpoint_path=str(ckpt),
                                                          device=self.device)
        finally:
            os.unlink(cfg_path)
        self.model = self.inferencer.model

    def _score(self, images, prompts):
        r = self.inferencer.reward(list(images), list(prompts))
        return r[:, 0] if r.ndim == 2 else r  # mu of (mu, sigma)

    @property
    def info(self) -> dict:
        return {
            "name": self.name,
            "backend": f"hpsv3 package (HPSv3RewardInferencer, Qwen2-VL, {self.dtype})",
            "base_model": self.base_model,
            "device": self.device,
            "higher_is_better": True,
            "preprocessing": (
                "qwen_vl_utils: resize to 256*28*28 = 200,704 pixels (min=max); HPSv3 instruction prompt"
            ),
            "scale": "mu of the predicted (mu, sigma) (column 0); FLUX.1-dev ~10-11",
        }


def load_backend(name: str, spec: dict) -> Backend:
    """Build the backend for canonical scorer `name` from a plain-JSON `spec` (paths as strings)."""
    spec = dict(spec)
    device = spec.pop("device", "auto")
    if name in ("clip", "pickscore"):
        return ClipBackend(name, spec["weights"], spec.get("processor"), device=device,
                           dtype=spec.get("dtype", "float32"), multiplier=spec.get("multiplier", 1.0))
    if name in ("hpsv2", "hpsv2.1"):
        return HPSv2Backend(name, spec["weights"], device=device, model_config=spec.get("model_config"))
    if name == "imagereward":
        return ImageRewardBackend(name, spec["weights"], med_config=spec.get("med_config"),
                                  tokenizer=spec.get("tokenizer"), device=device)
    if name == "hpsv3":
        return HPSv3Backend(name, spec["weights"], base_model=spec.get("processor"), device=device,
                            config_dir=spec.get("config_dir"))
    raise SpecError(f"unknown scorer {name!r} (known: {', '.join(PACKAGES)})")


def check(name: str) -> list[str]:
    """What stops `name` from loading here, before any weights are read: the package imports, and the
    files the packages expect besides the weights (hpsv2's BPE vocabulary, ImageReward's bert tokenizer)."""
    if name not in PACKAGES:
        return [f"unknown scorer {name!r}"]
    try:
        import_package(name)
    except SpecError as e:
        return [str(e)]
    except Exception as e:  # a package that fails at import for another reason
        return [f"scorer {name!r}: importing `{PACKAGES[name][0]}` failed: {type(e).__name__}: {e}"]
    problems = []
    if name.startswith("hpsv2"):
        try:
            importlib.import_module("hpsv2.src.open_clip")
        except FileNotFoundError as e:
            problems.append(_HPSV2_VOCAB_HINT.format(err=e))
    if name == "imagereward":
        problem = bert_tokenizer_problem()
        if problem:
            problems.append(problem)
    return problems

"""GenEval's models: the detector backends and the CLIP colour classifier behind the rules of
`chunkgrpo.eval.geneval`, and how the evaluate stage builds and checks them from its config.

- `MMDetDetector`: the official mmdet 2.x Mask2Former Swin-S COCO checkpoint (evaluation image only).
- `TransformersMask2FormerDetector`: any transformers Mask2Former instance checkpoint, post-processed
  like mmdet (`mask_to_box` = mmdet's mask2bbox); not comparable with published numbers.
- `ClipColorClassifier` (+ `color_crops`, the official ImageCrops): zero-shot CLIP ViT-L/14 colours.
- `build_models(cfg, detector, color_fn)`: what the config names (`geneval_detector` = mmdet |
  transformers | a module:attr factory needing no weights, e.g. the toy world's exact detector;
  `geneval_color_model` or a `geneval_color_fn` factory), unless the caller passed them in.
- `check_color_classifier(cfg)`, `color_info(color_fn)`: fail before generation; is it the official one?

The rules (`geneval.py`) stay numpy-only; these need torch / transformers / mmdet (imported lazily).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from PIL import Image, ImageOps

from chunkgrpo.errors import UserError
from chunkgrpo.eval.config import EvalConfig
from chunkgrpo.eval.geneval import (
    COLOR_TEMPLATES,
    COLORS,
    OFFICIAL_MMDET_MODEL,
    Detection,
    Detections,
    GenEvalRules,
    load_object_names,
)
from chunkgrpo.eval.scorer_setup import clip_published_check
from chunkgrpo.scoring.backends import resolve_device

# --------------------------------------------------------------------------------------------------
# colour classification (CLIP zero-shot over the masked object on grey, cropped to its box)


def color_crops(image: Image.Image, detections: Sequence[Detection], bgcolor: str = "#999",
                crop: bool = True) -> list[Image.Image]:
    """The official ImageCrops: composite the image over a flat `bgcolor` using the object's mask,
    then crop to the box (PIL rounds float boxes)."""
    image = image.convert("RGB")
    blank = image.copy() if bgcolor == "original" else Image.new("RGB", image.size, color=bgcolor)
    out = []
    for det in detections:
        im = image
        if det.mask is not None:
            mask = np.asarray(det.mask)
            if tuple(mask.shape) != (image.size[1], image.size[0]):
                raise ValueError(
                    f"mask shape {mask.shape} != image size (H, W) {(image.size[1], image.size[0])}"
                )
            im = Image.composite(image, blank, Image.fromarray(mask.astype(bool)))
        if crop:
            im = im.crop(tuple(det.box[:4]))
        out.append(im)
    return out


class ClipColorClassifier:
    """Zero-shot colour classifier (the official uses open_clip ViT-L-14 "openai"; the same weights are
    `openai/clip-vit-large-patch14` in transformers format). Per class a head is built from the 3
    templates (normalised text embeddings averaged and renormalised, as clip_benchmark does);
    a crop's colour is the argmax. Usable as `color_fn`."""

    def __init__(self, model_dir: str | os.PathLike, *, device: str = "auto", dtype: str = "float32",
                 rules: GenEvalRules | None = None, batch_size: int = 16) -> None:
        from chunkgrpo.scoring.scorers import ClipScorer
        from chunkgrpo.scoring.weights import resolve_weights

        path = resolve_weights(model_dir, what="geneval colour CLIP")
        self._clip = ClipScorer(path, device=device, dtype=dtype, batch_size=batch_size)
        # open_clip / torchvision transform rounding, as in the official evaluator
        self._clip.preprocess = dataclasses.replace(self._clip.preprocess, crop_rounding="round")
        self.rules = rules or GenEvalRules()
        self.batch_size = batch_size
        self._heads: dict[str, Any] = {}
        self.info = {"color_model": str(model_dir), "color_preprocessing": self._clip.preprocess.describe(),
                     "color_templates": list(COLOR_TEMPLATES), "bgcolor": self.rules.bgcolor}

    def head(self, class_name: str):
        import torch

        if class_name not in self._heads:
            with torch.inference_mode():
                rows = []
                for c in COLORS:
                    emb = self._clip.embed_text([t.format(c=c, cls=class_name) for t in COLOR_TEMPLATES])
                    mean = emb.mean(0)
                    rows.append(mean / mean.norm())
            self._heads[class_name] = torch.stack(rows, dim=1)  # (dim, 10)
        return self._heads[class_name]

    def __call__(self, image: Image.Image | None, detections: list[Detection], class_name: str) -> list[str]:
        import torch

        if image is None:
            raise UserError("colour classification needs the image")
        crops = color_crops(image, detections, self.rules.bgcolor, self.rules.crop)
        head = self.head(class_name)
        out: list[str] = []
        with torch.inference_mode():
            for i in range(0, len(crops), self.batch_size):
                feats = self._clip.embed_images(crops[i : i + self.batch_size])
                out += [COLORS[j] for j in (100.0 * feats @ head).argmax(1).tolist()]
        return out


# --------------------------------------------------------------------------------------------------
# detector backends


def mask_to_box(mask: np.ndarray) -> tuple[float, float, float, float]:
    """mmdet's mask2bbox: (first x, first y, last x + 1, last y + 1); zeros for an empty mask."""
    xs = np.flatnonzero(mask.any(axis=0))
    ys = np.flatnonzero(mask.any(axis=1))
    if len(xs) == 0 or len(ys) == 0:
        return (0.0, 0.0, 0.0, 0.0)
    return (float(xs[0]), float(ys[0]), float(xs[-1] + 1), float(ys[-1] + 1))


def _load_pil(image: Image.Image | str | os.PathLike) -> Image.Image:
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    return ImageOps.exif_transpose(Image.open(image)).convert("RGB")


class TransformersMask2FormerDetector:
    """Mask2Former instance segmentation via `transformers` (no mmdet/mmcv), from a local folder.

    Post-processing follows mmdet's Mask2Former `instance_postprocess`: mask logits resized (bilinear) to the
    processed input, cropped to the unpadded region, resized (bilinear) to the original image;
    top-`max_per_image` (query, class) pairs by softmax score; mask = logit > 0; score = class prob x mean
    mask prob inside the mask; box from the mask. The checkpoint differs from the official one: NOT
    comparable with published GenEval."""

    name = "transformers-mask2former"
    comparable_to_official = False

    def __init__(self, model_dir: str | os.PathLike, *, class_names: Sequence[str] | None = None,
                 device: str = "auto", max_per_image: int = 100, min_score: float = 0.0) -> None:
        from chunkgrpo.scoring.backends import offline
        from chunkgrpo.scoring.weights import resolve_weights

        offline()
        import torch
        from transformers import Mask2FormerForUniversalSegmentation

        try:
            from transformers import Mask2FormerImageProcessorPil as _Proc
        except ImportError:  # older transformers
            from transformers import Mask2FormerImageProcessor as _Proc
        path = resolve_weights(model_dir, what="geneval transformers Mask2Former")
        self.device = resolve_device(device)
        try:
            self.model = Mask2FormerForUniversalSegmentation.from_pretrained(str(path), local_files_only=True)
            self.processor = _Proc.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as e:
            raise UserError(f"cannot load a transformers Mask2Former from {str(path)!r}: {e}") from None
        self.model.eval().requires_grad_(False).to(self.device)
        self.class_names = list(class_names) if class_names is not None else load_object_names()
        n_labels = int(self.model.config.num_labels)
        if n_labels != len(self.class_names):
            raise UserError(
                f"{path}: the model has {n_labels} labels but {len(self.class_names)} class names were "
                "given; GenEval needs an 80-class COCO instance model (labels in COCO order)"
            )
        self.max_per_image = max_per_image
        self.min_score = min_score
        self.info = {"detector_weights": str(model_dir), "max_per_image": max_per_image}
        self._torch = torch

    def detect(self, image: Image.Image | str | os.PathLike) -> Detections:
        torch = self._torch
        F = torch.nn.functional
        pil = _load_pil(image)
        w, h = pil.size
        inputs = self.processor(images=[pil], return_tensors="pt")
        pixel_values = inputs["pixel_values"].to(self.device)
        with torch.inference_mode():
            out = self.model(pixel_values=pixel_values)
        cls_logits = out.class_queries_logits[0].float()  # (Q, C+1)
        mask_logits = out.masks_queries_logits[0].float()  # (Q, h', w')
        ph, pw = pixel_values.shape[-2:]
        if "pixel_mask" in inputs:
            valid = inputs["pixel_mask"][0].bool()
            vh, vw = int(valid.any(1).sum()), int(valid.any(0).sum())
        else:
            vh, vw = ph, pw
        masks = F.interpolate(mask_logits[None], size=(ph, pw), mode="bilinear", align_corners=False)[0]
        masks = masks[:, :vh, :vw]
        masks = F.interpolate(masks[None], size=(h, w), mode="bilinear", align_corners=False)[0]
        n_classes = cls_logits.shape[-1] - 1
        scores = cls_logits.softmax(-1)[:, :-1]
        k = min(self.max_per_image, scores.numel())
        top_scores, top_idx = scores.flatten().topk(k, sorted=False)
        labels = (top_idx % n_classes).tolist()
        queries = torch.div(top_idx, n_classes, rounding_mode="floor")
        sel = masks[queries]
        binary = sel > 0
        mask_scores = (sel.sigmoid() * binary).flatten(1).sum(1) / (binary.flatten(1).sum(1) + 1e-6)
        det_scores = (top_scores * mask_scores).tolist()
        binary_np = binary.cpu().numpy()
        result: Detections = {}
        for j, (label, score) in enumerate(zip(labels, det_scores)):
            if score < self.min_score:
                continue
            m = binary_np[j]
            result.setdefault(self.class_names[label], []).append(Detection(mask_to_box(m), float(score), m))
        return result


class MMDetDetector:
    """The official GenEval detector: mmdet 2.x `init_detector`/`inference_detector` with the Mask2Former
    Swin-S COCO instance checkpoint. Only in the evaluation image (mmdet 2.x + compiled mmcv-full 1.7.x)."""

    name = "mmdet-mask2former-swin-s"
    comparable_to_official = True

    def __init__(self, checkpoint: str | os.PathLike, *, config: str | os.PathLike | None = None,
                 class_names: Sequence[str] | None = None, device: str = "cuda") -> None:
        from chunkgrpo.scoring.scorers import require_package
        from chunkgrpo.scoring.weights import resolve_weights

        mmdet = require_package("mmdet", "geneval (mmdet detector)", "mmdet==2.28.2 mmcv-full==1.7.1")
        apis = require_package("mmdet.apis", "geneval (mmdet detector)", "mmdet==2.28.2 mmcv-full==1.7.1")
        ckpt = resolve_weights(checkpoint, what="geneval mmdet checkpoint")
        if ckpt.is_dir():
            ckpt = ckpt / f"{OFFICIAL_MMDET_MODEL}.pth"
        if not ckpt.is_file():
            raise UserError(f"geneval mmdet checkpoint {str(ckpt)!r} not found")
        if config is None:
            base = Path(mmdet.__file__).parent
            rel = Path("configs") / "mask2former" / f"{OFFICIAL_MMDET_MODEL}.py"
            candidates = [base / ".mim" / rel, base.parent / rel]
            config = next((c for c in candidates if c.exists()), None)
            if config is None:
                raise UserError(
                    f"mmdet config {rel} not found (tried {', '.join(map(str, candidates))}); pass config="
                )
        self._inference = apis.inference_detector
        self.model = apis.init_detector(str(config), str(ckpt), device=device)
        self.class_names = list(class_names) if class_names is not None else load_object_names()
        self.info = {"detector_weights": str(checkpoint), "detector_config": str(config)}

    def detect(self, image: Image.Image | str | os.PathLike) -> Detections:
        # the official evaluator passes the file path (mmcv reads it as BGR); arrays must be BGR too
        arg = (
            str(image)
            if not isinstance(image, Image.Image)
            else np.asarray(image.convert("RGB"))[:, :, ::-1].copy()
        )
        result = self._inference(self.model, arg)
        bbox = result[0] if isinstance(result, tuple) else result
        segm = result[1] if isinstance(result, tuple) and len(result) > 1 else None
        out: Detections = {}
        for index, cls in enumerate(self.class_names):
            arr = np.asarray(bbox[index])
            dets = [
                Detection(tuple(float(v) for v in arr[j, :4]), float(arr[j, 4]),
                          None if segm is None else np.asarray(segm[index][j]))
                for j in range(arr.shape[0])
            ]
            if dets:
                out[cls] = dets
        return out


# --------------------------------------------------------------------------------------------------
# built from the evaluate stage's config


def named(spec: str) -> Any:
    """The object a "module:attr" name points at (e.g. "chunkgrpo.toy.detector:ToyDetector")."""
    module, _, attr = spec.partition(":")
    try:
        obj: Any = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise UserError(f"{spec!r} does not name an importable object: {e}") from None
    return obj


def check_color_classifier(cfg: EvalConfig):
    """Load the colour classifier and classify one synthetic crop: bad weights fail here, not after
    generation."""
    try:
        clf = ClipColorClassifier(cfg.geneval_color_model, device=cfg.scorer_device)
        probe = Image.new("RGB", (32, 32), (200, 30, 30))
        mask = np.ones((32, 32), bool)
        colors = clf(probe, [Detection((0.0, 0.0, 32.0, 32.0), 1.0, mask)], "car")
    except UserError as e:
        raise UserError(f"geneval colour classifier {cfg.geneval_color_model!r}: {e}") from None
    except Exception as e:
        raise UserError(f"geneval colour classifier {cfg.geneval_color_model!r} does not run: "
                        f"{type(e).__name__}: {e}") from None
    if len(colors) != 1 or colors[0] not in COLORS:
        raise UserError(
            f"geneval colour classifier {cfg.geneval_color_model!r} returned {colors!r} for one crop"
        )
    return clf


def build_models(cfg: EvalConfig, detector=None, color_fn=None) -> tuple[Any, Any]:
    """(detector, color_fn) for scoring: the ones passed in, else what the config names."""
    if detector is None and cfg.named_detector():
        detector = named(cfg.geneval_detector)()
        if color_fn is None and cfg.geneval_color_fn:
            color_fn = named(cfg.geneval_color_fn)()
    if detector is None:
        if not cfg.geneval_detector_weights:
            raise UserError("geneval needs detector weights: set geneval_detector_weights=PATH "
                            "(or generate_only=true to score later)")
        if cfg.geneval_detector == "mmdet":
            detector = MMDetDetector(cfg.geneval_detector_weights, config=cfg.geneval_detector_config or None,
                                     device=resolve_device(cfg.scorer_device))
        else:
            detector = TransformersMask2FormerDetector(cfg.geneval_detector_weights, device=cfg.scorer_device)
    if color_fn is None and cfg.geneval_color_model:
        color_fn = ClipColorClassifier(cfg.geneval_color_model, device=cfg.scorer_device)
    return detector, color_fn


def color_info(color_fn) -> dict:
    """What the colour classifier is, and whether it is the official CLIP ViT-L/14."""
    if color_fn is None:
        return {"name": None, "comparable_to_official": False, "note": "no colour classifier"}
    info = dict(getattr(color_fn, "info", {}) or {})
    clip = getattr(getattr(color_fn, "_clip", None), "model", None)
    why = clip_published_check(clip, "vit-l-14") if clip is not None else "not inspectable (custom color_fn)"
    info.update({"name": type(color_fn).__name__, "comparable_to_official": why is None})
    if why:
        info["note"] = f"colour classifier {why}"
    return info

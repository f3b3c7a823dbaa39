"""The exact toy-world detector: connected components over the known palette.

`ToyDetector` implements `chunkgrpo.eval.geneval.Detector`, so the project's own GenEval rules
(`filter_detections`, `evaluate_detections`, `summarize`) score toy images unchanged:

1. every pixel gets the nearest of {background} ∪ palette in RGB; it is an object pixel of colour c
   when c is nearest and closer than `max_distance` (60: blends of a colour with the background or
   with another colour fall outside every palette colour's radius instead of becoming a third colour);
2. connected components (8-neighbourhood) per colour; components without a full 2×2 block of pixels
   (1-px slivers such as blurred edges) or smaller than `min_area` pixels are dropped;
3. each component → a `Detection` (box from the mask in mmdet's convention, the mask, score 1.0)
   under the class `classify_shape(mask)`.

`ToyColorClassifier` is the matching `color_fn`: the majority palette colour under each mask.
On rendered scenes both recover the generator's ground truth exactly (tests/unit/toy).
"""

from __future__ import annotations

import os

import numpy as np
from PIL import Image

from chunkgrpo.eval.geneval import Detection, Detections, GenEvalRules, score_detections
from chunkgrpo.eval.geneval_models import mask_to_box
from chunkgrpo.toy.world import BACKGROUND, COLORS, PALETTE, classify_shape

_REFS = np.array([BACKGROUND, *PALETTE.values()], dtype=np.float32)  # index 0 = background


def _array(image) -> np.ndarray:
    if isinstance(image, np.ndarray):
        return image[..., :3]
    if not isinstance(image, Image.Image):
        with Image.open(image) as im:
            image = im.convert("RGB")
    return np.asarray(image.convert("RGB"))


def color_labels(img: np.ndarray, max_distance: float = 60.0) -> np.ndarray:
    """(H, W) int: 0 = background / unknown, 1 + i = PALETTE colour i."""
    d = np.linalg.norm(img.astype(np.float32)[:, :, None, :] - _REFS[None, None], axis=-1)
    lab = d.argmin(-1)
    lab[d.min(-1) > max_distance] = 0
    return lab


def components(mask: np.ndarray) -> list[np.ndarray]:
    """8-connected components of a boolean mask, in raster order of their first pixel."""
    h, w = mask.shape
    seen = np.zeros_like(mask, bool)
    out = []
    for y0, x0 in zip(*np.nonzero(mask)):
        if seen[y0, x0]:
            continue
        comp = np.zeros_like(mask, bool)
        stack = [(y0, x0)]
        seen[y0, x0] = True
        while stack:
            y, x = stack.pop()
            comp[y, x] = True
            for dy in (-1, 0, 1):
                for dx in (-1, 0, 1):
                    yy, xx = y + dy, x + dx
                    if 0 <= yy < h and 0 <= xx < w and mask[yy, xx] and not seen[yy, xx]:
                        seen[yy, xx] = True
                        stack.append((yy, xx))
        out.append(comp)
    return out


def has_block(mask: np.ndarray, k: int = 2) -> bool:
    """Does `mask` contain a full k×k block of pixels (i.e. is it more than a 1-px sliver)?"""
    h, w = mask.shape
    core = mask[: h - k + 1, : w - k + 1].copy()
    for dy in range(k):
        for dx in range(k):
            core &= mask[dy:h - k + 1 + dy, dx:w - k + 1 + dx]
    return bool(core.any())


class ToyDetector:
    """Exact detector for toy-world images (see the module docstring)."""

    name = "toy-exact"
    comparable_to_official = False

    def __init__(self, *, max_distance: float = 60.0, min_area: int = 6) -> None:
        self.max_distance, self.min_area = max_distance, min_area
        self.info = {"detector": "connected components over the toy palette", "max_distance": max_distance,
                     "min_area": min_area}

    def detect(self, image: Image.Image | str | os.PathLike | np.ndarray) -> Detections:
        lab = color_labels(_array(image), self.max_distance)
        out: Detections = {}
        for ci in np.unique(lab):
            if ci == 0:
                continue
            for comp in components(lab == ci):
                if comp.sum() < self.min_area or not has_block(comp):
                    continue
                out.setdefault(classify_shape(comp), []).append(Detection(mask_to_box(comp), 1.0, comp))
        return out


class ToyColorClassifier:
    """`color_fn` for the GenEval rules: the majority palette colour under each detection's mask."""

    def __init__(self, max_distance: float = 60.0) -> None:
        self.max_distance = max_distance
        self.info = {"color_model": "toy palette (majority colour under the mask)"}

    def __call__(self, image, detections: list[Detection], class_name: str) -> list[str]:
        lab = color_labels(_array(image), self.max_distance)
        out = []
        for det in detections:
            if det.mask is not None:
                vals = lab[np.asarray(det.mask, bool)]
            else:
                x0, y0, x1, y1 = (int(round(v)) for v in det.box)
                vals = lab[y0:y1, x0:x1].ravel()
            vals = vals[vals > 0]
            out.append(COLORS[int(np.bincount(vals).argmax()) - 1] if vals.size else "white")
        return out


def score(image, md: dict, detector: ToyDetector | None = None, color_fn: ToyColorClassifier | None = None,
          rules: GenEvalRules | None = None) -> dict:
    """GenEval record (correct, reason, ...) of one toy image for one prompt's metadata."""
    det = detector or ToyDetector()
    img = _array(image)
    return score_detections(
        det.detect(img), md, Image.fromarray(img), color_fn or ToyColorClassifier(), rules
    )


def _judge(image, md: dict, detector: ToyDetector | None, color_fn: ToyColorClassifier):
    """(all detections, detections kept by the category's rules, PIL image, correct by the rules)."""
    from chunkgrpo.eval.geneval import evaluate_detections, filter_detections

    img = _array(image)
    pil = Image.fromarray(img)
    detections = (detector or ToyDetector()).detect(img)
    detected = filter_detections(detections, md["tag"])
    return detections, detected, pil, evaluate_detections(detected, md, pil, color_fn)[0]


def partial_credit(image, md: dict, detector: ToyDetector | None = None,
                   color_fn: ToyColorClassifier | None = None) -> float:
    """Dense credit in [0, 1]; 1.0 iff the image is correct by the official rules, else < 1:
    counting prompts: 1 − |found − n| / n (found = detections of the class above the threshold);
    others: the fraction of include clauses satisfied on their own (class, count, colour; a position
    clause together with its target), capped at 0.99."""
    from chunkgrpo.eval.geneval import evaluate_detections

    cf = color_fn or ToyColorClassifier()
    _, detected, pil, correct = _judge(image, md, detector, cf)
    if correct:
        return 1.0
    inc = md["include"]
    if md["tag"] == "counting":
        n = int(inc[0]["count"])
        found = len(detected.get(inc[0]["class"], []))
        return min(max(0.0, 1.0 - abs(found - n) / n), 0.99)
    good = 0
    for req in inc:
        if "position" in req:
            target = {k: v for k, v in inc[req["position"][1]].items() if k != "position"}
            sub = [target, {**req, "position": [req["position"][0], 0]}]
        else:
            sub = [req]
        ok, _ = evaluate_detections(detected, {"tag": md["tag"], "include": sub}, pil, cf)
        good += int(ok)
    return min(good / len(inc), 0.99)


def shape_similarity(mask: np.ndarray, shape: str) -> float:
    """IoU of a component's mask with the world's template of `shape` (its one size, `SHAPE_SIZES`) centred
    on the component's box: 1.0 for a perfectly drawn `shape`, lower the further the blob is from it."""
    from chunkgrpo.toy.world import CELL, SHAPE_SIZES, shape_mask

    ys, xs = np.nonzero(mask)
    if ys.size == 0:
        return 0.0
    w, h = SHAPE_SIZES[shape][0]
    tmpl = np.kron(shape_mask(shape, w, h), np.ones((CELL, CELL), bool))
    th, tw = tmpl.shape
    cy = int(round((ys.min() + ys.max() + 1 - th) / 2))
    cx = int(round((xs.min() + xs.max() + 1 - tw) / 2))
    H, W = mask.shape
    placed = np.zeros(
        (H + 2 * th, W + 2 * tw), bool
    )  # padded: a template reaching past the border is clipped
    placed[cy + th:cy + 2 * th, cx + tw:cx + 2 * tw] = tmpl
    placed = placed[th:th + H, tw:tw + W]
    union = (placed | mask).sum()
    return float((placed & mask).sum() / union) if union else 0.0


def graded_credit(image, md: dict, detector: ToyDetector | None = None,
                  color_fn: ToyColorClassifier | None = None) -> float:
    """Dense credit in [0, 1] that grows continuously as an image approaches its caption; 1.0 iff the image
    is correct by the official rules, else at most 0.99 (the `toy_geneval` reward with `dense: graded`).

    Every connected component over the palette counts (whatever class the detector gives it):
      clause {class, colour?}   best over components of shape_similarity(component, class)
                                × (1 if no colour is asked or the component has it, else 0.5);
      position clause           that, × (1 if the relation holds to the target clause's best component,
                                else 0.5);
      counting {class, n}       0.75 (1 − |found − n| / n) + 0.25 × the mean similarity of the n most
                                similar components (found: detections of the class, as the rules count);
    the credit is the mean over the include clauses. The detector's class decision is a threshold on the
    same shape features, so a blob that becomes more like the asked shape earns more before it flips."""
    from chunkgrpo.eval.geneval import relative_position

    cf = color_fn or ToyColorClassifier()
    detections, detected, pil, correct = _judge(image, md, detector, cf)
    if correct:
        return 1.0
    comps = [d for ds in detections.values() for d in ds]
    colors = cf(pil, comps, "") if comps else []
    inc = md["include"]
    if md["tag"] == "counting":
        n, cls = int(inc[0]["count"]), inc[0]["class"]
        found = len(detected.get(cls, []))
        sims = sorted((shape_similarity(d.mask, cls) for d in comps), reverse=True)[:n]
        credit = 0.75 * max(0.0, 1.0 - abs(found - n) / n) + 0.25 * (sum(sims) / n)
        return min(credit, 0.99)

    def quality(i: int, req: dict) -> float:
        q = shape_similarity(comps[i].mask, req["class"])
        if req.get("color") and colors[i] != req["color"]:
            q *= 0.5
        return q

    total = 0.0
    for req in inc:
        if not comps:
            break
        scores = [quality(i, req) for i in range(len(comps))]
        if "position" in req:
            rel, t = req["position"][0], int(req["position"][1])
            target_scores = [quality(j, inc[t]) for j in range(len(comps))]
            best = 0.0
            for i in range(len(comps)):
                others = [j for j in range(len(comps)) if j != i]
                if not others:
                    best = max(best, 0.5 * scores[i])
                    continue
                j = max(others, key=lambda k: target_scores[k])
                ok = rel in relative_position(comps[i].box, comps[j].box, 0.1)
                best = max(best, scores[i] * (1.0 if ok else 0.5))
            total += best
        else:
            total += max(scores)
    return min(total / len(inc), 0.99)

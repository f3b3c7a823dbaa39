"""GenEval (Ghosh et al. 2023, djghosh13/geneval @ af4902f): layout, detectors, exact scoring rules, summary.

Pipeline:
1. `load_metadata()` - the 553 prompts (`evaluation_metadata.jsonl`: tag, prompt, include, exclude).
2. Generation (part B) follows `generation_plan(...)`: 4 images per prompt written as the official
   layout `<root>/<index:05d>/metadata.jsonl` (one JSON object) + `<root>/<index:05d>/samples/<k:05d>.png`
   (the official generator writes `f"{k:05}.png"`; the evaluator scores every file whose name *starts* with
   digits + `.png` - `re.match`, so `00009.png.bak` is scored too - and we do the same, see `iter_samples`).
3. A `Detector` returns per-class detections (box, score, mask). Backends (`chunkgrpo.eval.geneval_models`):
   - `MMDetDetector`: the official mmdet 2.x Mask2Former Swin-S COCO checkpoint (evaluation image only);
     results are comparable with published GenEval numbers.
   - `TransformersMask2FormerDetector`: any transformers Mask2Former instance checkpoint (e.g.
     facebook/mask2former-swin-small-coco-instance), post-processed like mmdet. A different checkpoint:
     its results carry `comparable_to_official=False`.
4. `filter_detections` + `evaluate_detections` apply the official rules (pure functions, numpy only):
   confidence > 0.3 (> 0.9 for `counting`), sorted by score, at most 16 per class, no NMS (max_overlap 1.0);
   parity to the last tie: the official `np.argsort(scores)[::-1]` order (numpy's classic introsort, so
   of two equal scores the later detection comes first), thresholds compared in float32, and
   `relative_position` computed in float32 (see `official_order`, `relative_position`);
   include clauses AND-ed, exclude clauses OR-ed; `found = detected[class][:count]`; colour by a
   classifier over the mask composited on #999 grey, cropped to the box; position with margin
   0.1 x (box sizes); counting is exact through the `exclude {count: n+1}` clause.
5. `summarize(records)`: per-task mean of `correct` over images; overall = unweighted mean of the 6 tasks.
6. The evaluate stage's use of it: `score_stage` (every label's folder -> records + summaries) and
   `comparability_notes` (why a run is not comparable with published numbers).

Size note: one room (~620 lines) on purpose: the layout, the rules and the summary are one protocol pinned to
the official evaluator (parity tests read them together); the models behind the rules live in
`geneval_models`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Callable, Iterator, Protocol, Sequence, runtime_checkable

import numpy as np
from PIL import Image, ImageOps

from chunkgrpo.config import Config, option
from chunkgrpo.errors import UserError
from chunkgrpo.eval import data_file

TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
RELATIONS = ("left of", "right of", "above", "below")
COLOR_TEMPLATES = ("a photo of a {c} {cls}", "a photo of a {c}-colored {cls}", "a photo of a {c} object")
N_SAMPLES = 4
DEFAULT_SEED = 42
METADATA_FILE = "geneval/evaluation_metadata.jsonl"
OBJECT_NAMES_FILE = "geneval/object_names.txt"
OFFICIAL_MMDET_MODEL = "mask2former_swin-s-p4-w7-224_lsj_8x2_50e_coco"
_SAMPLE_RE = re.compile(r"\d+\.png")
FILE_DISCOVERY = ("official: all-digit folder names; sample files whose name starts with digits + '.png' "
                  "(re.match(r'\\d+\\.png', name), so e.g. 00009.png.bak is scored); other files ignored")


# --------------------------------------------------------------------------------------------------
# metadata


def load_metadata(path: str | os.PathLike | None = None) -> list[dict]:
    """The GenEval prompt metadata (one dict per prompt, file order = prompt index)."""
    path = data_file(METADATA_FILE, path, what="GenEval metadata (evaluation_metadata.jsonl)")
    out = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            md = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{lineno}: invalid JSON: {e}") from None
        validate_metadata(md, where=f"{path}:{lineno}")
        out.append(md)
    if not out:
        raise UserError(f"{path}: no prompts")
    return out


def validate_metadata(md: dict, where: str = "metadata") -> None:
    for key in ("tag", "prompt", "include"):
        if key not in md:
            raise UserError(f"{where}: missing {key!r}")
    if md["tag"] not in TAGS:
        raise UserError(f"{where}: unknown tag {md['tag']!r} (known: {', '.join(TAGS)})")
    includes = md["include"]
    for i, req in enumerate(list(includes) + list(md.get("exclude", []))):
        if "class" not in req or "count" not in req:
            raise UserError(f"{where}: clause {req!r} needs 'class' and 'count'")
        if "color" in req and req["color"] not in COLORS:
            raise UserError(f"{where}: colour {req['color']!r} is not one of {', '.join(COLORS)}")
        if "position" in req:
            rel, target = req["position"]
            if rel not in RELATIONS:
                raise UserError(f"{where}: relation {rel!r} is not one of {', '.join(RELATIONS)}")
            if not (isinstance(target, int) and 0 <= target < min(i, len(includes))):
                raise UserError(f"{where}: position target {target!r} must index an earlier include clause")


def load_object_names(path: str | os.PathLike | None = None) -> list[str]:
    """The 80 COCO class names in detector label order (natural spellings, e.g. "tv remote")."""
    path = data_file(OBJECT_NAMES_FILE, path, what="GenEval object_names.txt")
    names = [ln.strip() for ln in path.read_text().splitlines() if ln.strip()]
    if len(names) != 80:
        raise UserError(f"{path}: expected 80 COCO class names, found {len(names)}")
    return names


# --------------------------------------------------------------------------------------------------
# generation layout


@dataclasses.dataclass(frozen=True)
class GenEvalJob:
    """One image to generate: prompt `index` (metadata line), sample `k`, its seed and output path."""

    index: int
    sample: int
    prompt: str
    seed: int
    path: Path
    tag: str


def prompt_dir(root: str | os.PathLike, index: int) -> Path:
    return Path(root) / f"{index:05d}"


def sample_path(root: str | os.PathLike, index: int, k: int) -> Path:
    return prompt_dir(root, index) / "samples" / f"{k:05d}.png"


def sample_seed(index: int, k: int, base_seed: int = DEFAULT_SEED) -> int:
    """Seed of sample k of prompt `index`: `base_seed + k`, independent of the prompt, mirroring the official
    generator, which re-seeds with the same seed before every prompt (so sample k of every prompt starts
    from the same noise). Per-image seeds make the result independent of batching and sharding."""
    del index
    return base_seed + k


def generation_plan(metadata: Sequence[dict], root: str | os.PathLike, n_samples: int = N_SAMPLES,
                    base_seed: int = DEFAULT_SEED) -> list[GenEvalJob]:
    """All images to generate (`len(metadata) * n_samples`, default 553 x 4 = 2,212)."""
    if n_samples < 1:
        raise UserError(f"n_samples={n_samples} must be >= 1 (official GenEval: 4)")
    return [
        GenEvalJob(i, k, md["prompt"], sample_seed(i, k, base_seed), sample_path(root, i, k), md["tag"])
        for i, md in enumerate(metadata)
        for k in range(n_samples)
    ]


def write_layout(metadata: Sequence[dict], root: str | os.PathLike) -> Path:
    """Create `<root>/<index:05d>/samples/` and each `metadata.jsonl` (json.dump of the prompt's metadata)."""
    root = Path(root)
    for i, md in enumerate(metadata):
        d = prompt_dir(root, i)
        (d / "samples").mkdir(parents=True, exist_ok=True)
        with open(d / "metadata.jsonl", "w") as fp:
            json.dump(md, fp)
    return root


def iter_samples(root: str | os.PathLike) -> Iterator[tuple[Path, dict]]:
    """(image path, metadata) for every sample, with the official discovery rules: all-digit folder names,
    a `metadata.jsonl` in each, sample files whose name *starts with* `<digits>.png` (`re.match`, as the
    official `evaluate_images.py`: `00009.png.bak` is scored, `grid.png` and JPEGs are not)."""
    root = Path(root)
    if not root.is_dir():
        raise UserError(f"GenEval image folder {str(root)!r} does not exist")
    for sub in sorted(p for p in root.iterdir() if p.is_dir() and p.name.isdigit()):
        md_path = sub / "metadata.jsonl"
        if not md_path.exists():
            raise UserError(f"{sub}: missing metadata.jsonl (see chunkgrpo.eval.geneval.write_layout)")
        with open(md_path) as fp:
            md = json.load(fp)
        samples = sub / "samples"
        if not samples.is_dir():
            continue
        for img in sorted(samples.iterdir()):
            if img.is_file() and _SAMPLE_RE.match(img.name):
                yield img, md


def unusual_sample_names(root: str | os.PathLike) -> list[str]:
    """Files the official discovery scores although they are not plain `<digits>.png` (e.g. `00009.png.bak`),
    relative to `root`: listed in metrics.json so a stray copy that was scored is visible."""
    root = Path(root)
    return [str(p.relative_to(root)) for p, _ in iter_samples(root) if not _SAMPLE_RE.fullmatch(p.name)]


# --------------------------------------------------------------------------------------------------
# detections and rules


@dataclasses.dataclass
class Detection:
    """One detected object: box (x1, y1, x2, y2) in pixels, confidence, optional boolean mask (H, W)."""

    box: tuple[float, float, float, float]
    score: float
    mask: np.ndarray | None = None

    def as_list(self) -> list[float]:
        return [float(v) for v in self.box] + [float(self.score)]


Detections = dict[str, list[Detection]]
ColorFn = Callable[[Image.Image | None, list[Detection], str], list[str]]
"""`color_fn(image, detections, class_name) -> one colour name (of COLORS) per detection`."""


@runtime_checkable
class Detector(Protocol):
    name: str
    comparable_to_official: bool

    def detect(self, image: Image.Image | str | os.PathLike) -> Detections:
        """All detections per class name (any order, unthresholded or thresholded below 0.3)."""
        ...


@dataclasses.dataclass
class GenEvalRules(Config):
    """The official evaluator's options (`evaluate_images.py --options`); defaults are the official ones."""

    threshold: float = option(0.3, "confidence threshold (detections kept if score > threshold)")
    counting_threshold: float = option(0.9, "confidence threshold for the `counting` task")
    max_objects: int = option(16, "keep at most this many detections per class (most confident first)")
    max_overlap: float = option(1.0, "NMS IoU threshold; 1.0 = no NMS (official)")
    position_threshold: float = option(0.1, "position margin as a fraction of the two box sizes")
    bgcolor: str = option("#999", "background the object mask is composited on for colour classification")
    crop: bool = option(True, "crop the colour-classification image to the object's box")

    def __post_init__(self) -> None:
        for name in ("threshold", "counting_threshold"):
            v = getattr(self, name)
            if not 0.0 <= v < 1.0:
                raise UserError(f"geneval {name}={v} must be in [0, 1)")
        if self.max_objects < 1:
            raise UserError(f"geneval max_objects={self.max_objects} must be >= 1")
        if not 0.0 < self.max_overlap <= 1.0:
            raise UserError(f"geneval max_overlap={self.max_overlap} must be in (0, 1]")
        if self.position_threshold < 0:
            raise UserError(f"geneval position_threshold={self.position_threshold} must be >= 0")

    @property
    def is_official(self) -> bool:
        return self == GenEvalRules()


def compute_iou(box_a: Sequence[float], box_b: Sequence[float]) -> float:
    """The official IoU (inclusive pixel convention, +1)."""
    def area(b):
        return max(b[2] - b[0] + 1, 0) * max(b[3] - b[1] + 1, 0)

    inter = area(
        [max(box_a[0], box_b[0]), max(box_a[1], box_b[1]), min(box_a[2], box_b[2]), min(box_a[3], box_b[3])]
    )
    union = area(box_a) + area(box_b) - inter
    return inter / union if union else 0.0


def _less(a: float, b: float) -> bool:
    """numpy's float ordering (NaN sorts last)."""
    return a < b or (b != b and a == a)


def _heapsort_indices(v: Sequence[float], idx: list[int], lo: int, n: int) -> None:
    """Heapsort of idx[lo:lo+n] by v (numpy's introsort fallback when quicksort recursion gets too deep)."""
    def get(k: int) -> int:
        return idx[lo + k - 1]

    def put(k: int, x: int) -> None:
        idx[lo + k - 1] = x

    def sift(i: int, tmp: int, n: int) -> None:
        j = 2 * i
        while j <= n:
            if j < n and _less(v[get(j)], v[get(j + 1)]):
                j += 1
            if not _less(v[tmp], v[get(j)]):
                break
            put(i, get(j))
            i, j = j, 2 * j
        put(i, tmp)

    for start in range(n >> 1, 0, -1):
        sift(start, get(start), n)
    while n > 1:
        tmp = get(n)
        put(n, get(1))
        n -= 1
        sift(1, tmp, n)


def classic_argsort(values: Sequence[float] | np.ndarray) -> np.ndarray:
    """`np.argsort(values)` (ascending) exactly as numpy's classic introsort orders it, ties included.

    The official evaluator ran on numpy < 1.25, whose argsort is an introsort: median-of-3 quicksort
    partitions down to 16 elements, then insertion sort (stable), heapsort past depth 2*log2(n). Modern numpy
    dispatches to SIMD sorts (AVX2 / AVX-512) that order equal scores differently on different CPUs, so
    calling `np.argsort` here would neither reproduce the published numbers' tie-breaking nor be the same on
    every machine. Values are compared as float32 (mmdet's score dtype)."""
    v = [float(x) for x in np.asarray(values, dtype=np.float32).ravel()]
    idx = list(range(len(v)))
    if len(v) < 2:
        return np.asarray(idx, dtype=np.intp)
    small = 15  # numpy's SMALL_QUICKSORT: partitions with more than 16 elements are split
    pl, pr = 0, len(v) - 1
    depth = (len(v).bit_length() - 1) * 2
    stack: list[tuple[int, int, int]] = []
    while True:
        if depth < 0:
            _heapsort_indices(v, idx, pl, pr - pl + 1)
        else:
            while pr - pl > small:
                pm = pl + ((pr - pl) >> 1)  # median of three -> pivot at pr - 1
                if _less(v[idx[pm]], v[idx[pl]]):
                    idx[pm], idx[pl] = idx[pl], idx[pm]
                if _less(v[idx[pr]], v[idx[pm]]):
                    idx[pr], idx[pm] = idx[pm], idx[pr]
                if _less(v[idx[pm]], v[idx[pl]]):
                    idx[pm], idx[pl] = idx[pl], idx[pm]
                pivot = v[idx[pm]]
                pi, pj = pl, pr - 1
                idx[pm], idx[pj] = idx[pj], idx[pm]
                while True:
                    pi += 1
                    while _less(v[idx[pi]], pivot):
                        pi += 1
                    pj -= 1
                    while _less(pivot, v[idx[pj]]):
                        pj -= 1
                    if pi >= pj:
                        break
                    idx[pi], idx[pj] = idx[pj], idx[pi]
                idx[pi], idx[pr - 1] = idx[pr - 1], idx[pi]
                depth -= 1
                if pi - pl < pr - pi:  # keep the smaller side, push the larger one
                    stack.append((pi + 1, pr, depth))
                    pr = pi - 1
                else:
                    stack.append((pl, pi - 1, depth))
                    pl = pi + 1
            for i in range(pl + 1, pr + 1):  # insertion sort (stable)
                vi = idx[i]
                j = i
                while j > pl and _less(v[vi], v[idx[j - 1]]):
                    idx[j] = idx[j - 1]
                    j -= 1
                idx[j] = vi
        if not stack:
            break
        pl, pr, depth = stack.pop()
    return np.asarray(idx, dtype=np.intp)


def official_order(scores: Sequence[float] | np.ndarray) -> np.ndarray:
    """The official ranking `np.argsort(scores)[::-1]`: most confident first; of equal scores the LATER
    detection comes first (for up to 16 detections; beyond that, as numpy's introsort leaves them)."""
    return classic_argsort(scores)[::-1]


def filter_detections(raw: Detections, tag: str, rules: GenEvalRules | None = None) -> Detections:
    """Per class, as the official evaluator: rank by `np.argsort(scores)[::-1]` (`official_order`), keep
    score > threshold compared in float32 (0.9 for counting; a score of exactly float32(0.3) is dropped), at
    most `max_objects`, optional NMS (off by default). Classes left empty are dropped."""
    rules = rules or GenEvalRules()
    thr = np.float32(rules.counting_threshold if tag == "counting" else rules.threshold)
    out: Detections = {}
    for cls, dets in raw.items():
        dets = list(dets)
        if not dets:
            continue
        scores = np.asarray([d.score for d in dets], dtype=np.float32)
        ordering = official_order(scores)
        ordering = ordering[scores[ordering] > thr][: rules.max_objects].tolist()
        kept = []
        while ordering:
            best = ordering.pop(0)
            kept.append(dets[best])
            if rules.max_overlap < 1:
                ordering = [
                    j for j in ordering if compute_iou(dets[best].box, dets[j].box) < rules.max_overlap
                ]
        if kept:
            out[cls] = kept
    return out


def relative_position(box_a: Sequence[float], box_b: Sequence[float], margin: float = 0.1) -> set[str]:
    """Relations of A relative to B (image y axis points down), in float32 like the official (its boxes are
    mmdet's float32 arrays): centre offset shrunk by margin x (size_a + size_b) per axis; none if both shrunk
    offsets are < 1e-3; otherwise the shrunk offset over |raw offset| must pass 0.5 on an axis.
    The norm is sqrt(ox^2 + oy^2) with each operation rounded to float32 (the official's BLAS dot may fuse
    the multiply-add; the two can differ in the last bit only)."""
    f32 = np.float32
    boxes = np.array([list(box_a)[:4], list(box_b)[:4]], dtype=f32).reshape(2, 2, 2)
    center_a, center_b = boxes.mean(axis=-2, dtype=f32)
    dim_a, dim_b = np.abs(np.diff(boxes, axis=-2))[..., 0, :]
    offset = center_a - center_b
    # revised = max(|offset| - margin (d_a + d_b), 0) sign(offset)   (GenEval position rule)
    revised = np.maximum(np.abs(offset) - f32(margin) * (dim_a + dim_b), f32(0)) * np.sign(offset)
    if np.all(np.abs(revised) < f32(1e-3)):
        return set()
    norm = np.sqrt(f32(offset[0] * offset[0]) + f32(offset[1] * offset[1]))
    dx, dy = revised / norm
    rels = set()
    if dx < -0.5:
        rels.add("left of")
    if dx > 0.5:
        rels.add("right of")
    if dy < -0.5:
        rels.add("above")
    if dy > 0.5:
        rels.add("below")
    return rels


def evaluate_detections(
    detected: Detections,
    metadata: dict,
    image: Image.Image | None = None,
    color_fn: ColorFn | None = None,
    rules: GenEvalRules | None = None,
) -> tuple[bool, str]:
    """The official `evaluate()`: include clauses AND-ed, exclude clauses OR-ed; returns (correct, reason).

    `detected` must already be filtered (`filter_detections`), most confident first. Colour and position are
    checked only on the `count` most confident objects of a class; a clause failing its colour check does not
    become a position target."""
    rules = rules or GenEvalRules()
    correct = True
    reason: list[str] = []
    matched_groups: list[list[Detection] | None] = []
    for req in metadata.get("include", []):
        cls, count = req["class"], int(req["count"])
        matched = True
        found = detected.get(cls, [])[:count]
        if len(found) < count:
            correct = matched = False
            reason.append(f"expected {cls}>={count}, found {len(found)}")
        else:
            if "color" in req:
                if color_fn is None:
                    raise UserError("this prompt has a colour clause: pass a colour classifier (color_fn)")
                colors = list(color_fn(image, found, cls))
                if len(colors) != len(found):
                    raise RuntimeError(
                        f"colour classifier returned {len(colors)} colours for {len(found)} objects"
                    )
                want = req["color"]
                if colors.count(want) < count:
                    correct = matched = False
                    reason.append(
                        f"expected {want} {cls}>={count}, found {colors.count(want)} {want}; and "
                        + ", ".join(f"{colors.count(c)} {c}" for c in COLORS if c in colors)
                    )
            if "position" in req and matched:
                expected_rel, target_group = req["position"]
                if target_group >= len(matched_groups) or matched_groups[target_group] is None:
                    correct = matched = False
                    reason.append(f"no target for {cls} to be {expected_rel}")
                else:
                    for obj in found:
                        for target in matched_groups[target_group]:
                            true_rels = relative_position(obj.box, target.box, rules.position_threshold)
                            if expected_rel not in true_rels:
                                correct = matched = False
                                reason.append(
                                    f"expected {cls} {expected_rel} target, "
                                    f"found {' and '.join(sorted(true_rels))} target"
                                )
                                break
                        if not matched:
                            break
        matched_groups.append(found if matched else None)
    for req in metadata.get("exclude", []):
        cls, count = req["class"], int(req["count"])
        if len(detected.get(cls, [])) >= count:
            correct = False
            reason.append(f"expected {cls}<{count}, found {len(detected[cls])}")
    return correct, "\n".join(reason)


def score_detections(raw: Detections, metadata: dict, image: Image.Image | None = None,
                     color_fn: ColorFn | None = None, rules: GenEvalRules | None = None) -> dict:
    """Filter raw detections and evaluate: a record like the official results.jsonl line (no filename)."""
    detected = filter_detections(raw, metadata["tag"], rules)
    correct, reason = evaluate_detections(detected, metadata, image, color_fn, rules)
    return {
        "tag": metadata["tag"],
        "prompt": metadata["prompt"],
        "correct": bool(correct),
        "reason": reason,
        "metadata": json.dumps(metadata),
        "details": json.dumps({k: [d.as_list() for d in v] for k, v in detected.items()}),
    }


def score_image(image: Image.Image | str | os.PathLike, metadata: dict, detector: Detector,
                color_fn: ColorFn | None = None, rules: GenEvalRules | None = None) -> dict:
    """Detect + apply the rules to one image (PIL image or path)."""
    filename = None
    if not isinstance(image, Image.Image):
        filename = str(image)
        raw = detector.detect(filename)
        pil = ImageOps.exif_transpose(Image.open(filename))
    else:
        raw = detector.detect(image)
        pil = image
    record = score_detections(raw, metadata, pil, color_fn, rules)
    record["filename"] = filename
    return record


def evaluate_folder(
    root: str | os.PathLike,
    detector: Detector,
    color_fn: ColorFn | None = None,
    rules: GenEvalRules | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[dict]:
    """Score every sample under `root` (official layout); one record per image."""
    records = []
    for i, (path, md) in enumerate(iter_samples(root)):
        records.append(score_image(path, md, detector, color_fn, rules))
        if progress:
            progress(i + 1)
    if not records:
        raise UserError(f"no GenEval samples found under {str(root)!r} (<index:05d>/samples/<k>.png)")
    return records


def summarize(records: Sequence[dict], detector: Detector | dict | None = None,
              rules: GenEvalRules | None = None) -> dict:
    """Per-task accuracy (mean of `correct` over images), overall = unweighted mean of the task means,
    plus % correct images / prompts (a prompt is correct if any of its images is). `complete` is False
    unless all 6 tasks are present; `comparable_to_official` needs the official detector and rules."""
    if not records:
        raise UserError("no GenEval records to summarise")
    rules = rules or GenEvalRules()
    tasks: dict[str, dict] = {}
    by_prompt: dict[str, bool] = {}
    for r in records:
        t = tasks.setdefault(r["tag"], {"correct": 0, "total": 0})
        t["correct"] += int(bool(r["correct"]))
        t["total"] += 1
        by_prompt[r["metadata"]] = by_prompt.get(r["metadata"], False) or bool(r["correct"])
    ordered = {tag: tasks[tag] for tag in TAGS if tag in tasks}
    ordered.update({tag: v for tag, v in tasks.items() if tag not in ordered})
    for v in ordered.values():
        v["score"] = v["correct"] / v["total"]
    if isinstance(detector, dict):
        det_info = dict(detector)
    elif detector is not None:
        det_info = {"name": detector.name, "comparable_to_official": bool(detector.comparable_to_official)}
        det_info.update(getattr(detector, "info", {}) or {})
    else:
        det_info = {"name": "unknown", "comparable_to_official": False}
    complete = all(tag in tasks for tag in TAGS)
    return {
        "benchmark": "geneval",
        "overall": float(np.mean([v["score"] for v in ordered.values()])),
        "tasks": ordered,
        "n_images": len(records),
        "n_prompts": len(by_prompt),
        "correct_images": sum(int(bool(r["correct"])) for r in records) / len(records),
        "correct_prompts": sum(by_prompt.values()) / len(by_prompt),
        "complete": complete,
        "detector": det_info,
        "rules": dataclasses.asdict(rules),
        "comparable_to_official": bool(det_info.get("comparable_to_official"))
        and rules.is_official
        and complete,
    }


# --------------------------------------------------------------------------------------------------
# the evaluate stage


def color_clauses(metadata: Sequence[dict]) -> int:
    """How many prompts have a colour clause (they need a colour classifier; the official 553 have 194)."""
    return sum(1 for md in metadata if any("color" in c for c in md.get("include", [])))


def score_stage(out: Path, labels: Sequence[str], detector: Detector, color_fn: ColorFn | None,
                color_info: dict, ctx: dict) -> dict:
    """Detect and score `<out>/geneval/<label>/` for every label; writes its `results.jsonl` (file names
    relative to `out`). Returns {"results": {label: summary}, "records": {label: [record per image]}}."""
    n_expected = ctx["n_prompts"] * ctx["samples_per_prompt"]
    results, records = {}, {}
    for lb in labels:
        root = out / "geneval" / lb
        recs = evaluate_folder(root, detector, color_fn)
        for r in recs:
            try:
                r["filename"] = str(Path(r["filename"]).relative_to(out))
            except (TypeError, ValueError):
                pass
        with open(root / "results.jsonl", "w") as fp:
            for r in recs:
                fp.write(json.dumps(r) + "\n")
        res = summarize(recs, detector)
        res["color_classifier"] = color_info
        res["n_expected_images"] = n_expected
        res["file_discovery"] = FILE_DISCOVERY
        res["unusual_files"] = unusual_sample_names(root)
        results[lb] = res
        records[lb] = recs
    return {"results": results, "records": records}


def comparability_notes(ctx: dict, results: dict, samples_per_prompt: int) -> list[str]:
    """Why these GenEval results are not comparable with published numbers (empty: they are): all 553
    prompts x 4 images, the official detector, rules and colour classifier, all 6 tasks."""
    notes = []
    official_rules = dataclasses.asdict(GenEvalRules())
    if ctx["n_prompts"] != ctx["n_all"] or ctx["n_all"] != 553:
        notes.append(f"{ctx['n_prompts']} of 553 prompts")
    if samples_per_prompt != 4:
        notes.append(f"{samples_per_prompt} samples per prompt (official: 4)")
    for lb, r in results.items():
        if r.get("n_images", 0) < r.get("n_expected_images", 0):
            notes.append(f"[{lb}] {r['n_expected_images'] - r['n_images']} of {r['n_expected_images']} "
                         "images missing")
        if not (r.get("detector") or {}).get("comparable_to_official"):
            notes.append(f"detector {(r.get('detector') or {}).get('name')} is not the official mmdet "
                         "Mask2Former Swin-S checkpoint")
        if not r.get("complete"):
            notes.append(f"[{lb}] not all 6 GenEval tasks evaluated")
        if r.get("rules") and r["rules"] != official_rules:
            notes.append("scoring rules differ from the official options")
        color = r.get("color_classifier") or {}
        if not color.get("comparable_to_official"):
            notes.append(color.get("note") or "colour classifier is not CLIP ViT-L/14 (openai)")
    return notes

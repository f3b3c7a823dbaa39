"""The toy world: captioned scenes of flat-coloured shapes on a white background, with exact ground truth.

Six shapes × eight colours on a 16×16 grid of cells, rendered at 32×32 pixels (each cell a 2×2 block:
the world is pixel art, which keeps the generative problem small enough to learn in minutes on a CPU).
Every caption is a GenEval prompt in one of the six GenEval categories, and every scene comes with the
GenEval metadata of its caption (`include` / `exclude` clauses) and the exact box, mask, shape and
colour of every object:

    single_object  a photo of a circle                          include [{circle, 1}]
    two_object     a photo of a circle and a square             include [{circle, 1}, {square, 1}]
    counting       a photo of three circles                     include [{circle, 3}]  exclude [{circle, 4}]
    colors         a photo of a red circle                      include [{circle, 1, red}]
    position       a photo of a circle left of a square         include [{square, 1}, {circle, 1, left of 0}]
    color_attr     a photo of a red circle and a blue square    include [{circle, 1, red}, {square, 1, blue}]

Scenes hold exactly the objects their caption names (colours not named are drawn from the palette);
objects never touch (≥ `GAP` cells apart), so connected components recover them exactly. Each shape has
one size, and boxes start on even cells (`ALIGN`), i.e. on the transformer's 2×2-cell latent tokens: a
shape is always the same few token patterns, which is what lets a small model learn the world in
minutes (measured: aligned, one size → held-out accuracy 0.21 after 3000 steps; any cell, two sizes →
0.12 with the same training). Position
scenes satisfy the relation with a clear margin under GenEval's own rule (`relative_position`).

Split (`World.split`, deterministic from the world seed): held-out prompts combine attributes that
never appear together in any training prompt — colour–shape pairs (one per colour), unordered shape
pairs (three of fifteen) and (count, shape) pairs (one per shape). Single-object prompts have
nothing to combine and appear in both sets (the in-distribution control).
"""

from __future__ import annotations

import json
import os
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from chunkgrpo.errors import UserError

SIZE = 32  # pixels
CELL = 2  # pixels per grid cell
GAP = 1  # min empty cells between two objects' boxes
ALIGN = 2  # object boxes start on multiples of this many cells (one latent token = 2×2 cells)
BACKGROUND = (255, 255, 255)
SHAPES = ("circle", "square", "triangle", "cross", "bar", "column")
PLURALS = {
    "circle": "circles",
    "square": "squares",
    "triangle": "triangles",
    "cross": "crosses",
    "bar": "bars",
    "column": "columns",
}
# colour names are a subset of GenEval's colour vocabulary; RGB chosen far apart
# (min pairwise distance checked in tests)
PALETTE = {
    "red": (220, 20, 30),
    "orange": (250, 140, 0),
    "yellow": (235, 215, 0),
    "green": (20, 150, 40),
    "blue": (20, 60, 230),
    "purple": (130, 30, 170),
    "pink": (250, 100, 200),
    "brown": (110, 60, 20),
}
COLORS = tuple(PALETTE)
NUMBERS = ("one", "two", "three", "four")
RELATIONS = ("left of", "right of", "above", "below")
TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
# box size (w, h) in cells of each shape: one size per shape keeps the generative problem small
SHAPE_SIZES = {
    "circle": [(5, 5)],
    "square": [(4, 4)],
    "triangle": [(5, 4)],
    "cross": [(5, 5)],
    "bar": [(6, 2)],
    "column": [(2, 6)],
}
POSITION_MARGIN = 0.1  # GenEval's position threshold (fraction of the two box sizes)


# --------------------------------------------------------------------------------------------------
# shapes


def shape_mask(shape: str, w: int, h: int) -> np.ndarray:
    """(h, w) bool mask of `shape` filling a w×h box of cells (every row and column non-empty)."""
    yy, xx = np.mgrid[0:h, 0:w]
    if shape in ("square", "bar", "column"):
        m = np.ones((h, w), bool)
    elif shape == "circle":
        cx, cy = (w - 1) / 2, (h - 1) / 2
        m = ((xx - cx) / (w / 2)) ** 2 + ((yy - cy) / (h / 2)) ** 2 <= 1.0
    elif shape == "triangle":  # apex up, base at the bottom row
        half = (yy + 1) / h * (w / 2)
        m = np.abs(xx - (w - 1) / 2) <= half - 0.25
        m[:, (w - 1) // 2] = True
    elif shape == "cross":  # a plus with one-cell arms
        m = np.zeros((h, w), bool)
        m[:, w // 2] = True
        m[h // 2, :] = True
    else:
        raise UserError(f"unknown toy shape {shape!r} (known: {', '.join(SHAPES)})")
    return m


def classify_shape(mask: np.ndarray) -> str:
    """The shape class of a connected component's mask (exact on rendered shapes; best effort on
    generated ones): aspect ratio of the box, fill ratio, and bottom-vs-top width for triangle/cross."""
    ys, xs = np.nonzero(mask)
    y0, y1, x0, x1 = ys.min(), ys.max() + 1, xs.min(), xs.max() + 1
    m = mask[y0:y1, x0:x1]
    h, w = m.shape
    aspect = w / h
    if aspect >= 2.0:
        return "bar"
    if aspect <= 0.5:
        return "column"
    fill = m.sum() / (w * h)
    if fill >= 0.9:
        return "square"
    if fill >= 0.68:
        return "circle"
    q = max(1, h // 4)
    top, bottom = m[:q].sum(1).mean(), m[-q:].sum(1).mean()
    return "triangle" if bottom >= 1.8 * top else "cross"


# --------------------------------------------------------------------------------------------------
# scenes


@dataclass
class ToyObject:
    """One object: shape, colour and its box (x1, y1, x2, y2) in pixels with exclusive ends (mmdet's
    mask2bbox convention), always on the cell grid."""

    shape: str
    color: str
    box: tuple[int, int, int, int]

    @property
    def size(self) -> tuple[int, int]:
        return self.box[2] - self.box[0], self.box[3] - self.box[1]

    def mask(self, size: int = SIZE) -> np.ndarray:
        m = np.zeros((size, size), bool)
        x0, y0, x1, y1 = self.box
        cells = shape_mask(self.shape, (x1 - x0) // CELL, (y1 - y0) // CELL)
        m[y0:y1, x0:x1] = np.kron(cells, np.ones((CELL, CELL), bool))
        return m


@dataclass
class Scene:
    """A caption, its GenEval metadata and the objects that satisfy it."""

    prompt: str
    metadata: dict
    objects: list[ToyObject] = field(default_factory=list)
    size: int = SIZE

    def render(self) -> np.ndarray:
        """(size, size, 3) uint8 image."""
        img = np.empty((self.size, self.size, 3), np.uint8)
        img[:] = BACKGROUND
        for o in self.objects:
            img[o.mask(self.size)] = PALETTE[o.color]
        return img

    def image(self):
        from PIL import Image

        return Image.fromarray(self.render())


# --------------------------------------------------------------------------------------------------
# captions <-> metadata


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _np(color: str | None, shape: str) -> str:
    words = f"{color} {shape}" if color else shape
    return f"{article(words)} {words}"


def caption(tag: str, **a) -> str:
    """The caption of a prompt of category `tag` (GenEval wording)."""
    if tag == "single_object":
        return f"a photo of {_np(None, a['shape'])}"
    if tag == "two_object":
        return f"a photo of {_np(None, a['shapes'][0])} and {_np(None, a['shapes'][1])}"
    if tag == "counting":
        n = a["count"]
        return f"a photo of {NUMBERS[n - 1]} {a['shape'] if n == 1 else PLURALS[a['shape']]}"
    if tag == "colors":
        return f"a photo of {_np(a['color'], a['shape'])}"
    if tag == "position":
        return f"a photo of {_np(None, a['shapes'][0])} {a['relation']} {_np(None, a['shapes'][1])}"
    if tag == "color_attr":
        (c1, s1), (c2, s2) = a["pairs"]
        return f"a photo of {_np(c1, s1)} and {_np(c2, s2)}"
    raise UserError(f"unknown toy category {tag!r} (known: {', '.join(TAGS)})")


def metadata(tag: str, **a) -> dict:
    """GenEval metadata (tag, prompt, include, exclude) of a toy prompt."""
    md: dict = {"tag": tag, "prompt": caption(tag, **a)}
    if tag == "single_object":
        md["include"] = [{"class": a["shape"], "count": 1}]
    elif tag == "two_object":
        md["include"] = [{"class": s, "count": 1} for s in a["shapes"]]
    elif tag == "counting":
        md["include"] = [{"class": a["shape"], "count": a["count"]}]
        md["exclude"] = [{"class": a["shape"], "count": a["count"] + 1}]
    elif tag == "colors":
        md["include"] = [{"class": a["shape"], "count": 1, "color": a["color"]}]
    elif tag == "position":
        subject, target = a["shapes"]
        md["include"] = [
            {"class": target, "count": 1},
            {"class": subject, "count": 1, "position": [a["relation"], 0]},
        ]
    elif tag == "color_attr":
        md["include"] = [{"class": s, "count": 1, "color": c} for c, s in a["pairs"]]
    return md


_SHAPE_RE = "|".join(SHAPES)
_PLURAL_RE = "|".join(PLURALS.values())
_COLOR_RE = "|".join(COLORS)
_REL_RE = "|".join(RELATIONS)
_NP = rf"an? (?:({_COLOR_RE}) )?({_SHAPE_RE})"
_PATTERNS = [
    ("counting", re.compile(rf"a photo of ({'|'.join(NUMBERS)}) ({_SHAPE_RE}|{_PLURAL_RE})")),
    ("position", re.compile(rf"a photo of an? ({_SHAPE_RE}) ({_REL_RE}) an? ({_SHAPE_RE})")),
    ("two", re.compile(rf"a photo of {_NP} and {_NP}")),
    ("one", re.compile(rf"a photo of {_NP}")),
]


def parse_caption(prompt: str) -> dict:
    """GenEval metadata of a toy caption (the inverse of `caption`); UserError for anything else."""
    text = " ".join(prompt.strip().lower().split())
    for kind, pat in _PATTERNS:
        m = pat.fullmatch(text)
        if not m:
            continue
        if kind == "counting":
            n = NUMBERS.index(m.group(1)) + 1
            word = m.group(2)
            shape = next(s for s, p in PLURALS.items() if word in (s, p))
            if (n == 1) != (word == shape):
                break
            md = metadata("counting", shape=shape, count=n)
        elif kind == "position":
            md = metadata("position", shapes=(m.group(1), m.group(3)), relation=m.group(2))
        elif kind == "two":
            c1, s1, c2, s2 = m.groups()
            if (c1 is None) != (c2 is None) or s1 == s2:
                break
            md = (metadata("two_object", shapes=(s1, s2)) if c1 is None
                  else metadata("color_attr", pairs=((c1, s1), (c2, s2))))
        else:
            c, s = m.groups()
            md = metadata("single_object", shape=s) if c is None else metadata("colors", color=c, shape=s)
        if md["prompt"] == text:
            return md
        break
    raise UserError(f"{prompt!r} is not a toy-world caption (e.g. 'a photo of a red circle'; "
                    f"shapes: {', '.join(SHAPES)}; colours: {', '.join(COLORS)})")


# --------------------------------------------------------------------------------------------------
# the split


@dataclass(frozen=True)
class Split:
    """Held-out attribute combinations (they never appear together in a training prompt)."""

    color_shape: frozenset  # {(colour, shape)}
    shape_pairs: frozenset  # {frozenset({shape, shape})}
    count_shape: frozenset  # {(n, shape)}

    def is_held_out(self, md: dict) -> bool:
        """Does this prompt combine attributes held out of training? (single-object prompts: no.)"""
        inc = md["include"]
        tag = md["tag"]
        if tag == "counting":
            return (inc[0]["count"], inc[0]["class"]) in self.count_shape
        if any((c.get("color"), c["class"]) in self.color_shape for c in inc if "color" in c):
            return True
        if len(inc) == 2 and frozenset(c["class"] for c in inc) in self.shape_pairs:
            return True
        return False

    def to_dict(self) -> dict:
        return {"color_shape": sorted(map(list, self.color_shape)),
                "shape_pairs": sorted(sorted(p) for p in self.shape_pairs),
                "count_shape": sorted(map(list, self.count_shape))}


def all_prompts() -> dict[str, list[dict]]:
    """Every caption of the world, per category, as GenEval metadata (a fixed order)."""
    out: dict[str, list[dict]] = {t: [] for t in TAGS}
    pairs = [(a, b) for a in SHAPES for b in SHAPES if a != b]
    out["single_object"] = [metadata("single_object", shape=s) for s in SHAPES]
    out["two_object"] = [metadata("two_object", shapes=p) for p in pairs]
    out["counting"] = [metadata("counting", shape=s, count=n) for n in range(1, 5) for s in SHAPES]
    out["colors"] = [metadata("colors", color=c, shape=s) for c in COLORS for s in SHAPES]
    out["position"] = [metadata("position", shapes=p, relation=r) for p in pairs for r in RELATIONS]
    out["color_attr"] = [metadata("color_attr", pairs=((c1, s1), (c2, s2)))
                         for s1, s2 in pairs for c1 in COLORS for c2 in COLORS]
    return out


class World:
    """Deterministic from `seed`: the split, the prompt sets and every scene."""

    def __init__(self, seed: int = 0, size: int = SIZE):
        if size < 24 or size % CELL:
            raise UserError(
                f"toy world size={size} must be a multiple of {CELL} and >= 24 px (four objects must fit)"
            )
        self.seed, self.size = seed, size
        self.grid = size // CELL
        rng = random.Random(f"toy-split-{seed}")
        shapes = list(SHAPES)
        rng.shuffle(shapes)
        # one held-out shape per colour, every shape held out at least once
        cs = {(c, shapes[i % len(shapes)]) for i, c in enumerate(COLORS)}
        unordered = sorted({tuple(sorted((a, b))) for a in SHAPES for b in SHAPES if a != b})
        sp = {frozenset(p) for p in rng.sample(unordered, 3)}
        cnt = {(rng.randint(2, 4), s) for s in SHAPES}
        self.split = Split(frozenset(cs), frozenset(sp), frozenset(cnt))
        self._prompts = all_prompts()

    def prompts(self, which: str) -> dict[str, list[dict]]:
        """Per category, the `train` or `heldout` prompts (single-object prompts are in both)."""
        if which not in ("train", "heldout"):
            raise UserError(f"prompt set {which!r} must be 'train' or 'heldout'")
        out = {}
        for tag, mds in self._prompts.items():
            if tag == "single_object":
                out[tag] = list(mds)
            else:
                out[tag] = [md for md in mds if self.split.is_held_out(md) == (which == "heldout")]
        return out

    def eval_prompts(self, per_category: int = 8, which: str = "heldout") -> list[dict]:
        """A fixed, category-balanced subset (at most `per_category` each), spread over each category."""
        out = []
        for tag, mds in self.prompts(which).items():
            rng = random.Random(f"toy-eval-{self.seed}-{which}-{tag}")
            pick = sorted(rng.sample(range(len(mds)), min(per_category, len(mds))))
            out += [mds[i] for i in pick]
        return out

    # ------------------------------------------------------------------ scenes
    def scene(self, md: dict, rng: np.random.Generator, *, max_tries: int = 200) -> Scene:
        """A scene that satisfies `md` (GenEval metadata of a toy caption) exactly."""
        tag, inc = md["tag"], md["include"]
        for _ in range(max_tries):
            if tag == "counting":
                specs = [(inc[0]["class"], None)] * inc[0]["count"]
            else:
                specs = [(c["class"], c.get("color")) for c in inc]
            objs = self._place(specs, rng)
            if objs is None:
                continue
            if tag == "position":
                rel = inc[1]["position"][0]
                from chunkgrpo.eval.geneval import relative_position

                target, subject = objs
                if relative_position(subject.box, target.box, POSITION_MARGIN) != {rel}:
                    continue
                # a clear margin: the relation still holds at twice GenEval's margin
                if rel not in relative_position(subject.box, target.box, 2 * POSITION_MARGIN):
                    continue
            return Scene(md["prompt"], md, objs, self.size)
        raise RuntimeError(f"could not place a scene for {md['prompt']!r} in {max_tries} tries")

    def _place(self, specs: list[tuple[str, str | None]], rng: np.random.Generator) -> list[ToyObject] | None:
        objs: list[ToyObject] = []
        cells: list[tuple[int, int, int, int]] = []
        for shape, color in specs:
            sizes = SHAPE_SIZES[shape]
            w, h = sizes[int(rng.integers(len(sizes)))]
            color = color or COLORS[int(rng.integers(len(COLORS)))]
            for _ in range(50):
                # boxes start on even cells: aligned with the transformer's 2×2-cell latent tokens
                x0 = ALIGN * int(rng.integers(0, (self.grid - w) // ALIGN + 1))
                y0 = ALIGN * int(rng.integers(0, (self.grid - h) // ALIGN + 1))
                box = (x0, y0, x0 + w, y0 + h)
                if all(_apart(box, b, GAP) for b in cells):
                    cells.append(box)
                    objs.append(ToyObject(shape, color, tuple(CELL * v for v in box)))
                    break
            else:
                return None
        return objs

    def sample(self, n: int, which: str = "train", seed: int = 0) -> list[Scene]:
        """`n` scenes of prompts from `which`, category-balanced (tags cycle), deterministic in (world,
        seed)."""
        prompts = self.prompts(which)
        rng = np.random.default_rng([self.seed, seed, 0 if which == "train" else 1])
        out = []
        for i in range(n):
            mds = prompts[TAGS[i % len(TAGS)]]
            out.append(self.scene(mds[int(rng.integers(len(mds)))], rng))
        return out


def _apart(a, b, gap: int) -> bool:
    return a[2] + gap <= b[0] or b[2] + gap <= a[0] or a[3] + gap <= b[1] or b[3] + gap <= a[1]


# --------------------------------------------------------------------------------------------------
# files


def write_metadata(mds: list[dict], path: str | os.PathLike) -> Path:
    """A GenEval `evaluation_metadata.jsonl` (one JSON object per line)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(md) + "\n" for md in mds))
    tmp.replace(path)
    return path


def write_prompts(prompts: list[str], path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(p + "\n" for p in prompts))
    tmp.replace(path)
    return path


def corpus() -> list[str]:
    """Sentences covering every word of the world (for the locally trained tokenizers)."""
    words = [caption("counting", shape=s, count=n) for n in range(1, 5) for s in SHAPES]
    words += [caption("position", shapes=(a, b), relation=r) for a, b in zip(SHAPES, SHAPES[1:] + SHAPES[:1])
              for r in RELATIONS]
    words += [
        caption("color_attr", pairs=((c, s), (c2, s2)))
        for c, c2 in zip(COLORS, COLORS[1:] + COLORS[:1])
        for s, s2 in zip(SHAPES, SHAPES[1:] + SHAPES[:1])
    ]
    words += [caption("colors", color=c, shape=s) for c in COLORS for s in SHAPES]
    return words

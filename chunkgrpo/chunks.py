"""Chunk planning: partition the trainable steps 0 … N−2 into consecutive chunks (method.md §5).

The chunk plan has one name per value, from the pipeline parameter to the loss:
* ``chunks`` — the spec string (pipeline parameter, `plan` component input, `TrainConfig.chunks`,
  `chunkgrpo plan --chunks`); `parse_chunks` is its one parser (syntax checked there, once);
* ``sizes`` — the resolved list of chunk sizes (`ChunkPlan.sizes`, checked once when a plan is made, by
  the losses' own contract `objectives.check_sizes`); `ChunkPlan.ranges` the same chunks as [start, end)
  step ranges.

Specs:
* ``dynamics`` — curvature-guided (our algorithm for the paper's recipe, App. B.1): the last chunk is
  the late steps (where an RL-trained model's profile departs from the base; default the second half,
  `last_fraction`); the early region is cut at the peaks of the profile's second difference
  (curvature) — the first cut closes the initial high-dynamics chunk; chunks longer than `max_chunk`
  are split at their strongest interior curvature (or evenly when flat). Options:
  ``dynamics:max=5,last=0.5,min=2,rel=0.1``. Needs a profile (`chunkgrpo profile`).
* ``uniform:N`` — chunks of N steps (the remainder, if any, is a smaller last chunk).
* ``sizes:2,3,4,7`` — exactly these sizes (must sum to the trainable steps).
* ``step`` — every step its own chunk (step-level GRPO); ``whole`` — one chunk (sequence level).
* ``PATH.json`` — a plan file written by `chunkgrpo plan` (its ``sizes``).

Plans are computed once before training and fixed. The plan file (plan.json) keeps its format:
``strategy`` holds the `chunks` spec it was planned with, ``sizes`` the sizes, ``chunks`` the per-chunk
table (step range, σ range, mean L1rel).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from chunkgrpo.errors import UserError
from chunkgrpo.objectives import check_sizes
from chunkgrpo.recipes import CHUNK_METHODS

SPEC_FORMS = ("dynamics", "uniform:N", "sizes:A,B,...", "step", "whole", "PLAN.json")
_DYNAMICS_KEYS = {"max": int, "last": float, "min": int, "rel": float}


@dataclass(frozen=True)
class ChunkSpec:
    """A parsed `chunks` spec (see the module docstring); made by `parse_chunks` only."""

    text: str  # the spec as given (stripped)
    kind: str  # step | whole | uniform | sizes | dynamics | file
    size: int = 0  # uniform:N
    sizes: tuple[int, ...] = ()  # sizes:A,B,...
    options: dict = field(default_factory=dict)  # dynamics: max, last, min, rel (typed)
    path: str = ""  # PLAN.json


def parse_chunks(chunks: str | ChunkSpec) -> ChunkSpec:
    """The one parser of a `chunks` spec: its syntax is checked here (numbers, option keys, chunk sizes
    >= 1); what depends on the run (the step count, a profile, the plan file's contents) when it is
    resolved by `plan_chunks`."""
    if isinstance(chunks, ChunkSpec):
        return chunks
    s = str(chunks).strip()
    if s in ("step", "whole"):
        return ChunkSpec(s, s)
    if s.endswith(".json"):
        return ChunkSpec(s, "file", path=s)
    if m := re.fullmatch(r"uniform:(\d+)", s):
        n = int(m.group(1))
        if n < 1:
            raise UserError(f"uniform chunk size must be >= 1, got {n}")
        return ChunkSpec(s, "uniform", size=n)
    if s.startswith("sizes:"):
        try:
            sizes = tuple(int(x) for x in s[len("sizes:"):].split(",") if x.strip())
        except ValueError:
            raise UserError(f"bad sizes list in {s!r} (expected e.g. sizes:2,3,4,7)") from None
        if any(x < 1 for x in sizes):
            raise UserError(f"chunk sizes must be >= 1 (empty chunk in {list(sizes)})")
        return ChunkSpec(s, "sizes", sizes=sizes)
    if s == "dynamics" or s.startswith("dynamics:"):
        return ChunkSpec(s, "dynamics", options=_parse_options(s, s[len("dynamics:"):] if ":" in s else ""))
    raise UserError(f"unknown chunk strategy {s!r} in chunks (choose one of: {', '.join(SPEC_FORMS)})")


def _parse_options(spec: str, text: str) -> dict:
    opts = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "=" not in part:
            raise UserError(f"dynamics option {part!r} must look like key=value (keys: max, last, min, rel)")
        k, v = part.split("=", 1)
        opts[k.strip()] = v.strip()
    unknown = set(opts) - set(_DYNAMICS_KEYS)
    if unknown:
        raise UserError(f"unknown dynamics option(s) {sorted(unknown)} (keys: max, last, min, rel)")
    try:
        return {k: _DYNAMICS_KEYS[k](v) for k, v in opts.items()}
    except ValueError as e:
        raise UserError(f"bad dynamics option in {spec!r}: {e}") from None


@dataclass
class ChunkPlan:
    """The chunk plan of a run: the `chunks` spec it was made from and the resolved `sizes` (checked
    here, once), with the reasons (`rationale`, `details`) for the plan file."""

    chunks: str
    sizes: list[int]
    rationale: str
    details: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.sizes = check_sizes(self.sizes)

    @property
    def trainable_steps(self) -> int:
        return sum(self.sizes)

    @cached_property
    def ranges(self) -> list[tuple[int, int]]:
        """[start, end) step range of each chunk."""
        out, a = [], 0
        for s in self.sizes:
            out.append((a, a + s))
            a += s
        return out

    def to_dict(self, profile: dict | None = None) -> dict:
        """The plan file's content (format unchanged: `strategy` is the `chunks` spec, `chunks` the table)."""
        d = {
            "strategy": self.chunks,
            "sizes": self.sizes,
            "num_steps": self.trainable_steps + 1,
            "trainable_steps": self.trainable_steps,
            "chunks": [],
            "rationale": self.rationale,
            **self.details,
        }
        for k, (a, b) in enumerate(self.ranges):
            c = {"index": k, "steps": [a, b - 1], "size": b - a}
            if profile:
                sig = profile["sigmas"]
                c.update(sigma_start=sig[a], sigma_end=sig[b],
                         mean_l1rel=sum(profile["l1rel"][a:b]) / (b - a))
            d["chunks"].append(c)
        return d


def plan_chunks(chunks: str | ChunkSpec, trainable_steps: int, l1rel: list[float] | None = None) -> ChunkPlan:
    """Resolve `chunks` over `trainable_steps` (= N − 1) steps; `l1rel` (≥ trainable_steps values) for
    dynamics."""
    S = int(trainable_steps)
    if S < 1:
        raise UserError(f"need at least one trainable step, got {S}")
    spec = parse_chunks(chunks)
    s = spec.text
    if spec.kind == "step":
        return ChunkPlan(
            s, [1] * S, "step-level: every trainable step is its own chunk (DanceGRPO/Flow-GRPO)"
        )
    if spec.kind == "whole":
        return ChunkPlan(s, [S], "sequence-level: one chunk of all trainable steps (GSPO-like)")
    if spec.kind == "uniform":
        n = spec.size
        if n > S:
            raise UserError(f"uniform chunk size {n} exceeds the {S} trainable steps")
        sizes = [n] * (S // n) + ([S % n] if S % n else [])
        return ChunkPlan(
            s, sizes, f"uniform: chunks of {n} steps" + (f", remainder {S % n} last" if S % n else "")
        )
    if spec.kind == "sizes":
        sizes = list(spec.sizes)
        if sum(sizes) != S:
            raise UserError(f"chunk sizes {sizes} sum to {sum(sizes)} but there are {S} trainable steps "
                            f"(num_steps − 1; the last transition is never trained)")
        return ChunkPlan(s, sizes, f"fixed sizes {sizes}")
    if spec.kind == "file":
        return ChunkPlan(s, load_plan(spec.path, S), f"from the plan file {spec.path}")
    opts = spec.options
    if l1rel is None:
        raise UserError("strategy 'dynamics' needs a profile (run `chunkgrpo profile`)")
    if len(l1rel) < S:
        raise UserError(f"profile has {len(l1rel)} transitions but {S} trainable steps were requested")
    return plan_dynamics(l1rel[:S], max_chunk=opts.get("max", 5), last_fraction=opts.get("last", 0.5),
                         min_chunk=opts.get("min", 2), rel_threshold=opts.get("rel", 0.1))


def training_plan(method: str, chunks: str | ChunkSpec, trainable_steps: int, *,
                  read_plan_file: bool = True) -> ChunkPlan:
    """The chunk plan a training run uses: `chunks` resolved for the chunk methods (`CHUNK_METHODS`);
    single steps for the others (`dance` is step-level GRPO; `tempflow`/`granular` train single branching
    steps and ignore `chunks`). `dynamics` needs a profile: plan it first and pass the plan file.
    `read_plan_file=False` (sizing a run before its plan exists): a plan file counts as single steps."""
    if method not in CHUNK_METHODS:
        return plan_chunks("step", trainable_steps)
    spec = parse_chunks(chunks)
    if spec.kind == "file" and not read_plan_file:
        return plan_chunks("step", trainable_steps)
    if spec.kind == "dynamics":
        raise UserError(
            "chunks=dynamics needs a profile: run `chunkgrpo profile` + `chunkgrpo plan` and pass plan.json"
        )
    return plan_chunks(spec, trainable_steps)


def _split_evenly(a: int, b: int, max_chunk: int) -> list[int]:
    n = b - a
    k = -(-n // max_chunk)
    base, extra = divmod(n, k)
    # smaller chunks first: high-noise steps get the finer granularity
    return [a + sum(base + (1 if j >= k - extra else 0) for j in range(i)) for i in range(1, k)]


def _cut_side(p: list[float], t: int) -> int:
    """Where a curvature peak at transition t cuts: the corner joins the neighbour it is closer to, so
    the boundary falls on the larger of the two jumps around it (t → a new chunk starts at t; t + 1 →
    at t + 1). A plateau that drops (0.75, 0.77, 0.54) keeps its last high step: cut at t + 1."""
    return t if abs(p[t] - p[t - 1]) >= abs(p[t + 1] - p[t]) else t + 1


def plan_dynamics(p: list[float], *, max_chunk: int = 5, last_fraction: float = 0.5, min_chunk: int = 2,
                  rel_threshold: float = 0.1) -> ChunkPlan:
    """Curvature-guided chunks over the trainable profile `p` (length S = N − 1; App. B.1).

    * last chunk: the late steps, from ⌈N·(1 − last_fraction)⌉ — the second half of the N sampling steps
      by default (N = 17: steps 9–15, 7 trainable steps; the final transition is never trained);
    * earlier cuts at the local maxima of the curvature κ_t = |p_{t−1} − 2p_t + p_{t+1}| (≥ rel_threshold of
      the largest), strongest first, at least `min_chunk` apart; the cut goes on the larger jump around
      the corner (`_cut_side`), so the first chunk is the initial high-dynamics plateau;
    * chunks longer than `max_chunk` are split at their strongest interior curvature peak, else evenly
      (smaller chunks first: high-noise steps get the finer granularity).
    On a profile shaped like the paper's (SDE dynamics: two high steps, then a smooth decay) at N = 17
    this gives the paper's [2, 3, 4, 7].
    """
    S = len(p)
    if max_chunk < 1 or min_chunk < 1:
        raise UserError(f"max/min chunk must be >= 1, got max={max_chunk}, min={min_chunk}")
    if not 0 < last_fraction < 1:
        raise UserError(f"last fraction must be in (0, 1), got {last_fraction}")
    if min_chunk > max_chunk:
        raise UserError(f"dynamics option min={min_chunk} is larger than max={max_chunk}")
    if not (math.isfinite(rel_threshold) and rel_threshold >= 0):
        raise UserError(f"dynamics option rel={rel_threshold} must be a finite number >= 0")
    if S == 1:
        return ChunkPlan("dynamics", [1], "a single trainable step")
    N = S + 1
    late_start = min(S - 1, max(1, math.ceil(N * (1 - last_fraction) - 1e-9)))
    # curvature κ_t = |p[t−1] − 2p[t] + p[t+1]| at the early transitions
    curv = {t: abs(p[t - 1] - 2 * p[t] + p[t + 1]) for t in range(1, min(late_start, S - 1))}
    kmax = max(curv.values(), default=0.0)
    peaks = [t for t, c in curv.items()
             if kmax > 0 and c >= rel_threshold * kmax
             and c >= curv.get(t - 1, 0.0) and c > curv.get(t + 1, 0.0)]
    cut_at = {t: _cut_side(p, t) for t in peaks}
    cuts: list[int] = []
    used: list[int] = []
    for t in sorted(peaks, key=lambda t: -curv[t]):  # strongest curvature first
        c = cut_at[t]
        bounds = sorted([0, late_start, *cuts])
        if all(abs(c - b) >= min_chunk for b in bounds):
            cuts.append(c)
            used.append(t)
    cuts.sort()
    # split early chunks longer than max_chunk: at their strongest interior curvature peak, else evenly
    bounds = [0, *cuts, late_start]
    split_notes = []
    changed = True
    while changed:
        changed = False
        for a, b in zip(bounds, bounds[1:]):
            if b - a > max_chunk:
                inner = [t for t in peaks if a + min_chunk <= cut_at[t] <= b - min_chunk]
                if inner:
                    t = max(inner, key=lambda t: curv[t])
                    new = [cut_at[t]]
                    split_notes.append(f"split {a}–{b - 1} at curvature peak {t}")
                else:
                    new = _split_evenly(a, b, max_chunk)
                    split_notes.append(f"split {a}–{b - 1} evenly (no interior curvature peak)")
                bounds = sorted(set(bounds) | set(new))
                changed = True
                break
    bounds.append(S)
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    first = sizes[0]
    why = [
        f"first chunk = steps 0–{first - 1}, the initial steps (L1rel {p[0]:.4g}→{p[first - 1]:.4g}), "
        "closed at the first curvature cut",
        "cuts at curvature peaks (second difference of L1rel): "
        + (
            ", ".join(f"step {cut_at[t]} (peak at {t}, κ={curv[t]:.3g})" for t in sorted(used))
            or "none above threshold"
        ),
        f"last chunk = steps {late_start}–{S - 1}: the late steps, "
        f"the last {last_fraction:g} of the {N} sampling "
        "steps (pre-observation of where a trained model departs from the base, method.md §5)",
        f"early chunks kept <= {max_chunk} steps" + (f" ({'; '.join(split_notes)})" if split_notes else ""),
    ]
    return ChunkPlan("dynamics", check_sizes(sizes, S), "; ".join(why), details={
        "curvature": {str(t): c for t, c in curv.items()}, "curvature_peaks": sorted(peaks), "cuts": cuts,
        "late_start": late_start, "options": {"max_chunk": max_chunk, "last_fraction": last_fraction,
                                              "min_chunk": min_chunk, "rel_threshold": rel_threshold}})


def write_plan(plan_dict: dict, out: str | Path) -> Path:
    from chunkgrpo.inputs import check_output_file

    out = Path(out)
    if out.is_dir():
        raise UserError(f"plan output {out} is a directory; give a file name (e.g. {out / 'plan.json'})")
    check_output_file(out, "plan output")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    try:
        tmp.write_text(json.dumps(plan_dict, indent=2))
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def load_plan(path: str | Path, trainable_steps: int | None = None) -> list[int]:
    """Chunk sizes from a plan JSON, checked against the trainable step count."""
    from chunkgrpo.inputs import read_text

    path = Path(path)
    if not path.exists():
        raise UserError(f"chunk plan {path} does not exist (run `chunkgrpo plan` first)")
    try:
        sizes = json.loads(read_text(path, "chunk plan"))["sizes"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise UserError(f"chunk plan {path} is not a plan JSON with a 'sizes' list") from None
    if not isinstance(sizes, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in sizes):
        raise UserError(f"chunk plan {path}: 'sizes' must be a list of integers, got {str(sizes)[:80]}")
    if trainable_steps is not None and sum(sizes) != trainable_steps:
        raise UserError(f"chunk plan {path} has sizes {sizes} (sum {sum(sizes)}) but the run has "
                        f"{trainable_steps} trainable steps (num_steps − 1)")
    return check_sizes(sizes, trainable_steps)


def plan_from_profile(profile_path: str | Path, chunks: str, out: str | Path, plot: bool = True,
                      trajectories: str | None = None) -> tuple[dict, Path]:
    """Load a profile, plan over its N−1 trainable steps on its SDE or ODE curve (`trajectories`, default
    the profile's own choice), write the plan JSON (+ PNG of both curves with the chunks)."""
    from chunkgrpo.dynamics import load_profile, plot_profile, select_trajectories
    from chunkgrpo.inputs import check_output_file

    if Path(out).is_dir():
        raise UserError(f"plan output {out} is a directory; give a file name "
                        f"(e.g. {Path(out) / 'plan.json'})")
    check_output_file(out, "plan output")
    if plot:
        check_output_file(Path(out).with_suffix(".png"), "plan plot")
    profile = load_profile(profile_path)
    curve, kind = select_trajectories(profile, trajectories)
    trainable = len(curve) - 1
    plan = plan_chunks(chunks, trainable, curve)
    d = plan.to_dict({**profile, "l1rel": curve})
    d["profile"] = str(profile_path)
    d["trajectories"] = kind
    path = write_plan(d, out)
    if plot:
        plot_profile(profile, Path(out).with_suffix(".png"), plan=d)
    return d, path

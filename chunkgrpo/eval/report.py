"""A self-contained HTML evaluation report: one file, inline CSS and SVG plots, thumbnails embedded as
base64 JPEG, no scripts and no external references - it works as a KFP HTML artifact, an MLflow
artifact or an e-mail attachment.

Contents
- models, sampling, generation;
- a summary table of every trained − base delta with its paired bootstrap CI, win rate (+ CI) and n;
  a delta whose CI contains 0 is rendered neutral (grey), only a CI entirely above / below 0 is
  green / red (`chunkgrpo.eval.stats.significance`);
- per benchmark: bars of the deltas with CI whiskers, histograms of the per-image (per-prompt) scores
  (`chunkgrpo.eval.plots`, inline SVG),
  base vs trained, the scorer / detector / judge information and why the numbers are (not) comparable;
- image rows chosen by the largest changes in both directions (half the rows the largest
  improvements, half the largest regressions) rather than the first prompts: HPDv2 with per-image
  scores; GenEval with the detected boxes drawn on every sample and the failure reason; WISE with the
  judge's sub-scores (consistency, realism, aesthetic quality), WiScore and the judge's answer.

The page is the Jinja2 template `templates/report.html.j2` (autoescaped; the stylesheet, the cells and the
three benchmark sections, which share one `section` macro); this module reads the evaluation's results into
the values the template shows, chooses the image rows and draws the thumbnails. The SVG plots and the
statistics live in `plots` and `stats`.
"""

from __future__ import annotations

import base64
import datetime as _dt
import functools
import io
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
from markupsafe import Markup

from chunkgrpo.eval.plots import cell_significance, finite, svg_delta_bars, svg_histogram
from chunkgrpo.eval.stats import geneval_prompt_pairs

TEMPLATE, CELLS = "report.html.j2", "cells.html.j2"  # in chunkgrpo/eval/templates/
LABEL_ORDER = ("base", "trained")
SIG_CLASS = {1: "pos", -1: "neg", 0: "neutral"}
SIG_WORD = {1: "trained better", -1: "trained worse", 0: "no significant difference (CI contains 0)"}
_BOX_COLORS = ("#e6194b", "#3cb44b", "#4363d8", "#f58231", "#911eb4", "#42d4f4", "#f032e6", "#bfef45")
_SUB = (("consistency", "C"), ("realism", "R"), ("aesthetic_quality", "A"))
_TITLES = {"hpdv2": "HPDv2 test", "geneval": "GenEval", "wise": "WISE"}
_LABEL_W = 72  # px beside a GenEval sample for its detections' labels


def _fmt(x: Any, digits: int = 4) -> str:
    """A value for a table cell: – for None, yes/no, floats with `digits` decimals, nan, text as is (the
    template escapes it)."""
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, (int, float)):
        if isinstance(x, float) and not math.isfinite(x):
            return "nan"
        return f"{x:.{digits}f}" if isinstance(x, float) else str(x)
    return str(x)


@functools.lru_cache(maxsize=1)
def _env() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.PackageLoader("chunkgrpo.eval", "templates"),
                             autoescape=True, undefined=jinja2.StrictUndefined)
    env.globals.update(
        fmt=_fmt, finite=finite, significance=cell_significance, SIG_CLASS=SIG_CLASS, SIG_WORD=SIG_WORD,
        signed=lambda x, d: f"{x:+.{d}f}", fixed=lambda x, d: f"{x:.{d}f}", pct=lambda x: f"{x:.0%}",
        ci_level=lambda c: round(100 * float(c.get("level", 0.95))),
        as_text=lambda v: json.dumps(v) if isinstance(v, (dict, list)) else v,
        thumbnail=lambda path, size, boxes=None: thumbnail(path, size, boxes=boxes), detections=_boxes)
    return env


def delta_cell(cell: Mapping | None, digits: int = 4) -> str:
    """A table cell with the delta and its CI: green / red only when the CI excludes 0, neutral otherwise."""
    return str(_env().get_template(CELLS).module.delta_cell(cell, digits))


def win_cell(cell: Mapping | None) -> str:
    """A table cell with the win rate, its CI (when there is one) and the tie rate."""
    return str(_env().get_template(CELLS).module.win_cell(cell))


def thumbnail(path: Path, size: int = 256, quality: int = 80, boxes: Sequence | None = None) -> str | None:
    """A data: URI JPEG of the image, longest side at most `size` (None if the file is missing).
    `boxes`: [(label, (x1, y1, x2, y2), colour)] in original pixels, outlined on the thumbnail; the labels
    go beside the image (the report lists them), never over it: on a 32×32 sample a label hides the scene."""
    from PIL import Image, ImageDraw

    if not path.exists():
        return None
    with Image.open(path) as im:
        im = im.convert("RGB")
        w0, h0 = im.size
        im.thumbnail((size, size))
        if boxes:
            sx, sy = im.size[0] / w0, im.size[1] / h0
            draw = ImageDraw.Draw(im)
            for _label, (x1, y1, x2, y2), colour in boxes:
                r = (x1 * sx, y1 * sy, max(x1 * sx, x2 * sx - 1), max(y1 * sy, y2 * sy - 1))
                draw.rectangle(r, outline=colour, width=2 if min(im.size) >= 64 else 1)
        buf = io.BytesIO()
        im.save(buf, "JPEG", quality=quality)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _labels(result: Mapping) -> list[str]:
    """The result's labels in display order (base, then trained)."""
    return [lb for lb in LABEL_ORDER if lb in result.get("labels", [])]


# ------------------------------------------------------------------------------------- row choice


def pick_rows(changes: Mapping[Any, float], k: int) -> tuple[list, list, list]:
    """Rows with the largest changes in both directions: up to ceil(k/2) largest improvements and the
    largest regressions (a side with fewer rows leaves its share to the other); `unchanged` fills the
    rows only when nothing changed. Returns (improved, regressed, unchanged) keys."""
    items = [(key, float(v)) for key, v in changes.items() if finite(v)]
    up = [key for key, v in sorted((x for x in items if x[1] > 0), key=lambda x: -x[1])]
    down = [key for key, v in sorted((x for x in items if x[1] < 0), key=lambda x: x[1])]
    n_up = min(len(up), max(k - min(len(down), k // 2), 0))
    n_down = min(len(down), k - n_up)
    unchanged = [key for key, v in items if v == 0][: k - n_up - n_down] if not (up or down) else []
    return up[:n_up], down[:n_down], unchanged


def row_sections(changes: Mapping | None, keys: Sequence, what: str, max_prompts: int) -> list[tuple]:
    """The image rows of a benchmark as [(title, row count or None, keys)]: with both labels (`changes` =
    {key: trained − base}) the largest changes in both directions (`pick_rows`; none: no section), else the
    first `max_prompts` of `keys`."""
    if changes is None:
        first = list(keys)[:max_prompts]
        return [(f"Images (first {len(first)} of {len(keys)} prompts)", None, first)]
    improved, regressed, unchanged = pick_rows(changes, max_prompts)
    titled = ((f"Largest improvements ({what})", improved), (f"Largest regressions ({what})", regressed),
              ("No prompt changed; first prompts shown", unchanged))
    return [(title, len(ks), ks) for title, ks in titled if ks]


# ------------------------------------------------------------------------------------ the sections


def _section(bench: str, result: Mapping, b: Mapping, out: Path, jobs: Sequence, max_prompts: int,
             thumb: int) -> dict:
    """What every benchmark section shows besides its own parts (the template's `section` macro)."""
    return {"bench": bench, "title": _TITLES[bench], "n_prompts": b.get("n_prompts"),
            "labels": _labels(result), "res": b.get("results") or {}, "stats": b.get("statistics") or {},
            "out": out, "thumb": thumb,
            "max_prompts": max_prompts, "comparable": bool(b.get("comparable_to_official")),
            "notes": b.get("comparable_notes") or [], "has_images": bool(jobs), "plots": Markup("")}


def _bench_plots(b: Mapping, title: str, shared_axis: bool) -> str:
    """The delta bar chart of a benchmark's statistics cells ('' without statistics)."""
    stats = b.get("statistics") or {}
    if not stats:
        return ""
    level = round(100 * next(iter(stats.values())).get("level", 0.95))
    return svg_delta_bars(list(stats.items()), title=f"{title}: trained − base, {level}% CI",
                          shared_axis=shared_axis)


def _hpdv2(s: dict, result: Mapping, b: Mapping, jobs: Sequence, per_image: Mapping) -> dict:
    labels, res = s["labels"], s["res"]
    names = list(next(iter(res.values()))["scorers"]) if res else []
    jobs = list(jobs)
    if res:
        plots = [_bench_plots(b, "HPDv2", shared_axis=False)]
        plots += [svg_histogram({lb: (per_image.get(lb) or {}).get(n, []) for lb in labels},
                                title=f"{n}: per-image scores") for n in names]
        s["plots"] = Markup("".join(plots))
    primary = names[0] if names else None
    t, bb = ((per_image.get(lb) or {}).get(primary) for lb in ("trained", "base"))
    both = bool(primary and len(labels) == 2 and t and bb)
    scores = {lb: [" · ".join(f"{n} {_fmt(v[i], 3)}" for n, v in (per_image.get(lb) or {}).items()
                              if i < len(v)) for i in range(len(jobs))] for lb in labels}
    change = [t[i] - bb[i] if both and i < len(t) else None for i in range(len(jobs))]
    changes = None
    if len(labels) == 2 and primary:
        t, bb = per_image["trained"][primary], per_image["base"][primary]
        changes = {i: t[i] - bb[i] for i in range(min(len(t), len(bb), len(jobs)))}
    return {**s, "names": names, "primary": primary, "jobs": jobs, "scores": scores, "change": change,
            "n_images": {n: next(iter(res.values()))["scorers"][n]["n"] for n in names},
            "scorer_info": result.get("scorers") or {},
            "rows": row_sections(changes, list(range(len(jobs))), f"by {primary}", s["max_prompts"])}


def _boxes(rec: Mapping | None) -> list:
    """The detections of a GenEval record as thumbnail boxes: [("class score", box, colour)]."""
    if not rec:
        return []
    try:
        det = json.loads(rec.get("details") or "{}")
    except (TypeError, ValueError):
        return []
    out = []
    for i, (cls, items) in enumerate(det.items()):
        for x1, y1, x2, y2, score in items:
            out.append((f"{cls} {score:.2f}", (x1, y1, x2, y2), _BOX_COLORS[i % len(_BOX_COLORS)]))
    return out


def _geneval(s: dict, result: Mapping, b: Mapping, jobs: Sequence, records: Mapping) -> dict:
    labels, res = s["labels"], s["res"]
    first = next(iter(res.values())) if res else {}
    groups = list(first.get("tasks") or {})
    values = {g: {lb: (res[lb]["overall"] if g == "overall" else res[lb]["tasks"].get(g, {}).get("score"))
                  for lb in labels if lb in res} for g in ["overall", *groups]}
    if res:
        plots = [_bench_plots(b, "GenEval", shared_axis=True)]
        if len(labels) == 2:
            pairs = geneval_prompt_pairs(records)
            plots.append(svg_histogram({lb: [e[f"{lb}_mean"] for e in pairs.values()] for lb in labels},
                                       title="per-prompt accuracy (share of its images correct)",
                                       bins=[-0.125, 0.125, 0.375, 0.625, 0.875, 1.125]))
        s["plots"] = Markup("".join(plots))
    recs = {lb: {r.get("filename"): r for r in (records.get(lb) or [])} for lb in labels}
    by_prompt: dict[str, list] = {}
    for j in jobs:
        by_prompt.setdefault(j.key.split(":")[0], []).append(j)
    n_correct = {k: {lb: sum(bool((recs[lb].get(f"geneval/{lb}/{j.rel}") or {}).get("correct")) for j in js)
                     for lb in labels} for k, js in by_prompt.items()}
    changes = None
    if len(labels) == 2:
        pairs = geneval_prompt_pairs(records)
        changes = {str(i): e["trained_mean"] - e["base_mean"] for i, e in pairs.items()
                   if str(i) in by_prompt}
    return {**s, "groups": groups, "by_group": values, "first": first, "recs": recs, "by_prompt": by_prompt,
            "n_correct": n_correct, "small": max(64, s["thumb"] // 2), "label_w": _LABEL_W,
            "has_images": bool(by_prompt),
            "colour": {f"colour {k}": v for k, v in (first.get("color_classifier") or {}).items()},
            "discovery": {"file discovery": first.get("file_discovery"),
                          "scored files that are not plain <digits>.png": first.get("unusual_files")},
            "rows": row_sections(changes, list(by_prompt), "share of correct images", s["max_prompts"])}


def _wise(s: dict, result: Mapping, b: Mapping, jobs: Sequence, records: Mapping) -> dict:
    labels, res = s["labels"], s["res"]
    groups = list(dict.fromkeys(c for r in res.values() for c in (r.get("categories") or {})))
    def category(lb: str, g: str) -> dict:
        return (res.get(lb, {}).get("categories") or {}).get(g, {})

    values = {g: {lb: res[lb].get("overall") if g == "overall" else category(lb, g).get("wiscore")
                  for lb in labels if lb in res} for g in ["overall", *groups]}
    sub_scores = {g: {lb: " / ".join(_fmt(category(lb, g).get(f"mean_{k}"), 2) for k, _ in _SUB)
                      for lb in labels} for g in groups}
    judge = {}
    if res:
        per_image = {lb: [r.get("wiscore") for r in (records.get(lb) or []) if r.get("wiscore") is not None]
                     for lb in labels}
        s["plots"] = Markup(_bench_plots(b, "WISE", shared_axis=True) + svg_histogram(
            per_image, title="per-image WiScore", bins=[i / 20 - 0.025 for i in range(22)]))
        first = next(iter(res.values()))
        judge = {**(first.get("judge") or {}), "variant": first.get("variant"),
                 "failed": {lb: r.get("n_failed", 0) for lb, r in res.items()},
                 "refused": {lb: r.get("n_refused", 0) for lb, r in res.items()},
                 "missing images": {lb: len(r.get("missing") or []) for lb, r in res.items()},
                 "sub-scores outside 0-2 (kept as the official parser does)": {
                     lb: r.get("n_out_of_range", 0) for lb, r in res.items()}}
    recs = {lb: {int(r["prompt_id"]): r for r in (records.get(lb) or [])} for lb in labels}
    jobs = {int(j.key): j for j in jobs}
    change = {}
    for pid in jobs:
        t, bb = ((recs.get(lb, {}).get(pid) or {}).get("wiscore") for lb in ("trained", "base"))
        if finite(t, bb):
            change[pid] = t - bb
    failed = []
    if len(labels) == 2:
        failed = sorted(pid for pid in jobs if any((recs[lb].get(pid) or {}).get("error") for lb in labels))
    return {**s, "groups": groups, "by_group": values, "sub_scores": sub_scores, "judge": judge, "recs": recs,
            "jobs": jobs, "change": change, "failed": failed,
            "subs": lambda r: " ".join(f"{short} {r.get(k)}" for k, short in _SUB),
            "rows": row_sections(change if len(labels) == 2 else None, sorted(jobs), "WiScore",
                                 s["max_prompts"])}


_SECTIONS = {"hpdv2": _hpdv2, "geneval": _geneval, "wise": _wise}


# -------------------------------------------------------------------------------------------- page


def _summary_rows(result: Mapping) -> list[tuple]:
    """(metric, its value per label, the statistics cell or None) for every metric of every benchmark."""
    metrics = result.get("metrics") or {}
    rows = []
    for bench, b in (result.get("benchmarks") or {}).items():
        stems = dict.fromkeys(k[len(bench) + 1:].rsplit(".", 1)[0] for k in metrics
                              if k.startswith(bench + ".") and k.rsplit(".", 1)[1] in ("trained", "base"))
        stats = b.get("statistics") or {}
        rows += [(f"{bench}.{s}", [metrics.get(f"{bench}.{s}.{lb}") for lb in _labels(result)], stats.get(s))
                 for s in stems]
    return rows


def render_report(result: Mapping, out_dir: str | Path, jobs: Mapping[str, Sequence], per_image: Mapping,
                  *, max_prompts: int = 48, thumb: int = 256) -> str:
    """The report as one HTML string. `jobs[bench]` lists the images (objects with key, prompt, seed, rel,
    group); `per_image[bench]` the per-image scores / records per label."""
    out = Path(out_dir)
    benchmarks = result.get("benchmarks") or {}
    sections = []
    for bench, b in benchmarks.items():
        if bench in _SECTIONS:
            s = _section(bench, result, b, out, jobs.get(bench, []), max_prompts, thumb)
            sections.append(_SECTIONS[bench](s, result, b, jobs.get(bench, []), per_image.get(bench) or {}))
    stats_note = next((c for b in benchmarks.values() for c in (b.get("statistics") or {}).values()), None)
    return _env().get_template(TEMPLATE).render(
        result=result, labels=_labels(result), summary_rows=_summary_rows(result), sections=sections,
        models=result.get("models") or {},
        sampling={**(result.get("sampling") or {}), "seed": result.get("seed")},
        generation=result.get("generation") or {}, stats_note=stats_note,
        generated=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))


def write_report(path: str | Path, result: Mapping, out_dir: str | Path, jobs: Mapping[str, Sequence],
                 per_image: Mapping, *, max_prompts: int = 48, thumb: int = 256) -> Path:
    """Write `render_report(...)` to `path` (UTF-8); returns the path."""
    path = Path(path)
    path.write_text(render_report(result, out_dir, jobs, per_image, max_prompts=max_prompts, thumb=thumb),
                    encoding="utf-8")
    return path

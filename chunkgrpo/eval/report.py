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

Size note: one room (~700 lines) on purpose: one HTML document with one stylesheet; the per-benchmark
sections (`_hpdv2`, `_geneval`, `_wise`) share the cell, thumbnail and image-row helpers and the CSS
classes defined here, so splitting them off would only move private helpers across modules; the SVG
plots and the statistics already live in `plots` and `stats`.
"""

from __future__ import annotations

import base64
import datetime as _dt
import io
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from chunkgrpo.eval.plots import cell_significance as _sig
from chunkgrpo.eval.plots import escape as _e
from chunkgrpo.eval.plots import finite as _finite
from chunkgrpo.eval.plots import svg_delta_bars, svg_histogram
from chunkgrpo.eval.stats import geneval_prompt_pairs

CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px;color:#222;max-width:1400px}
h1{font-size:22px}h2{font-size:18px;margin-top:32px;border-bottom:1px solid #ddd;padding-bottom:4px}
h3{font-size:15px;margin-top:20px}
table{border-collapse:collapse;margin:8px 0;font-size:13px}
th,td{border:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f4f4f4}td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.pos{color:#0a7d28}.neg{color:#b00020}.neutral{color:#666}.muted{color:#777;font-size:12px}
td.pos{background:#eef8f0}td.neg{background:#fdeeee}td.neutral{background:#f6f6f6}
.ci{font-size:11px;color:#555}
.ok{background:#e8f5e9;padding:6px}.warn{background:#fff8e1;padding:6px}
.warn ul{margin:4px 0 0 0}
table.pairs td{text-align:center}table.pairs td.prompt{text-align:left;max-width:320px}
table.pairs img{display:block;margin:0 auto 4px auto;border:1px solid #ccc}
.thumbs{white-space:normal}.thumbs .s{display:inline-block;vertical-align:top;margin:2px;font-size:11px;
overflow-wrap:anywhere}
.reason{color:#b00020;font-size:11px;text-align:left}
.badge{display:inline-block;padding:0 4px;border-radius:3px;font-size:11px}
.badge.t{background:#e8f5e9;color:#0a7d28}.badge.f{background:#fdecea;color:#b00020}
.plots{display:flex;flex-wrap:wrap;gap:16px;align-items:flex-start}
.plot{border:1px solid #eee;padding:6px}
details{font-size:11px;text-align:left;max-width:300px}details pre{white-space:pre-wrap;margin:2px 0}
pre.answer{font-size:11px;text-align:left;white-space:pre-wrap;background:#f7f7f7;\
margin:2px 0;padding:2px 4px;
max-width:300px}
code{font-size:12px}
"""

LABEL_ORDER = ("base", "trained")
SIG_CLASS = {1: "pos", -1: "neg", 0: "neutral"}
SIG_WORD = {1: "trained better", -1: "trained worse", 0: "no significant difference (CI contains 0)"}
_BOX_COLORS = ("#e6194b", "#3cb44b", "#4363d8", "#f58231", "#911eb4", "#42d4f4", "#f032e6", "#bfef45")


def _fmt(x: Any, digits: int = 4) -> str:
    """A value for a table cell: – for None, yes/no, floats with `digits` decimals, nan, escaped text."""
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, (int, float)):
        if isinstance(x, float) and not math.isfinite(x):
            return "nan"
        return f"{x:.{digits}f}" if isinstance(x, float) else str(x)
    return _e(x)


def delta_cell(cell: Mapping | None, digits: int = 4) -> str:
    """A table cell with the delta and its CI: green / red only when the CI excludes 0, neutral otherwise."""
    if not cell or not _finite(cell.get("delta")):
        return "<td class=num>–</td>"
    if not _finite(cell.get("ci_low"), cell.get("ci_high")):
        return (
            f"<td class='num neutral' title='{_e(cell.get('note') or 'no interval')}'>"
            f"{cell['delta']:+.{digits}f}"
            f"<br><span class=ci>{_e(cell.get('note') or 'no interval')}</span>"
            f"{_paired_means(cell, digits)}</td>"
        )
    sig = _sig(cell)
    level = round(100 * float(cell.get("level", 0.95)))
    return (f"<td class='num {SIG_CLASS[sig]}' title='{_e(SIG_WORD[sig])}'>{cell['delta']:+.{digits}f}"
            f"<br><span class=ci>{level}% CI [{cell['ci_low']:+.{digits}f}, "
            f"{cell['ci_high']:+.{digits}f}]</span>"
            f"{_paired_means(cell, digits)}</td>")


def _paired_means(cell: Mapping, digits: int) -> str:
    """base → trained means over the pairs the delta and its CI use (each label's own mean, in the columns
    beside, may cover other items, e.g. when a judgement failed for one label only)."""
    if not _finite(cell.get("mean_base"), cell.get("mean_trained")):
        return ""
    return (f"<br><span class=ci>paired means {cell['mean_base']:.{digits}f} → "
            f"{cell['mean_trained']:.{digits}f} (n={cell.get('n')})</span>")


def win_cell(cell: Mapping | None) -> str:
    """A table cell with the win rate, its CI (when there is one) and the tie rate."""
    if not cell or not _finite(cell.get("win_rate")):
        return "<td class=num>–</td>"
    if not _finite(cell.get("win_ci_low"), cell.get("win_ci_high")):
        return (f"<td class=num>{cell['win_rate']:.0%}<br>"
                f"<span class=ci>ties {cell.get('tie_rate', 0):.0%}</span></td>")
    return (f"<td class=num>{cell['win_rate']:.0%}<br><span class=ci>[{cell['win_ci_low']:.0%}, "
            f"{cell['win_ci_high']:.0%}] · ties {cell.get('tie_rate', 0):.0%}</span></td>")


def thumbnail(path: Path, size: int = 256, quality: int = 80, boxes: Sequence | None = None) -> str | None:
    """A data: URI JPEG of the image, longest side at most `size` (None if the file is missing).
    `boxes`: [(label, (x1, y1, x2, y2), colour)] in original pixels, drawn on the thumbnail."""
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
            for label, (x1, y1, x2, y2), colour in boxes:
                r = (x1 * sx, y1 * sy, max(x1 * sx, x2 * sx - 1), max(y1 * sy, y2 * sy - 1))
                draw.rectangle(r, outline=colour, width=2)
                tw = draw.textlength(label)
                draw.rectangle((r[0], r[1], r[0] + tw + 4, r[1] + 11), fill=colour)
                draw.text((r[0] + 2, r[1]), label, fill="white")
        buf = io.BytesIO()
        im.save(buf, "JPEG", quality=quality)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _img(path: Path, size: int, title: str = "", boxes: Sequence | None = None) -> str:
    """An embedded thumbnail `<img>` (with `boxes` drawn), or a 'missing' note."""
    uri = thumbnail(path, size, boxes=boxes)
    if uri is None:
        return "<span class=muted>missing</span>"
    return f"<img src='{uri}' width='{size}' title='{_e(title)}' alt='{_e(title)}'>"


def _kv_table(rows: Mapping[str, Any]) -> str:
    """A two-column key / value table of the non-empty entries (dicts and lists as JSON)."""
    body = "".join(
        f"<tr><th>{_e(k)}</th><td>{_e(v if not isinstance(v, (dict, list)) else json.dumps(v))}</td></tr>"
        for k, v in rows.items()
        if v not in (None, "", [], {})
    )
    return f"<table>{body}</table>"


def _labels(result: Mapping) -> list[str]:
    """The result's labels in display order (base, then trained)."""
    return [lb for lb in LABEL_ORDER if lb in result.get("labels", [])]


# ------------------------------------------------------------------------------------- row choice


def pick_rows(changes: Mapping[Any, float], k: int) -> tuple[list, list, list]:
    """Rows with the largest changes in both directions: up to ceil(k/2) largest improvements and the
    largest regressions (a side with fewer rows leaves its share to the other); `unchanged` fills the
    rows only when nothing changed. Returns (improved, regressed, unchanged) keys."""
    items = [(key, float(v)) for key, v in changes.items() if _finite(v)]
    up = [key for key, v in sorted((x for x in items if x[1] > 0), key=lambda x: -x[1])]
    down = [key for key, v in sorted((x for x in items if x[1] < 0), key=lambda x: x[1])]
    n_up = min(len(up), max(k - min(len(down), k // 2), 0))
    n_down = min(len(down), k - n_up)
    unchanged = [key for key, v in items if v == 0][: k - n_up - n_down] if not (up or down) else []
    return up[:n_up], down[:n_down], unchanged


def _row_sections(keys: tuple[list, list, list], render, what: str) -> str:
    """The image-row sections (largest improvements, regressions, or unchanged) of `pick_rows` keys."""
    improved, regressed, unchanged = keys
    parts = []
    for title, ks in (
        (f"Largest improvements ({what})", improved),
        (f"Largest regressions ({what})", regressed),
        ("No prompt changed; first prompts shown", unchanged),
    ):
        if ks:
            parts.append(f"<h3>{_e(title)} <span class=muted>{len(ks)} rows</span></h3>" + render(ks))
    if not parts:
        parts.append("<p class=muted>No paired images to show.</p>")
    return "".join(parts)


def _image_rows(changes: Mapping | None, keys: Sequence, render, what: str, max_prompts: int) -> str:
    """The image rows of a benchmark: with both labels (`changes` = {key: trained − base}) the largest
    changes in both directions (`pick_rows`), else the first `max_prompts` of `keys`."""
    if changes is not None:
        return _row_sections(pick_rows(changes, max_prompts), render, what)
    first = list(keys)[:max_prompts]
    return f"<h3>Images (first {len(first)} of {len(keys)} prompts)</h3>" + render(first)


def _group_table(what: str, groups: Sequence[str], labels: Sequence[str], res: Mapping, stats: Mapping, value,
                 *, label_head: str = "", pair_head: str = "", extra_head: str = "", extra=None) -> str:
    """One row per group ("overall" first: GenEval tasks, WISE categories) with `value(label, group)` per
    label, then (both labels) the paired delta with its CI, the win rate and n, then `extra(group)` cells."""
    head = "".join(f"<th>{_e(lb)}{label_head}</th>" for lb in labels)
    head += (pair_head if len(labels) == 2 else "") + extra_head
    rows = []
    for g in ["overall", *groups]:
        vals = {lb: value(lb, g) for lb in labels if lb in res}
        cells = "".join(f"<td class=num>{_fmt(vals.get(lb))}</td>" for lb in labels)
        if len(labels) == 2:
            c = stats.get(g)
            cells += delta_cell(c) + win_cell(c) + f"<td class=num>{(c or {}).get('n', '–')}</td>"
        if extra is not None:
            cells += extra(g)
        rows.append(f"<tr><td>{'<b>overall</b>' if g == 'overall' else _e(g)}</td>{cells}</tr>")
    return f"<table><tr><th>{what}</th>{head}</tr>{''.join(rows)}</table>"


# ------------------------------------------------------------------------------------------ summary


def _summary(result: Mapping) -> str:
    """The summary table: every metric per label and, with both labels, its paired delta, win rate, n."""
    metrics = result.get("metrics") or {}
    labels = _labels(result)
    benches = result.get("benchmarks") or {}
    rows = []
    for bench, b in benches.items():
        stems = list(
            dict.fromkeys(
                k[len(bench) + 1 :].rsplit(".", 1)[0]
                for k in metrics
                if k.startswith(bench + ".") and k.rsplit(".", 1)[1] in ("trained", "base")
            )
        )
        stats = b.get("statistics") or {}
        for s in stems:
            cells = "".join(f"<td class=num>{_fmt(metrics.get(f'{bench}.{s}.{lb}'))}</td>" for lb in labels)
            if len(labels) == 2:
                c = stats.get(s)
                if c:
                    cells += delta_cell(c) + win_cell(c) + f"<td class=num>{c.get('n')}</td>"
                else:  # no pairs: no delta (an unpaired difference is never shown as the delta)
                    cells += "<td>–</td><td>–</td><td>–</td>"
            rows.append(f"<tr><td>{_e(bench)}.{_e(s)}</td>{cells}</tr>")
    if not rows:
        return "<p class=muted>No metrics (images generated only).</p>"
    head = "".join(f"<th>{_e(lb)}</th>" for lb in labels)
    if len(labels) == 2:
        head += "<th>trained − base (paired bootstrap CI)</th><th>win rate [CI]</th><th>n</th>"
    legend = (
        (
            "<p class=muted>Green / red only when the confidence interval of the delta lies entirely above / "
            "below 0; grey = the interval contains 0 (no significant difference). Win rate = share of "
            "prompts where trained scores strictly higher than base (same prompt and seed). The base / "
            "trained columns are each model's own mean over what it scored; the delta, its CI and the paired "
            "means below it use only the prompts scored for both (they differ when e.g. a judgement "
            "failed for one model).</p>"
        )
        if len(labels) == 2
        else ""
    )
    return f"<table><tr><th>metric</th>{head}</tr>{''.join(rows)}</table>{legend}"


def _comparable(b: Mapping) -> str:
    """Whether a benchmark's numbers are comparable with published ones, and why not."""
    if b.get("comparable_to_official"):
        return "<p class=ok>Comparable with published numbers (official prompts, protocol and models).</p>"
    notes = b.get("comparable_notes") or []
    if not notes:
        return ""
    return ("<div class=warn><b>Not comparable with published numbers, because:</b><ul>"
            + "".join(f"<li>{_e(n)}</li>" for n in notes) + "</ul></div>")


def _bench_plots(b: Mapping, title: str, shared_axis: bool) -> str:
    """The delta bar chart of a benchmark's statistics cells ('' without statistics)."""
    stats = b.get("statistics") or {}
    return (
        svg_delta_bars(
            list(stats.items()),
            title=(
                f"{title}: trained − base, "
                f"{round(100 * next(iter(stats.values())).get('level', 0.95))}% CI"
            ),
            shared_axis=shared_axis,
        )
        if stats
        else ""
    )


# ------------------------------------------------------------------------------------------- hpdv2


def _hpdv2(result: Mapping, b: Mapping, out: Path, jobs: Sequence, per_image: Mapping, max_prompts: int,
           thumb: int) -> str:
    """The HPDv2 section: scorer table, plots, scorer information, comparability, image rows."""
    labels = _labels(result)
    res = b.get("results") or {}
    parts = []
    names: list[str] = []
    if res:
        names = list(next(iter(res.values()))["scorers"])
        stats = b.get("statistics") or {}
        head = "".join(f"<th>{_e(lb)} mean ± s.e.</th>" for lb in labels)
        rows = []
        for n in names:
            cells = ""
            for lb in labels:
                s = res.get(lb, {}).get("scorers", {}).get(n, {})
                cells += f"<td class=num>{_fmt(s.get('mean'))} ± {_fmt(s.get('stderr'))}</td>"
            if len(labels) == 2:
                cells += delta_cell(stats.get(n)) + win_cell(stats.get(n))
            n_img = next(iter(res.values()))["scorers"][n]["n"]
            rows.append(f"<tr><td>{_e(n)}</td>{cells}<td class=num>{n_img}</td></tr>")
        extra = "<th>trained − base [CI]</th><th>win rate</th>" if len(labels) == 2 else ""
        parts.append(f"<table><tr><th>scorer</th>{head}{extra}<th>n</th></tr>{''.join(rows)}</table>")
        plots = [_bench_plots(b, "HPDv2", shared_axis=False)]
        for n in names:
            plots.append(svg_histogram({lb: (per_image.get(lb) or {}).get(n, []) for lb in labels},
                                       title=f"{n}: per-image scores"))
        parts.append("<div class=plots>" + "".join(plots) + "</div>")
        infos = result.get("scorers") or {}
        info_rows = "".join(
            f"<tr><td>{_e(n)}</td><td>{_e(i.get('backend', ''))}</td>"
            f"<td>{_e(i.get('preprocessing', ''))}</td>"
            f"<td>{_e(i.get('scale', ''))}</td><td>{_e(i.get('weights', i.get('options', '')))}</td>"
            "<td>"
            + (
                "published metric"
                if i.get("comparable_to_official")
                else _e(i.get("not_published_because", "no"))
            )
            + "</td></tr>"
            for n, i in infos.items()
            if n in names
        )
        parts.append("<h3>Scorers</h3><table><tr><th>scorer</th><th>backend</th><th>preprocessing</th><th>scale</th>"
                     f"<th>weights / options</th><th>published?</th></tr>{info_rows}</table>")
    parts.append(_comparable(b))
    jobs = list(jobs)
    if not jobs:
        return "".join(parts)
    primary = names[0] if names else None

    def render(ks):
        """The image table of the rows `ks`."""
        head = "".join(f"<th>{_e(lb)}</th>" for lb in labels)
        rows = []
        for i in ks:
            j = jobs[i]
            cells = ""
            for lb in labels:
                scores = {n: v[i] for n, v in (per_image.get(lb) or {}).items() if i < len(v)}
                txt = " · ".join(f"{n} {_fmt(v, 3)}" for n, v in scores.items())
                cells += (
                    f"<td>{_img(out / 'hpdv2' / lb / j.rel, thumb, j.prompt)}"
                    f"<span class=muted>{_e(txt)}</span></td>"
                )
            change = ""
            if primary and len(labels) == 2:
                t, bb = (
                    (per_image.get("trained") or {}).get(primary),
                    (per_image.get("base") or {}).get(primary),
                )
                if t and bb and i < len(t):
                    change = f"<br><span class=muted>Δ{_e(primary)} {t[i] - bb[i]:+.4f}</span>"
            rows.append(f"<tr><td class=prompt><b>#{_e(j.key)}</b> <span class=muted>seed {j.seed}</span><br>"
                        f"{_e(j.prompt)}{change}</td>{cells}</tr>")
        return f"<table class=pairs><tr><th>prompt</th>{head}</tr>{''.join(rows)}</table>"

    changes = None
    if len(labels) == 2 and primary:
        t, bb = per_image["trained"][primary], per_image["base"][primary]
        changes = {i: t[i] - bb[i] for i in range(min(len(t), len(bb), len(jobs)))}
    parts.append(_image_rows(changes, list(range(len(jobs))), render, f"by {primary}", max_prompts))
    return "".join(parts)


# ------------------------------------------------------------------------------------------ geneval


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


def _geneval(result: Mapping, b: Mapping, out: Path, jobs: Sequence, records: Mapping, max_prompts: int,
             thumb: int) -> str:
    """The GenEval section: task table, plots, detector / colour classifier, comparability, rows."""
    labels = _labels(result)
    res = b.get("results") or {}
    stats = b.get("statistics") or {}
    parts = []
    if res:
        first = next(iter(res.values()))

        def score(lb: str, tag: str):
            """A label's GenEval score of a task (or overall)."""
            return res[lb]["overall"] if tag == "overall" else res[lb]["tasks"].get(tag, {}).get("score")

        parts.append(
            _group_table(
                "task",
                list(first["tasks"]),
                labels,
                res,
                stats,
                score,
                pair_head="<th>trained − base [CI]</th><th>win rate (prompts)</th><th>n prompts</th>",
            )
        )
        plots = [_bench_plots(b, "GenEval", shared_axis=True)]
        if len(labels) == 2:
            pairs = geneval_prompt_pairs(records)
            plots.append(svg_histogram({lb: [e[f"{lb}_mean"] for e in pairs.values()] for lb in labels},
                                       title="per-prompt accuracy (share of its images correct)",
                                       bins=[-0.125, 0.125, 0.375, 0.625, 0.875, 1.125]))
        parts.append("<div class=plots>" + "".join(plots) + "</div>")
        parts.append(
            "<h3>Detector and colour classifier</h3>"
            + _kv_table(first.get("detector") or {})
            + _kv_table({f"colour {k}": v for k, v in (first.get("color_classifier") or {}).items()})
            + _kv_table(
                {
                    "file discovery": first.get("file_discovery"),
                    "scored files that are not plain <digits>.png": first.get("unusual_files"),
                }
            )
        )
    parts.append(_comparable(b))
    recs = {lb: {r.get("filename"): r for r in (records.get(lb) or [])} for lb in labels}
    by_prompt: dict[str, list] = {}
    for j in jobs:
        by_prompt.setdefault(j.key.split(":")[0], []).append(j)
    if not by_prompt:
        return "".join(parts)
    small = max(64, thumb // 2)

    def render(ks):
        """The image table of the rows `ks`."""
        head = "".join(f"<th>{_e(lb)}</th>" for lb in labels)
        rows = []
        for k in ks:
            js = by_prompt[k]
            cells = ""
            acc = {}
            for lb in labels:
                ims = []
                n_ok = 0
                for j in js:
                    rel = f"geneval/{lb}/{j.rel}"
                    r = recs[lb].get(rel)
                    c = None if r is None else bool(r.get("correct"))
                    n_ok += bool(c)
                    badge = (
                        ""
                        if c is None
                        else f"<span class='badge {'t' if c else 'f'}'>{'✓' if c else '✗'}</span>"
                    )
                    reason = "" if not r or c else f"<div class=reason>{_e(r.get('reason') or '')}</div>"
                    ims.append(
                        f"<span class=s style='width:{small + 8}px'>"
                        f"{_img(out / rel, small, j.prompt, _boxes(r))}"
                        f"{badge}{reason}</span>"
                    )
                acc[lb] = n_ok
                cells += f"<td class=thumbs>{''.join(ims)}</td>"
            change = (
                (
                    f"<br><span class=muted>correct: base {acc['base']}/{len(js)} "
                    f"→ trained {acc['trained']}/{len(js)}"
                    "</span>"
                )
                if len(labels) == 2
                else ""
            )
            rows.append(f"<tr><td class=prompt><b>#{_e(k)}</b> <span class=muted>{_e(js[0].group)}</span><br>"
                        f"{_e(js[0].prompt)}{change}</td>{cells}</tr>")
        return f"<table class=pairs><tr><th>prompt</th>{head}</tr>{''.join(rows)}</table>"

    changes = None
    if len(labels) == 2:
        pairs = geneval_prompt_pairs(records)
        changes = {
            str(idx): e["trained_mean"] - e["base_mean"] for idx, e in pairs.items() if str(idx) in by_prompt
        }
    parts.append(_image_rows(changes, list(by_prompt), render, "share of correct images", max_prompts))
    parts.append(
        "<p class=muted>Boxes: detections kept by the official rules (score &gt; 0.3, 0.9 for counting; "
        "at most 16 per class), labelled with class and confidence; red text: why the image failed.</p>"
    )
    return "".join(parts)


# --------------------------------------------------------------------------------------------- wise


_SUB = (("consistency", "C"), ("realism", "R"), ("aesthetic_quality", "A"))


def _wise(result: Mapping, b: Mapping, out: Path, jobs: Sequence, records: Mapping, max_prompts: int,
          thumb: int) -> str:
    """The WISE section: category table, plots, judge information, comparability, image rows."""
    labels = _labels(result)
    res = b.get("results") or {}
    stats = b.get("statistics") or {}
    parts = []
    if res:
        cats = list(dict.fromkeys(c for r in res.values() for c in (r.get("categories") or {})))

        def wiscore(lb: str, cat: str):
            """A label's WiScore of a category (or overall)."""
            return (res[lb].get("overall") if cat == "overall" else
                    (res[lb].get("categories") or {}).get(cat, {}).get("wiscore"))

        def sub_scores(cat: str) -> str:
            """Mean consistency / realism / aesthetic quality per label (blank for overall)."""
            cells = ""
            for lb in labels:
                if cat == "overall":
                    cells += "<td></td>"
                    continue
                cc = (res.get(lb, {}).get("categories") or {}).get(cat, {})
                cells += (
                    "<td class=num>" + " / ".join(_fmt(cc.get(f"mean_{k}"), 2) for k, _ in _SUB) + "</td>"
                )
            return cells

        parts.append(_group_table("category", cats, labels, res, stats, wiscore, label_head=" WiScore",
                                  pair_head="<th>trained − base [CI]</th><th>win rate</th><th>n</th>",
                                  extra_head="".join(f"<th>{_e(lb)} mean C / R / A</th>" for lb in labels),
                                  extra=sub_scores))
        plots = [_bench_plots(b, "WISE", shared_axis=True)]
        plots.append(
            svg_histogram(
                {
                    lb: [r.get("wiscore") for r in (records.get(lb) or []) if r.get("wiscore") is not None]
                    for lb in labels
                },
                title="per-image WiScore",
                bins=[i / 20 - 0.025 for i in range(22)],
            )
        )
        parts.append("<div class=plots>" + "".join(plots) + "</div>")
        first = next(iter(res.values()))
        parts.append("<h3>Judge</h3>" + _kv_table({
            **(first.get("judge") or {}), "variant": first.get("variant"),
            "failed": {lb: r.get("n_failed", 0) for lb, r in res.items()},
            "refused": {lb: r.get("n_refused", 0) for lb, r in res.items()},
            "missing images": {lb: len(r.get("missing") or []) for lb, r in res.items()},
            "sub-scores outside 0-2 (kept as the official parser does)": {lb: r.get("n_out_of_range", 0)
                                                                         for lb, r in res.items()}}))
    parts.append(_comparable(b))
    recs = {lb: {int(r["prompt_id"]): r for r in (records.get(lb) or [])} for lb in labels}
    jobs = {int(j.key): j for j in jobs}
    if not jobs:
        return "".join(parts)

    def one(lb, pid):
        """One label's cell of a WISE row: image, WiScore and sub-scores (or the failure), judge answer."""
        j = jobs[pid]
        r = recs[lb].get(pid)
        if r is None:
            return (
                f"<td>{_img(out / 'wise' / lb / j.rel, thumb, j.prompt)}"
                "<span class=muted>not judged</span></td>"
            )
        if r.get("wiscore") is not None:
            subs = " ".join(f"{s} {r.get(k)}" for k, s in _SUB)
            score = f"<span class=muted>WiScore {_fmt(r['wiscore'], 3)} · {_e(subs)}</span>"
        else:
            score = f"<div class=reason>{_e(r.get('error') or 'failed')}</div>"
        answer = r.get("answer")
        ans = ""
        if answer:
            short = answer if len(answer) <= 240 else answer[:240] + " …"
            ans = f"<pre class=answer title='judge answer'>{_e(short)}</pre>"
            if len(answer) > 240:
                ans += f"<details><summary>full judge answer</summary><pre>{_e(answer)}</pre></details>"
        return f"<td>{_img(out / 'wise' / lb / j.rel, thumb, j.prompt)}{score}{ans}</td>"

    def render(ks):
        """The image table of the rows `ks`."""
        head = "".join(f"<th>{_e(lb)}</th>" for lb in labels)
        rows = []
        for pid in ks:
            j = jobs[pid]
            t, bb = (
                (recs.get("trained", {}).get(pid) or {}).get("wiscore"),
                (recs.get("base", {}).get(pid) or {}).get("wiscore"),
            )
            change = f"<br><span class=muted>ΔWiScore {t - bb:+.3f}</span>" if _finite(t, bb) else ""
            rows.append(
                f"<tr><td class=prompt><b>#{pid}</b> <span class=muted>{_e(j.group)}</span><br>{_e(j.prompt)}"
                f"{change}</td>{''.join(one(lb, pid) for lb in labels)}</tr>"
            )
        return f"<table class=pairs><tr><th>prompt</th>{head}</tr>{''.join(rows)}</table>"

    changes = None
    if len(labels) == 2:
        changes = {}
        for pid in jobs:
            t = (recs["trained"].get(pid) or {}).get("wiscore")
            bb = (recs["base"].get(pid) or {}).get("wiscore")
            if _finite(t, bb):
                changes[pid] = t - bb
    parts.append(_image_rows(changes, sorted(jobs), render, "WiScore", max_prompts))
    if len(labels) == 2:
        failed = sorted(pid for pid in jobs if any((recs[lb].get(pid) or {}).get("error") for lb in labels))
        if failed:
            parts.append(f"<h3>Failed judgements <span class=muted>{len(failed)}</span></h3>"
                         + render(failed[:max_prompts]))
    return "".join(parts)


# -------------------------------------------------------------------------------------------- page

_SECTIONS = {"hpdv2": ("HPDv2 test", _hpdv2), "geneval": ("GenEval", _geneval), "wise": ("WISE", _wise)}


def render_report(result: Mapping, out_dir: str | Path, jobs: Mapping[str, Sequence], per_image: Mapping,
                  *, max_prompts: int = 48, thumb: int = 256) -> str:
    """The report as one HTML string. `jobs[bench]` lists the images (objects with key, prompt, seed, rel,
    group); `per_image[bench]` the per-image scores / records per label."""
    out = Path(out_dir)
    models = result.get("models") or {}
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>chunkgrpo evaluation</title>"
        f"<style>{CSS}</style></head><body>",
        "<h1>chunkgrpo evaluation</h1>",
        f"<p class=muted>generated {_e(_dt.datetime.now(_dt.timezone.utc).isoformat(timespec='seconds'))}"
        + (f" · MLflow run {_e(result['mlflow_run_id'])}" if result.get("mlflow_run_id") else "")
        + (f" · {_e(result['output_uri'])}" if result.get("output_uri") else "")
        + "</p>",
        "<nav class=muted>"
        + " · ".join(
            f"<a href='#{_e(bn)}'>{_e(_SECTIONS[bn][0])}</a>"
            for bn in (result.get("benchmarks") or {})
            if bn in _SECTIONS
        )
        + "</nav>",
        "<h2>Summary</h2>" + _summary(result),
        "<h2>Models</h2>",
    ]
    for lb in ("trained", "base"):
        if lb in models:
            parts.append(f"<h3>{_e(lb)}</h3>" + _kv_table(models[lb]))
    parts.append(
        "<h3>Sampling</h3>" + _kv_table({**(result.get("sampling") or {}), "seed": result.get("seed")})
    )
    gen = result.get("generation") or {}
    if gen:
        parts.append("<h3>Generation</h3>" + _kv_table(gen))
    for bench, b in (result.get("benchmarks") or {}).items():
        title, fn = _SECTIONS[bench]
        n = b.get("n_prompts")
        parts.append(f"<h2 id='{_e(bench)}'>{_e(title)} <span class=muted>({_e(n)} prompts)</span></h2>")
        parts.append(fn(result, b, out, jobs.get(bench, []), per_image.get(bench) or {}, max_prompts, thumb))
    stats_note = next((c for b in (result.get("benchmarks") or {}).values()
                       for c in (b.get("statistics") or {}).values()), None)
    if stats_note:
        parts.append(
            f"<p class=muted>Statistics: {_e(stats_note.get('method'))}, {stats_note.get('samples')} "
            "replicates; GenEval overall resamples prompts within each task (mean of the task means), WISE "
            "overall within each category (official weights).</p>"
        )
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(path: str | Path, result: Mapping, out_dir: str | Path, jobs: Mapping[str, Sequence],
                 per_image: Mapping, *, max_prompts: int = 48, thumb: int = 256) -> Path:
    """Write `render_report(...)` to `path` (UTF-8); returns the path."""
    path = Path(path)
    path.write_text(render_report(result, out_dir, jobs, per_image, max_prompts=max_prompts, thumb=thumb),
                    encoding="utf-8")
    return path

"""A self-contained HTML evaluation report (one file, inline CSS, thumbnails embedded as base64 JPEG),
so it works as a KFP HTML artifact, an MLflow artifact or an e-mail attachment.

Contents: the models and sampling settings; a summary table (trained / base / delta); per benchmark a
metrics table, the scorer/detector/judge information (preprocessing, scale, comparability) and, for
the first `max_prompts` prompts, base and trained images side by side with their per-image scores.
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
import io
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px;color:#222;max-width:1400px}
h1{font-size:22px}h2{font-size:18px;margin-top:32px;border-bottom:1px solid #ddd;padding-bottom:4px}
h3{font-size:15px;margin-top:20px}
table{border-collapse:collapse;margin:8px 0;font-size:13px}
th,td{border:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f4f4f4}td.num{text-align:right;font-variant-numeric:tabular-nums}
.pos{color:#0a7d28}.neg{color:#b00020}.muted{color:#777;font-size:12px}
.ok{background:#e8f5e9}.warn{background:#fff8e1}
table.pairs td{text-align:center}table.pairs td.prompt{text-align:left;max-width:320px}
table.pairs img{display:block;margin:0 auto 4px auto;border:1px solid #ccc}
.thumbs img{display:inline-block;margin:1px}
.badge{display:inline-block;padding:0 4px;border-radius:3px;font-size:11px}
.badge.t{background:#e8f5e9;color:#0a7d28}.badge.f{background:#fdecea;color:#b00020}
code{font-size:12px}
"""

LABEL_ORDER = ("base", "trained")


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _fmt(x: Any, digits: int = 4) -> str:
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, (int, float)):
        if isinstance(x, float) and not math.isfinite(x):
            return "nan"
        return f"{x:.{digits}f}" if isinstance(x, float) else str(x)
    return _e(x)


def _delta(t: Any, b: Any, digits: int = 4) -> str:
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in (t, b)):
        return "<td class=num>–</td>"
    d = t - b
    cls = "pos" if d > 0 else "neg" if d < 0 else ""
    return f"<td class='num {cls}'>{d:+.{digits}f}</td>"


def thumbnail(path: Path, size: int = 256, quality: int = 80) -> str | None:
    """A data: URI JPEG of the image, longest side at most `size` (None if the file is missing)."""
    from PIL import Image

    if not path.exists():
        return None
    with Image.open(path) as im:
        im = im.convert("RGB")
        im.thumbnail((size, size))
        buf = io.BytesIO()
        im.save(buf, "JPEG", quality=quality)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _img(path: Path, size: int, title: str = "") -> str:
    uri = thumbnail(path, size)
    if uri is None:
        return "<span class=muted>missing</span>"
    return f"<img src='{uri}' width='{size}' title='{_e(title)}' alt='{_e(title)}'>"


def _kv_table(rows: Mapping[str, Any]) -> str:
    body = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v if not isinstance(v, (dict, list)) else json.dumps(v))}</td></tr>"
                   for k, v in rows.items() if v not in (None, "", [], {}))
    return f"<table>{body}</table>"


def _labels(result: Mapping) -> list[str]:
    return [lb for lb in LABEL_ORDER if lb in result.get("labels", [])]


def _summary(result: Mapping) -> str:
    metrics = result.get("metrics") or {}
    labels = _labels(result)
    stems = list(dict.fromkeys(k.rsplit(".", 1)[0] for k in metrics))
    if not stems:
        return "<p class=muted>No metrics (images generated only).</p>"
    head = "".join(f"<th>{_e(lb)}</th>" for lb in labels) + ("<th>trained − base</th>" if len(labels) == 2 else "")
    rows = []
    for s in stems:
        cells = "".join(f"<td class=num>{_fmt(metrics.get(f'{s}.{lb}'))}</td>" for lb in labels)
        if len(labels) == 2:
            cells += _delta(metrics.get(f"{s}.trained"), metrics.get(f"{s}.base"))
        rows.append(f"<tr><td>{_e(s)}</td>{cells}</tr>")
    return f"<table><tr><th>metric</th>{head}</tr>{''.join(rows)}</table>"


def _comparable(b: Mapping) -> str:
    if b.get("comparable_to_official"):
        return "<p class=ok>Comparable with published numbers (official prompts, protocol and models).</p>"
    notes = b.get("comparable_notes") or []
    return ("<p class=warn><b>Not comparable with published numbers:</b> " + _e("; ".join(notes)) + "</p>"
            if notes else "")


# ------------------------------------------------------------------------------------------- hpdv2


def _hpdv2(result: Mapping, b: Mapping, out: Path, jobs: Sequence, per_image: Mapping, max_prompts: int,
           thumb: int) -> str:
    labels = _labels(result)
    res = b.get("results") or {}
    parts = []
    if res:
        names = list(next(iter(res.values()))["scorers"])
        head = "".join(f"<th>{_e(lb)} mean ± s.e.</th>" for lb in labels)
        rows = []
        for n in names:
            cells = ""
            for lb in labels:
                s = res.get(lb, {}).get("scorers", {}).get(n, {})
                cells += f"<td class=num>{_fmt(s.get('mean'))} ± {_fmt(s.get('stderr'))}</td>"
            if len(labels) == 2:
                cells += _delta(res["trained"]["scorers"][n]["mean"], res["base"]["scorers"][n]["mean"])
            n_img = next(iter(res.values()))["scorers"][n]["n"]
            rows.append(f"<tr><td>{_e(n)}</td>{cells}<td class=num>{n_img}</td></tr>")
        extra = "<th>trained − base</th>" if len(labels) == 2 else ""
        parts.append(f"<table><tr><th>scorer</th>{head}{extra}<th>n</th></tr>{''.join(rows)}</table>")
        infos = result.get("scorers") or {}
        info_rows = "".join(
            f"<tr><td>{_e(n)}</td><td>{_e(i.get('backend', ''))}</td><td>{_e(i.get('preprocessing', ''))}</td>"
            f"<td>{_e(i.get('scale', ''))}</td><td>{_e(i.get('weights', i.get('options', '')))}</td></tr>"
            for n, i in infos.items() if n in names)
        parts.append("<h3>Scorers</h3><table><tr><th>scorer</th><th>backend</th><th>preprocessing</th><th>scale</th>"
                     f"<th>weights / options</th></tr>{info_rows}</table>")
    parts.append(_comparable(b))
    shown = list(jobs)[:max_prompts]
    if shown:
        parts.append(f"<h3>Images (first {len(shown)} of {len(jobs)} prompts; same seed per row)</h3>")
        head = "".join(f"<th>{_e(lb)}</th>" for lb in labels)
        rows = []
        for i, j in enumerate(shown):
            cells = ""
            for lb in labels:
                scores = {n: v[i] for n, v in (per_image.get(lb) or {}).items()}
                txt = " · ".join(f"{n} {_fmt(v, 3)}" for n, v in scores.items())
                cells += f"<td>{_img(out / 'hpdv2' / lb / j.rel, thumb, j.prompt)}<span class=muted>{_e(txt)}</span></td>"
            rows.append(f"<tr><td class=prompt><b>#{_e(j.key)}</b> <span class=muted>seed {j.seed}</span><br>"
                        f"{_e(j.prompt)}</td>{cells}</tr>")
        parts.append(f"<table class=pairs><tr><th>prompt</th>{head}</tr>{''.join(rows)}</table>")
    return "".join(parts)


# ------------------------------------------------------------------------------------------ geneval


def _geneval(result: Mapping, b: Mapping, out: Path, jobs: Sequence, records: Mapping, max_prompts: int,
             thumb: int) -> str:
    labels = _labels(result)
    res = b.get("results") or {}
    parts = []
    if res:
        first = next(iter(res.values()))
        tags = list(first["tasks"])
        head = "".join(f"<th>{_e(lb)}</th>" for lb in labels) + ("<th>trained − base</th>" if len(labels) == 2 else "")
        rows = []
        for tag in ["overall", *tags]:
            vals = {lb: (res[lb]["overall"] if tag == "overall" else res[lb]["tasks"].get(tag, {}).get("score"))
                    for lb in labels if lb in res}
            cells = "".join(f"<td class=num>{_fmt(vals.get(lb))}</td>" for lb in labels)
            if len(labels) == 2:
                cells += _delta(vals.get("trained"), vals.get("base"))
            rows.append(f"<tr><td>{'<b>overall</b>' if tag == 'overall' else _e(tag)}</td>{cells}</tr>")
        parts.append(f"<table><tr><th>task</th>{head}</tr>{''.join(rows)}</table>")
        parts.append("<h3>Detector</h3>" + _kv_table(first.get("detector") or {}))
    parts.append(_comparable(b))
    correct = {lb: {r.get("filename"): r.get("correct") for r in (records.get(lb) or [])} for lb in labels}
    by_prompt: dict[str, list] = {}
    for j in jobs:
        by_prompt.setdefault(j.key.split(":")[0], []).append(j)
    keys = list(by_prompt)[:max_prompts]
    if keys:
        small = max(48, thumb // 2)
        parts.append(f"<h3>Images (first {len(keys)} of {len(by_prompt)} prompts)</h3>")
        head = "".join(f"<th>{_e(lb)}</th>" for lb in labels)
        rows = []
        for k in keys:
            js = by_prompt[k]
            cells = ""
            for lb in labels:
                ims = []
                for j in js:
                    rel = f"geneval/{lb}/{j.rel}"
                    c = correct[lb].get(rel)
                    badge = "" if c is None else f"<span class='badge {'t' if c else 'f'}'>{'✓' if c else '✗'}</span>"
                    ims.append(f"<span>{_img(out / rel, small, j.prompt)}{badge}</span>")
                cells += f"<td class=thumbs>{''.join(ims)}</td>"
            rows.append(f"<tr><td class=prompt><b>#{_e(k)}</b> <span class=muted>{_e(js[0].group)}</span><br>"
                        f"{_e(js[0].prompt)}</td>{cells}</tr>")
        parts.append(f"<table class=pairs><tr><th>prompt</th>{head}</tr>{''.join(rows)}</table>")
    return "".join(parts)


# --------------------------------------------------------------------------------------------- wise


def _wise(result: Mapping, b: Mapping, out: Path, jobs: Sequence, records: Mapping, max_prompts: int,
          thumb: int) -> str:
    labels = _labels(result)
    res = b.get("results") or {}
    parts = []
    if res:
        cats = list(dict.fromkeys(c for r in res.values() for c in (r.get("categories") or {})))
        head = "".join(f"<th>{_e(lb)}</th>" for lb in labels) + ("<th>trained − base</th>" if len(labels) == 2 else "")
        rows = []
        for cat in ["overall", *cats]:
            vals = {lb: (res[lb].get("overall") if cat == "overall" else
                         (res[lb].get("categories") or {}).get(cat, {}).get("wiscore")) for lb in labels if lb in res}
            cells = "".join(f"<td class=num>{_fmt(vals.get(lb))}</td>" for lb in labels)
            if len(labels) == 2:
                cells += _delta(vals.get("trained"), vals.get("base"))
            rows.append(f"<tr><td>{_e(cat)}</td>{cells}</tr>")
        parts.append(f"<table><tr><th>category (WiScore)</th>{head}</tr>{''.join(rows)}</table>")
        first = next(iter(res.values()))
        parts.append("<h3>Judge</h3>" + _kv_table({**(first.get("judge") or {}), "variant": first.get("variant"),
                                                   "failed": sum(r.get("n_failed", 0) for r in res.values())}))
    parts.append(_comparable(b))
    score = {lb: {Path(str(r.get("image", ""))).name: r.get("wiscore") for r in (records.get(lb) or [])}
             for lb in labels}
    shown = list(jobs)[:max_prompts]
    if shown:
        parts.append(f"<h3>Images (first {len(shown)} of {len(jobs)} prompts)</h3>")
        head = "".join(f"<th>{_e(lb)}</th>" for lb in labels)
        rows = []
        for j in shown:
            cells = "".join(
                f"<td>{_img(out / 'wise' / lb / j.rel, thumb, j.prompt)}"
                f"<span class=muted>WiScore {_fmt(score[lb].get(j.rel), 3)}</span></td>" for lb in labels)
            rows.append(f"<tr><td class=prompt><b>#{_e(j.key)}</b> <span class=muted>{_e(j.group)}</span><br>"
                        f"{_e(j.prompt)}</td>{cells}</tr>")
        parts.append(f"<table class=pairs><tr><th>prompt</th>{head}</tr>{''.join(rows)}</table>")
    return "".join(parts)


# -------------------------------------------------------------------------------------------- page

_SECTIONS = {"hpdv2": ("HPDv2 test", _hpdv2), "geneval": ("GenEval", _geneval), "wise": ("WISE", _wise)}


def render_report(result: Mapping, out_dir: str | Path, jobs: Mapping[str, Sequence], per_image: Mapping,
                  *, max_prompts: int = 48, thumb: int = 256) -> str:
    """The report as one HTML string. `jobs[bench]` lists the images (objects with key, prompt, seed, rel,
    group); `per_image[bench]` the per-image scores / records per label."""
    out = Path(out_dir)
    models = result.get("models") or {}
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>chunkgrpo evaluation</title>"
             f"<style>{CSS}</style></head><body>",
             "<h1>chunkgrpo evaluation</h1>",
             f"<p class=muted>generated {_e(_dt.datetime.now(_dt.timezone.utc).isoformat(timespec='seconds'))}"
             + (f" · MLflow run {_e(result['mlflow_run_id'])}" if result.get("mlflow_run_id") else "")
             + (f" · {_e(result['output_uri'])}" if result.get("output_uri") else "") + "</p>",
             "<h2>Models</h2>"]
    for lb in ("trained", "base"):
        if lb in models:
            parts.append(f"<h3>{_e(lb)}</h3>" + _kv_table(models[lb]))
    parts.append("<h3>Sampling</h3>" + _kv_table({**(result.get("sampling") or {}), "seed": result.get("seed")}))
    gen = result.get("generation") or {}
    if gen:
        parts.append("<h3>Generation</h3>" + _kv_table(gen))
    parts.append("<h2>Summary</h2>" + _summary(result))
    for bench, b in (result.get("benchmarks") or {}).items():
        title, fn = _SECTIONS[bench]
        n = b.get("n_prompts")
        parts.append(f"<h2 id='{_e(bench)}'>{_e(title)} <span class=muted>({_e(n)} prompts)</span></h2>")
        parts.append(fn(result, b, out, jobs.get(bench, []), per_image.get(bench) or {}, max_prompts, thumb))
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(path: str | Path, result: Mapping, out_dir: str | Path, jobs: Mapping[str, Sequence],
                 per_image: Mapping, *, max_prompts: int = 48, thumb: int = 256) -> Path:
    path = Path(path)
    path.write_text(render_report(result, out_dir, jobs, per_image, max_prompts=max_prompts, thumb=thumb),
                    encoding="utf-8")
    return path

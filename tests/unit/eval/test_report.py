"""The HTML report: neutral rendering of deltas whose CI contains 0, CI bars and histograms, rows chosen by
the largest changes in both directions, GenEval boxes + failure reasons, WISE sub-scores + judge answers,
one self-contained file."""

from __future__ import annotations

import base64
import io
import json
import re
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from chunkgrpo.eval import plots as P
from chunkgrpo.eval import report as R


def cell(delta, lo, hi, **kw):
    return {"delta": delta, "ci_low": lo, "ci_high": hi, "level": 0.95, "win_rate": 0.5, "win_ci_low": 0.4,
            "win_ci_high": 0.6, "tie_rate": 0.1, "n": 40, **kw}


def test_delta_cell_is_neutral_when_the_ci_contains_zero():
    neutral = R.delta_cell(cell(0.05, -0.01, 0.11))
    assert "class='num neutral'" in neutral and "+0.0500" in neutral and "[-0.0100, +0.1100]" in neutral
    assert "class='num pos'" in R.delta_cell(cell(0.05, 0.01, 0.11))
    assert "class='num neg'" in R.delta_cell(cell(-0.05, -0.11, -0.01))
    assert "class='num neutral'" in R.delta_cell(cell(0.05, 0.0, 0.11))  # touching 0 is not significant
    assert R.delta_cell(None) == "<td class=num>–</td>"
    few = R.delta_cell({"delta": 0.7, "ci_low": None, "ci_high": None, "note": "1 pairs (< 5): no interval"})
    assert "class='num neutral'" in few and "+0.7000" in few and "no interval" in few


def test_ci_bars_colour_by_significance():
    svg = P.svg_delta_bars([("up", cell(0.3, 0.1, 0.5)), ("flat", cell(0.1, -0.2, 0.4)),
                            ("down", cell(-0.3, -0.5, -0.1))], title="t")
    rects = re.findall(r"<rect x='[\d.]+' y='[\d.]+' width='[\d.]+' height='[\d.]+' fill='(#\w+)'", svg)
    assert rects == [P.SIG_COLOR[1], P.SIG_COLOR[0], P.SIG_COLOR[-1]]
    # whiskers: three line segments per row in the row's colour
    assert svg.count(f"stroke='{P.SIG_COLOR[0]}'") == 3
    assert P.svg_delta_bars([("x", cell(None, None, None))]) == ""


def test_histogram_has_both_labels():
    svg = P.svg_histogram(
        {"base": [0.1, 0.2, 0.2, 0.9], "trained": [0.5, 0.6, float("nan")]}, title="h", bins=4
    )
    assert "base (n=4)" in svg and "trained (n=2)" in svg
    assert svg.count(P.COLORS["base"]) >= 2 and svg.count(P.COLORS["trained"]) >= 2


def test_pick_rows_largest_changes_both_directions():
    changes = {"a": 0.5, "b": -2.0, "c": 0.0, "d": 3.0, "e": -0.1, "f": 1.0, "g": float("nan")}
    up, down, same = R.pick_rows(changes, 4)
    assert up == ["d", "f"] and down == ["b", "e"] and same == []
    up, down, _ = R.pick_rows({"a": 1.0, "b": 2.0, "c": 3.0, "d": -1.0}, 4)  # only one regression: 3 + 1
    assert up == ["c", "b", "a"] and down == ["d"]
    assert R.pick_rows({"a": 0.0, "b": 0.0}, 4) == ([], [], ["a", "b"])


@pytest.fixture()
def report_inputs(tmp_path):
    """A synthetic two-label result over 3 HPDv2 prompts, 2 GenEval prompts x 2 samples, 2 WISE prompts."""
    out = tmp_path
    jobs = {"hpdv2": [], "geneval": [], "wise": []}
    for i in range(3):
        for lb in ("base", "trained"):
            (out / "hpdv2" / lb).mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (32, 32), (i * 60, 0, 0)).save(out / "hpdv2" / lb / f"{i:03d}.png")
        jobs["hpdv2"].append(
            SimpleNamespace(key=str(i), prompt=f"hp prompt {i}", seed=42 + i, rel=f"{i:03d}.png", group="")
        )
    recs = {"base": [], "trained": []}
    for idx, tag in ((0, "colors"), (1, "single_object")):
        for k in range(2):
            rel = f"{idx:05d}/samples/{k:05d}.png"
            jobs["geneval"].append(
                SimpleNamespace(key=f"{idx}:{k}", prompt=f"ge prompt {idx}", seed=42 + k, rel=rel, group=tag)
            )
            for lb in ("base", "trained"):
                p = out / "geneval" / lb / rel
                p.parent.mkdir(parents=True, exist_ok=True)
                Image.new("RGB", (64, 64), (0, 0, 0)).save(p)
                correct = (lb == "trained") if idx == 0 else (lb == "base")
                recs[lb].append({"filename": f"geneval/{lb}/{rel}", "tag": tag, "prompt": f"ge prompt {idx}",
                                 "correct": correct,
                                 "reason": "" if correct else "expected red car>=1, found 0 red; and 1 blue",
                                 "details": json.dumps({"car": [[8.0, 8.0, 56.0, 56.0, 0.87]]})})
    wrecs = {"base": [], "trained": []}
    for pid in (1, 401):
        jobs["wise"].append(
            SimpleNamespace(
                key=str(pid),
                prompt=f"wise prompt {pid}",
                seed=42 + pid,
                rel=f"{pid}.png",
                group="culture" if pid == 1 else "time",
            )
        )
        for lb in ("base", "trained"):
            (out / "wise" / lb).mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (32, 32)).save(out / "wise" / lb / f"{pid}.png")
            c = 2 if (lb == "trained") == (pid == 1) else 0
            wrecs[lb].append(
                {
                    "prompt_id": pid,
                    "category": "culture" if pid == 1 else "time",
                    "consistency": c,
                    "realism": 1,
                    "aesthetic_quality": 1,
                    "wiscore": (0.7 * c + 0.3) / 2,
                    "answer": f"Consistency: {c}\nRealism: 1\nAesthetic Quality: 1 <b>bold</b>",
                    "image": f"wise/{lb}/{pid}.png",
                }
            )
    per_image = {"hpdv2": {"base": {"hpsv3": [1.0, 2.0, 3.0]}, "trained": {"hpsv3": [1.5, 1.0, 3.0]}},
                 "geneval": recs, "wise": wrecs}
    res_g = {
        lb: {
            "overall": 0.5,
            "tasks": {"colors": {"score": 0.5}, "single_object": {"score": 0.5}},
            "detector": {"name": "tiny"},
            "color_classifier": {"name": "clip"},
        }
        for lb in ("base", "trained")
    }
    res_w = {lb: {"overall": 0.5, "categories": {"culture": {"wiscore": 0.5, "mean_consistency": 1.0},
                                                   "time": {"wiscore": 0.5}},
                  "judge": {"model": "stub"}, "n_failed": 0} for lb in ("base", "trained")}
    res_h = {lb: {"scorers": {"hpsv3": {"mean": 2.0, "stderr": 0.5, "n": 3}}} for lb in ("base", "trained")}
    result = {
        "labels": ["trained", "base"],
        "metrics": {
            "hpdv2.hpsv3.trained": 1.8333,
            "hpdv2.hpsv3.base": 2.0,
            "geneval.overall.trained": 0.5,
            "geneval.overall.base": 0.5,
            "wise.overall.trained": 0.5,
            "wise.overall.base": 0.5,
        },
        "benchmarks": {
            "hpdv2": {
                "n_prompts": 3,
                "results": res_h,
                "statistics": {"hpsv3": cell(-0.1667, -0.6, 0.3)},
                "comparable_to_official": False,
                "comparable_notes": ["3 of 400 prompts"],
            },
            "geneval": {
                "n_prompts": 2,
                "results": res_g,
                "statistics": {"overall": cell(0.0, -0.5, 0.5), "colors": cell(1.0, 1.0, 1.0)},
                "comparable_to_official": False,
                "comparable_notes": ["2 of 553 prompts"],
            },
            "wise": {
                "n_prompts": 2,
                "results": res_w,
                "statistics": {"overall": cell(0.0, -0.7, 0.7)},
                "comparable_to_official": False,
                "comparable_notes": [
                    "2 of 1000 WISE prompt ids evaluated (the official Calculate.py needs all 1000)"
                ],
            },
        },
    }
    return result, out, jobs, per_image


def test_report_renders_everything_self_contained(report_inputs):
    result, out, jobs, per_image = report_inputs
    html = R.render_report(result, out, jobs, per_image, max_prompts=4, thumb=64)
    # self-contained: no scripts, no external references
    assert "<script" not in html and "src='http" not in html and 'src="http' not in html
    assert "src='hpdv2/" not in html and "src='geneval/" not in html
    # summary with CIs; the CI containing 0 is neutral, the colors one (CI [1, 1]) green
    assert "class='num neutral'" in html and "class='num pos'" in html
    assert html.count("<svg") >= 6  # CI bars + histograms for the three benchmarks
    # comparability reasons are spelled out
    assert "2 of 1000 WISE prompt ids evaluated" in html and "Not comparable" in html
    # rows by the largest changes in both directions
    assert "Largest improvements (by hpsv3)" in html and "Largest regressions (by hpsv3)" in html
    hp = html.split("id='hpdv2'")[1].split("id='geneval'")[0]
    assert hp.index("hp prompt 0") < hp.index(
        "hp prompt 1"
    )  # +0.5 improvement listed before the -1.0 regression
    assert "hp prompt 2" not in hp.split("Largest improvements")[1]  # unchanged prompt not shown
    ge = html.split("id='geneval'")[1].split("id='wise'")[0]
    assert "Largest improvements (share of correct images)" in ge and "Largest regressions" in ge
    assert "expected red car&gt;=1, found 0 red; and 1 blue" in ge  # the failure reason under the image
    assert "correct: base 0/2 → trained 2/2" in ge
    # WISE: sub-scores and the judge's answer (escaped)
    ws = html.split("id='wise'")[1]
    assert "C 2 R 1 A 1" in ws and "<pre class=answer" in ws and "&lt;b&gt;bold&lt;/b&gt;" in ws
    assert "ΔWiScore +0.700" in ws and "ΔWiScore -0.700" in ws


def test_geneval_thumbnails_show_the_detected_boxes(report_inputs):
    result, out, jobs, per_image = report_inputs
    rec = per_image["geneval"]["trained"][0]
    uri = R.thumbnail(out / rec["filename"], 64, boxes=R._boxes(rec))
    im = np.asarray(Image.open(io.BytesIO(base64.b64decode(uri.split(",", 1)[1]))).convert("RGB")).astype(int)
    plain = np.asarray(
        Image.open(
            io.BytesIO(base64.b64decode(R.thumbnail(out / rec["filename"], 64).split(",", 1)[1]))
        ).convert("RGB")
    ).astype(int)
    assert plain.max() < 20  # the sample is black
    edge = im[30, 7:10]  # the left edge of the box (x1 = 8) on a black image
    assert (
        edge[:, 0].max() > 150 and (edge[:, 0] - edge[:, 2]).max() > 60
    )  # drawn in the first (red) box colour
    assert R._boxes(rec)[0][0] == "car 0.87"


def _pixels(uri: str) -> np.ndarray:
    image = Image.open(io.BytesIO(base64.b64decode(uri.split(",", 1)[1])))
    return np.asarray(image.convert("RGB")).astype(int)


def test_geneval_labels_stand_beside_the_image_not_over_it(report_inputs, tmp_path):
    """A 32×32 toy sample is too small to carry its labels: the box is outlined on it, the label (class and
    confidence) is text beside it."""
    result, out, jobs, per_image = report_inputs
    rec = per_image["geneval"]["trained"][0]
    im = _pixels(R.thumbnail(out / rec["filename"], 64, boxes=R._boxes(rec)))
    assert im[12:18, 14:30].max() < 40  # inside the box's top-left corner: the black scene, no label over it
    small = tmp_path / "small.png"
    Image.new("RGB", (32, 32)).save(small)
    px = _pixels(R.thumbnail(small, 64, boxes=[("car 0.87", (4, 4, 28, 28), "#e6194b")]))
    assert px.shape[:2] == (32, 32) and px[4, 10, 0] > 100 and px[4, 10, 0] - px[4, 10, 2] > 50  # the box
    assert px[8:24, 8:24].max() < 40  # and nothing else on the scene
    html = R.render_report(result, out, jobs, per_image, max_prompts=4, thumb=64)
    ge = html.split("id='geneval'")[1].split("id='wise'")[0]
    assert "<span class=labels><span style='color:#e6194b'>■</span> car 0.87<br></span>" in ge

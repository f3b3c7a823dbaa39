"""plan: python_func on a synthetic profile (no KFP runtime)."""

import json

from components.conftest import tiny_profile
from components.plan.component import plan


def test_uniform_plan_report_and_sizes(artifact):
    prof = artifact("profile.json", json.dumps(tiny_profile(16)))
    out, report, plot = artifact("plan.json"), artifact("report.md"), artifact("plot.html")
    spec = plan.python_func(profile_json=prof, chunks="uniform:5", plan_json=out, report=report, plot=plot)
    assert spec == "sizes:5,5,5"  # 16 steps -> 15 trainable transitions
    assert json.loads(open(out.path).read())["sizes"] == [5, 5, 5] and out.metadata["sizes"] == [5, 5, 5]
    md = open(report.path).read()
    assert md.startswith("# Chunk plan") and "| 2 | " in md
    page = open(plot.path).read()  # the KFP UI renders this HTML: the PNG inline, the rationale, the chunks
    assert page.startswith("<!DOCTYPE html>") and '<img src="data:image/png;base64,iVBORw0KGgo' in page
    assert "sizes [5, 5, 5]" in page and "<td>2</td><td>10-14</td><td>5</td>" in page


def test_dynamics_plan_covers_every_trainable_step(artifact):
    prof = artifact("profile.json", json.dumps(tiny_profile(16)))
    spec = plan.python_func(profile_json=prof, chunks="dynamics", plan_json=artifact("p.json"),
                            report=artifact("r.md"), plot=artifact("p.html"))
    assert sum(int(s) for s in spec.removeprefix("sizes:").split(",")) == 15

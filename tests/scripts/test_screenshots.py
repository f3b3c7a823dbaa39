"""scripts/screenshots.py's pieces that need no browser: the plan's Markdown rendered as the KFP UI shows it
(tables included, text escaped), and the newest local run that holds the profile and plan outputs."""

from __future__ import annotations

import os

import pytest

from scripts import screenshots


def test_markdown_page_renders_tables_and_escapes_the_title():
    page = screenshots.markdown_page("# Plan\n\n| chunk | steps |\n|---|---|\n| 1 | 0-3 |\n", "a <plan>")
    assert "<table>" in page and "<td>0-3</td>" in page and "<h1>Plan</h1>" in page
    assert "<title>a &lt;plan&gt;</title>" in page


def test_latest_run_dir_is_the_newest_with_a_plan_report(tmp_path):
    with pytest.raises(SystemExit, match="no local pipeline run"):
        screenshots.latest_run_dir(tmp_path)
    for i, name in enumerate(("run-a", "run-b")):
        report = tmp_path / "outputs" / name / "plan" / "report"
        report.parent.mkdir(parents=True)
        report.write_text("# plan\n")
        os.utime(report.parent.parent, (1000 + i, 1000 + i))
    (tmp_path / "outputs" / "run-c" / "profile").mkdir(parents=True)  # newer, but no plan report
    assert screenshots.latest_run_dir(tmp_path) == tmp_path / "outputs" / "run-b"

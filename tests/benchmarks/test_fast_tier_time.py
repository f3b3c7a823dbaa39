"""benchmarks/fast_tier_time.py: the fast tier's selection, and the counts and per-file times it reads from
pytest's JUnit report."""

from tests.benchmark_scripts import load

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.unit.test_a" name="t1" time="1.5"/>
<testcase classname="tests.unit.test_a.TestX" name="t2" time="0.5"><skipped message="no"/></testcase>
<testcase classname="tests.unit.test_b" name="t3" time="2.0"><failure message="x"/></testcase>
</testsuite></testsuites>"""


def test_it_runs_the_fast_tier_and_counts_every_outcome(tmp_path):
    ft = load("fast_tier_time")
    assert ft.OPTIONS[ft.OPTIONS.index("-m") + 1] == "not integration and not reward_envs"
    assert ft.OPTIONS[ft.OPTIONS.index("-n") + 1] == "2"
    (tmp_path / "j.xml").write_text(JUNIT)
    outcomes, per_file = ft.summarize(tmp_path / "j.xml")
    assert dict(outcomes) == {"passed": 1, "skipped": 1, "failure": 1}
    assert per_file == {"tests.unit.test_a": 2.0, "tests.unit.test_b": 2.0}

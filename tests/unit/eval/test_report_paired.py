"""Every number sent to MLflow and the registry is the paired one (issue 24 items 2-3): the flat
`<bench>.<metric>.delta` is the delta of the same pairs as its CI, the report tables show the paired
means beside it, and a CI bound that is 0 in exact arithmetic neither renders significant nor passes a
gate with margin 0."""

from __future__ import annotations

import pytest

from chunkgrpo.eval import report as R
from chunkgrpo.eval import stats as eval_stats
from chunkgrpo.eval import wise as W
from chunkgrpo.registry.gate import GateConfig, gate_decision

KW = {"samples": 2000, "seed": 0, "level": 0.95}


def _wise_benchmark(trained_scores: dict, base_scores: dict) -> dict:
    """A WISE benchmark entry as the runner builds it (results + statistics) from
    {prompt_id: (C, R, A) or None}."""
    records = {}
    for lb, scores in (("trained", trained_scores), ("base", base_scores)):
        recs = []
        for pid, s in scores.items():
            r = {"prompt_id": pid, "category": W.category_of(pid)}
            if s is None:
                r["error"] = "unparsable answer"
            else:
                r.update(dict(zip(W.SCORE_KEYS, s)), wiscore=W.wiscore(*s))
            recs.append(r)
        records[lb] = recs
    results = {
        lb: {k: v for k, v in W.aggregate(recs).items() if k != "records"} for lb, recs in records.items()
    }
    stats = eval_stats.compute_statistics("wise", records, results, **KW)
    return {"results": results, "statistics": stats}


def test_flat_delta_is_the_paired_delta_with_failed_trained_judgements():
    """50 biology prompts; 20 % of the trained judgements failed, on prompts where the base scored high.
    Unpaired, trained − base is about −0.07; the pairs (each prompt +0.05) say +0.05 with a tight CI."""
    ids = range(701, 751)
    failed = set(range(701, 711))
    base = {i: ((2, 2, 1) if i in failed else (1, 0, 0)) for i in ids}        # WiScore 0.95 / 0.35
    trained = {i: (None if i in failed else (1, 0, 1)) for i in ids}           # 0.40 where judged
    bench = _wise_benchmark(trained, base)
    flat = eval_stats.flat_metrics({"wise": bench})
    cell = bench["statistics"]["biology"]
    assert cell["n"] == 40 and cell["n_dropped"] == 10
    for m in ("biology", "overall"):
        d = flat[f"wise.{m}.delta"]
        c = bench["statistics"][m]
        assert c["ci_low"] <= d <= c["ci_high"], (m, d, c["ci_low"], c["ci_high"])
        assert d == pytest.approx(c["mean_trained"] - c["mean_base"]) and d == c["delta"]
        assert d == pytest.approx(0.05)
    # each model's own (unpaired) mean is still reported as it is: the number a paper would print
    assert flat["wise.biology.base"] == pytest.approx(0.8 * 0.35 + 0.2 * 0.95)
    assert flat["wise.biology.trained"] == pytest.approx(0.40)


def test_report_tables_show_the_paired_means_beside_the_paired_delta():
    ids = range(701, 751)
    failed = set(range(701, 711))
    bench = _wise_benchmark({i: (None if i in failed else (1, 0, 1)) for i in ids},
                            {i: ((2, 2, 1) if i in failed else (1, 0, 0)) for i in ids})
    html = R.delta_cell(bench["statistics"]["biology"])
    assert "+0.0500" in html
    assert "paired means 0.3500 → 0.4000 (n=40)" in html


def test_a_tie_with_float_residue_is_not_significant_in_report_and_gate():
    """WISE biology: 15 prompts tie (sub-scores (1, 2, 0) vs (1, 1, 2): WiScore 0.45 both, 1.1e-16 apart in
    floats), 3 improve. The lower bound is 0: grey in the report, refused by a gate with margin 0."""
    ids = list(range(701, 721))
    trained = (
        {i: (1, 2, 0) for i in ids[:15]}
        | {i: (2, 2, 2) for i in ids[15:18]}
        | {i: (0, 0, 0) for i in ids[18:]}
    )
    base = (
        {i: (1, 1, 2) for i in ids[:15]}
        | {i: (1, 1, 1) for i in ids[15:18]}
        | {i: (0, 0, 0) for i in ids[18:]}
    )
    bench = _wise_benchmark(trained, base)
    cell = bench["statistics"]["biology"]
    assert cell["ci_low"] == 0.0 and cell["significance"] == 0
    assert "class='num neutral'" in R.delta_cell(cell)
    flat = eval_stats.flat_metrics({"wise": bench})
    assert flat["wise.biology.delta_ci_low"] == 0.0
    gate = GateConfig(metric="eval.wise.biology.delta_ci_low", margin=0.0)
    assert not gate_decision(flat["wise.biology.delta_ci_low"], None, gate).passed

"""WISE parity with the official `extract_scores` (WISE_legacy/gpt_eval.py) on every input: the last match of
each name wins, values are taken as given (also outside 0-2, one digit as the regex captures), and only
when no name matched at all do the first three bare 0/1/2 lines count. Checked against a committed table
of answers whose expected outputs come from running the official function (its code is not shipped: no
licence). The strict parser (the project's earlier behaviour) stays available. Also: refusals and
malformed answers over real HTTP, and comparability of partial runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from chunkgrpo.eval import wise as W
from tests.unit.eval.judge_server import JudgeServer

GOOD = "Consistency: 2\nRealism: 1\nAesthetic Quality: 1"


CASES = Path(__file__).with_name("wise_extract_scores_cases.json")


def _tuple(d):
    return None if d is None else tuple(d[k] for k in W.SCORE_KEYS)


def test_official_parser_matches_extract_scores_on_the_committed_table():
    """Every answer of the table (issue examples, edge cases, 2,000 generated answers) reads exactly as the
    official function read it - scores or an incomplete answer the official retries."""
    table = json.loads(CASES.read_text(encoding="utf-8"))["cases"]
    assert len(table) > 2000 and sum(c["official"] is None for c in table) > 900
    wrong = [
        (c["text"], c["official"], _tuple(W.parse_scores(c["text"])))
        for c in table
        if _tuple(W.parse_scores(c["text"])) != (None if c["official"] is None else tuple(c["official"]))
    ]
    assert not wrong, f"{len(wrong)} answers differ from the official, e.g. {wrong[:3]}"


@pytest.mark.parametrize("text,official", [
    ("Consistency: 2\n1\n1\n0", None),   # a name matched: no fallback, two names missing -> retried
    ("2\n1\n0\n1", (2, 1, 0)),            # the FIRST three bare lines
    ("3\n1\n0", None),                    # a bare line must be 0, 1 or 2
])
def test_issue_examples(text, official):
    assert _tuple(W.parse_scores(text)) == official


@pytest.mark.parametrize("text,official,strict", [
    # last match wins (official) vs first match (strict)
    ("Consistency: 1\nRealism: 1\nAesthetic Quality: 1\nOn reflection:\nConsistency: 2",
     (2, 1, 1), (1, 1, 1)),
    # out of range: the official keeps the value as given
    ("Consistency: 3\nRealism: 1\nAesthetic Quality: 1", (3, 1, 1), None),
    # one digit only, as the official regex `(\d)` captures: '10' reads as 1
    ("Consistency: 10\nRealism: 0\nAesthetic Quality: 0", (1, 0, 0), (1, 0, 0)),
    # bare lines among other text: the official falls back to them; strict needs exactly three lines
    ("Here is my assessment of the image.\n2\n1\n0\nThank you.", (2, 1, 0), None),
    # bold digits are not bare lines for the official; strict strips the '*'
    ("**2**\n**1**\n**1**", None, (2, 1, 1)),
    # more than three bare lines: the official takes the FIRST three 0-2 lines ('3' is not one)
    ("Steps considered: 4\n3\n1\n2\n0\n1", (1, 2, 0), None),
    # names present but one missing and no bare lines: unreadable for both
    ("Consistency: 2\nRealism: 1", None, None),
    # labels win over bare lines when all three are present
    ("7\nConsistency: 0\nRealism: 0\nAesthetic Quality: 1", (0, 0, 1), (0, 0, 1)),
    # a full-width colon is not the official ':' (strict accepts it)
    ("Consistency：2\nRealism：1\nAesthetic Quality：0", None, (2, 1, 0)),
    # the official does not remove <think> blocks: a name inside one blocks the bare-line fallback
    ("<think>Consistency: 1</think>\n2\n1\n0", None, (2, 1, 0)),
])
def test_parser_official_vs_strict(text, official, strict):
    assert _tuple(W.parse_scores(text)) == official
    assert _tuple(W.parse_scores(text, "official")) == official
    assert _tuple(W.parse_scores(text, "strict")) == strict


def test_out_of_range_values_flow_into_wiscore_as_given():
    s = W.parse_scores("Consistency: 3\nRealism: 2\nAesthetic Quality: 2")
    assert W.out_of_range(s) == ["consistency"]
    assert W.wiscore(**s) == pytest.approx((0.7 * 3 + 0.2 * 2 + 0.1 * 2) / 2)  # 1.35 > 1, as the official


def test_refusal_detection():
    assert W.looks_like_refusal("I'm sorry, but I can't help with rating this image.")
    assert W.looks_like_refusal("Sorry, I cannot evaluate images of people.")
    assert not W.looks_like_refusal(GOOD)
    assert not W.looks_like_refusal("The image is sorry-looking.\n1\n1\n1")


@pytest.fixture()
def images(tmp_path):
    for i in range(1, 9):
        Image.new("RGB", (16, 16), (30 * i, 0, 0)).save(W.image_path(tmp_path, i))
    return tmp_path


def _prompts(n=8):
    return [W.WisePrompt(i, f"prompt {i}", f"explanation {i}", W.category_of(i)) for i in range(1, n + 1)]


def test_judge_over_http_official_parser_refusals_and_malformed(images):
    """Scripted judgements over real HTTP: official-parser answers, API refusals, textual refusals, malformed
    payloads (no choices, not JSON, 5xx), each retried; what still fails is listed, never dropped."""
    scripts = {
        "prompt 1": [GOOD],
        "prompt 2": [
            "Consistency: 0 Realism: 0 Aesthetic Quality: 0\nCorrection - Consistency: 1"
        ],  # last wins
        "prompt 3": ["Consistency: 3\nRealism: 2\nAesthetic Quality: 2"],  # out of range, kept
        "prompt 4": ["Let me rate it.\n1\n1\n0"],  # bare-line fallback
        "prompt 5": [{"refusal": "I can't assist with that."}, GOOD],  # refusal, then fine on retry
        "prompt 6": [{"refusal": "I can't assist with that."}],  # always refused
        "prompt 7": ["I'm sorry, I cannot rate this image."],  # textual refusal
        "prompt 8": ["<nochoices>", "<notjson>", 503],  # malformed twice, then a server error
    }
    sleeps = []
    with JudgeServer(scripts) as srv:
        cfg = W.JudgeConfig(base_url=srv.url, model="judge", max_attempts=3, backoff_s=0.01, workers=3)
        res = W.evaluate(_prompts(), images, W.JudgeClient(cfg, sleep=sleeps.append))
        counts = {i: srv.count(f"prompt {i}") for i in range(1, 9)}
    by = {r["prompt_id"]: r for r in res["records"]}
    assert (by[1]["consistency"], by[1]["realism"], by[1]["aesthetic_quality"]) == (2, 1, 1)
    assert by[2]["consistency"] == 1 and by[2]["attempts"] == 1
    assert by[3]["consistency"] == 3 and by[3]["out_of_range"] == ["consistency"]
    assert by[3]["wiscore"] == pytest.approx(1.35)
    assert (by[4]["consistency"], by[4]["realism"], by[4]["aesthetic_quality"]) == (1, 1, 0)
    assert by[5]["attempts"] == 2 and by[5]["wiscore"] == pytest.approx(W.wiscore(2, 1, 1))
    assert by[6]["refused"] is True and by[6]["error"] == "refused: I can't assist with that."
    assert by[6]["attempts"] == 3 and "wiscore" not in by[6]
    assert (
        by[7]["refused"] is True
        and by[7]["error"].startswith("refused")
        and by[7]["answer"].startswith("I'm sorry")
    )
    assert by[8]["error"].startswith("HTTP 503") and "wiscore" not in by[8]
    assert counts == {1: 1, 2: 1, 3: 1, 4: 1, 5: 2, 6: 3, 7: 3, 8: 3}
    assert (
        res["n_scored"] == 5 and res["n_failed"] == 3 and res["n_refused"] == 2 and res["n_out_of_range"] == 1
    )
    assert sorted(f["prompt_id"] for f in res["failed"]) == [6, 7, 8]
    assert res["all_ids_scored"] is False and res["judge"]["parser"] == "official"
    assert len(sleeps) == 1 + 2 + 2 + 2  # a back-off before every retry


def test_strict_parser_retries_what_the_official_accepts(images):
    with JudgeServer({"prompt 1": ["Consistency: 3\nRealism: 2\nAesthetic Quality: 2", GOOD]}) as srv:
        cfg = W.JudgeConfig(base_url=srv.url, parser="strict", backoff_s=0)
        res = W.JudgeClient(cfg, sleep=lambda s: None).judge(W.image_path(images, 1), "prompt 1", "e")
    assert res.attempts == 2 and res.scores == {"consistency": 2, "realism": 1, "aesthetic_quality": 1}
    with pytest.raises(Exception, match="parser"):
        W.JudgeConfig(parser="lenient")


def test_all_ids_scored_needs_the_full_1000():
    recs = [
        {
            "prompt_id": i,
            "category": W.category_of(i),
            "consistency": 1,
            "realism": 1,
            "aesthetic_quality": 1,
            "wiscore": W.wiscore(1, 1, 1),
        }
        for i in range(1, 1001)
    ]
    assert W.aggregate(recs)["all_ids_scored"] is True
    assert W.aggregate(recs[:-1])["all_ids_scored"] is False
    failed = recs[:-1] + [{"prompt_id": 1000, "category": "chemistry", "error": "unparsable answer"}]
    res = W.aggregate(failed)
    assert res["all_ids_scored"] is False and res["complete"] is True  # all categories, but one id unscored


@pytest.mark.parametrize("variant", ["rewrite", "original"])
def test_prompt_variant_enters_comparability(variant):
    """A complete WISE run (1,000 ids, gpt-4o-2024-05-13, official parser) is comparable with the leaderboard
    only on the original prompts, the official usage; the rewritten prompts are named as the reason."""
    from chunkgrpo.eval.config import EvalConfig
    from chunkgrpo.eval.runner import _comparability

    cfg = EvalConfig(base_model="m", benchmarks=["wise"], wise_variant=variant)
    res = {"all_ids_scored": True, "missing": [], "n_failed": 0,
           "judge": {"model": "gpt-4o-2024-05-13", "parser": "official"}}
    ok, notes = _comparability(cfg, "wise", {"n_prompts": 1000, "variant": variant}, {"base": res})
    if variant == "original":
        assert ok and notes == []
    else:
        assert not ok and notes == [
            "WISE prompt variant 'rewrite' (the official gpt_eval.py usage and the WISE "
            "leaderboard judge the 'original' prompts)"
        ]

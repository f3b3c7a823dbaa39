"""The evaluate stage on the real paths a researcher relies on, end to end on the tiny FLUX:

- GenEval scored by the transformers Mask2Former backend loaded from disk by the stage's own loading code
  (a randomly initialised model of the real architecture) and the CLIP colour classifier: detection
  post-processing, masks, boxes, colour crops and the official rules, with paired statistics.
- The colour classifier is checked in preflight, before any image is generated.
- WISE judged over real HTTP by a local OpenAI-compatible server (scripted, incl. refused and malformed
  answers): an 8-prompt run is reported not comparable, and the report says why.
"""

from __future__ import annotations

import json

import pytest

from chunkgrpo.errors import UserError
from chunkgrpo.eval import geneval as G
from chunkgrpo.eval import geneval_models as GM
from chunkgrpo.eval.config import EvalConfig
from chunkgrpo.eval.runner import run_evaluation, summary_lines
from tests.unit.eval.judge_server import JudgeServer
from tests.unit.eval.tiny_mask2former import make_tiny_mask2former

pytestmark = pytest.mark.integration

METADATA = [
    {"tag": "single_object", "include": [{"class": "dog", "count": 1}], "prompt": "a photo of a dog"},
    {
        "tag": "two_object",
        "include": [{"class": "car", "count": 1}, {"class": "dog", "count": 1}],
        "prompt": "a photo of a car and a dog",
    },
    {
        "tag": "counting",
        "include": [{"class": "car", "count": 2}],
        "exclude": [{"class": "car", "count": 3}],
        "prompt": "a photo of two cars",
    },
    {
        "tag": "colors",
        "include": [{"class": "car", "count": 1, "color": "red"}],
        "prompt": "a photo of a red car",
    },
    {
        "tag": "position",
        "include": [{"class": "car", "count": 1}, {"class": "dog", "count": 1, "position": ["right of", 0]}],
        "prompt": "a photo of a dog right of a car",
    },
    {
        "tag": "color_attr",
        "include": [
            {"class": "car", "count": 1, "color": "blue"},
            {"class": "dog", "count": 1, "color": "red"},
        ],
        "prompt": "a photo of a blue car and a red dog",
    },
]


@pytest.fixture(scope="module")
def geneval_models(tmp_path_factory):
    from chunkgrpo.testing.clip import make_tiny_clip

    root = tmp_path_factory.mktemp("geneval-models")
    m2f = make_tiny_mask2former(root / "mask2former", G.load_object_names(), favour=["car", "dog"])
    clip = make_tiny_clip(root / "clip")
    md = root / "metadata.jsonl"
    md.write_text("".join(json.dumps(m) + "\n" for m in METADATA))
    return m2f, clip, md


def test_geneval_real_mask2former_and_colour_classifier(
    tiny_model_dir, trained_dir, geneval_models, tmp_path
):
    m2f, clip, md = geneval_models
    out = tmp_path / "eval"
    cfg = EvalConfig.load("eval_tiny", [
        f"model={trained_dir}", f"output_dir={out}", "benchmarks=[geneval]", f"geneval_metadata={md}",
        "geneval_samples=2", "geneval_detector=transformers", f"geneval_detector_weights={m2f}",
        f"geneval_color_model={clip}", "scorer_device=cpu", "bootstrap_samples=500"])
    result = run_evaluation(cfg)  # nothing injected: the stage loads detector + classifier itself

    g = result["benchmarks"]["geneval"]
    res = g["results"]["trained"]
    assert res["complete"] and res["n_images"] == res["n_expected_images"] == 12
    assert res["detector"]["name"] == "transformers-mask2former"
    assert res["color_classifier"]["name"] == "ClipColorClassifier"
    recs = [json.loads(x) for x in (out / "geneval" / "trained" / "results.jsonl").read_text().splitlines()]
    assert len(recs) == 12
    # detections survived the official threshold, with boxes from the masks
    kept = [box for r in recs for dets in json.loads(r["details"]).values() for box in dets]
    assert kept and all(0 <= b[0] <= b[2] <= 64 and 0 <= b[1] <= b[3] <= 64 and b[4] > 0.3 for b in kept)
    # the colour classifier ran on the masked crops: the colour prompts are decided by colour, not by absence
    colour = [r for r in recs if r["tag"] in ("colors", "color_attr")]
    assert all(
        r["correct"] or ("found 1" not in r["reason"] and " red" in r["reason"] or " blue" in r["reason"])
        for r in colour
    )
    assert any(("; and " in r["reason"]) or r["correct"] for r in colour)
    # counting uses 0.9: random masks score ~0.5, so no car counts there
    assert all(r["reason"].startswith("expected car>=2, found 0") for r in recs if r["tag"] == "counting")

    # the same verdicts from the backend objects built directly (deterministic, same code path)
    det = GM.TransformersMask2FormerDetector(m2f, device="cpu")
    clf = GM.ClipColorClassifier(clip, device="cpu")
    for r in recs[:6]:
        again = G.score_image(out / r["filename"], json.loads(r["metadata"]), det, clf)
        assert (again["correct"], again["reason"], again["details"]) == (
            r["correct"],
            r["reason"],
            r["details"],
        )

    # paired statistics per task and overall, exposed as gate-able metrics
    st = g["statistics"]
    assert set(st) == {"overall", *G.TAGS} and st["overall"]["n"] == 6
    for k in ("delta_ci_low", "delta_ci_high", "win_rate", "n_pairs"):
        assert f"geneval.overall.{k}" in result["metrics"]
    assert st["overall"]["ci_low"] <= st["overall"]["delta"] <= st["overall"]["ci_high"]
    # not comparable, with the reasons
    notes = " | ".join(g["comparable_notes"])
    assert not g["comparable_to_official"]
    assert "6 of 553 prompts" in notes and "not the official mmdet" in notes and "colour classifier" in notes
    assert "file_discovery" in res and res["unusual_files"] == []
    html = (out / "report.html").read_text()
    assert "Detector and colour classifier" in html and "<svg" in html


def test_colour_classifier_is_checked_before_generation(tiny_model_dir, geneval_models, tmp_path):
    m2f, clip, md = geneval_models
    base = ["benchmarks=[geneval]", f"base_model={tiny_model_dir}", f"geneval_metadata={md}",
            "geneval_detector=transformers", f"geneval_detector_weights={m2f}", "scorer_device=cpu"]
    out = tmp_path / "a"
    with pytest.raises(UserError, match="2 GenEval prompts have colour clauses: set geneval_color_model"):
        run_evaluation(EvalConfig.load("eval_tiny", [*base, f"output_dir={out}"]))
    assert not list(out.rglob("*.png"))
    broken = tmp_path / "broken-clip"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    out = tmp_path / "b"
    with pytest.raises(UserError, match="colour classifier"):
        run_evaluation(
            EvalConfig.load("eval_tiny", [*base, f"output_dir={out}", f"geneval_color_model={broken}"])
        )
    assert not list(out.rglob("*.png"))
    with pytest.raises(UserError, match="does not exist"):
        run_evaluation(EvalConfig.load("eval_tiny", [*base, f"output_dir={tmp_path / 'c'}",
                                                     f"geneval_color_model={tmp_path / 'nope'}"]))


WISE_PROMPTS = {"cultural_common_sense": [1, 2, 3], "spatio-temporal_reasoning": [401, 600],
                "natural_science": [701, 850, 950]}


def test_wise_8_prompts_over_http_is_not_comparable(tiny_model_dir, trained_dir, tmp_path, monkeypatch):
    wdir = tmp_path / "wise"
    wdir.mkdir()
    for fname, ids in WISE_PROMPTS.items():
        (wdir / f"{fname}_rewrite.json").write_text(
            json.dumps(
                [
                    {"prompt_id": i, "Prompt": f"Prompt {i}.", "Explanation": f"why {i}", "Subcategory": "s"}
                    for i in ids
                ]
            )
        )
    answers = {1: "Consistency: 2\nRealism: 1\nAesthetic Quality: 1",
               2: "**Consistency**: 1\n**Realism**: 1\n**Aesthetic Quality**: 0",
               3: "Assessment:\n0\n1\n1",
               401: "Consistency: 1\nRealism: 2\nAesthetic Quality: 1\nCorrection: Consistency: 2",
               600: {"refusal": "I can't help with that."},
               701: "Consistency: 2\nRealism: 2\nAesthetic Quality: 2",
               850: "I'm sorry, I cannot evaluate this image.",
               950: "Consistency: 0\nRealism: 1\nAesthetic Quality: 1"}

    def default(prompt):
        return answers[int(prompt.split()[1].rstrip("."))]

    monkeypatch.setenv("WISE_JUDGE_TEST_KEY", "sk-local-test")
    out = tmp_path / "eval"
    with JudgeServer(default=default) as srv:
        cfg = EvalConfig.load(
            "eval_tiny",
            [
                f"model={trained_dir}",
                f"output_dir={out}",
                "benchmarks=[wise]",
                f"wise_prompts={wdir}",
                f"wise_judge.base_url={srv.url}",
                "wise_judge.model=gpt-4o-2024-05-13",
                "wise_judge.api_key_env=WISE_JUDGE_TEST_KEY",
                "wise_judge.backoff_s=0",
                "wise_judge.max_attempts=2",
                "bootstrap_samples=500",
            ],
        )
        result = run_evaluation(cfg)
        n_requests = len(srv.requests)
        auth = {r["auth"] for r in srv.requests}
    assert auth == {"Bearer sk-local-test"}
    assert n_requests == 2 * (6 + 2 * 2)  # two labels; the refused and the sorry prompt retried once
    w = result["benchmarks"]["wise"]
    assert w["comparable_to_official"] is False
    notes = w["comparable_notes"]
    assert "8 of 1000 WISE prompt ids evaluated (the official Calculate.py needs all 1000)" in notes
    assert any(n.startswith("[trained] 2 judgements failed (excluded from the means; prompt ids 600, 850)")
               for n in notes)
    t = w["results"]["trained"]
    assert t["n_scored"] == 6 and t["n_refused"] == 2 and not t["all_ids_scored"]
    recs = {json.loads(x)["prompt_id"]: json.loads(x) for x in (out / "wise" / "trained" / "results.jsonl")
            .read_text().splitlines()}
    assert recs[401]["consistency"] == 2  # the official parser: last match
    assert (recs[3]["consistency"], recs[3]["realism"], recs[3]["aesthetic_quality"]) == (0, 1, 1)
    assert recs[600]["error"] == "refused: I can't help with that."
    # identical judge answers for both labels -> every paired delta is 0 and rendered neutral
    assert w["statistics"]["overall"]["delta"] == 0 and w["statistics"]["overall"]["significance"] == 0
    assert result["metrics"]["wise.overall.n_pairs"] == 6.0
    lines = "\n".join(summary_lines(result))
    assert "wise: not comparable to published numbers: " in lines and "8 of 1000 WISE prompt ids" in lines
    html = (out / "report.html").read_text()
    import html as html_lib

    assert "8 of 1000 WISE prompt ids evaluated" in html
    # the judge's answer is shown, escaped (whatever entity the template engine writes for the quote)
    assert "refused: I can't help with that." in html_lib.unescape(html) and "I can't help" not in html
    assert "Failed judgements" in html and "judge answer" in html and "class='num neutral'" in html
    assert "sk-local-test" not in html and "sk-local-test" not in (out / "metrics.json").read_text()

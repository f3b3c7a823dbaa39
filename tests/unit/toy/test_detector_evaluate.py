"""`chunkgrpo evaluate` with `geneval_detector=chunkgrpo.toy.detector:ToyDetector` (the `eval_toy` preset):
the project's GenEval path
end to end on a toy model, scored by the exact toy detector and colour classifier, no weights needed."""

import json

from chunkgrpo.eval.config import EvalConfig
from chunkgrpo.eval.runner import run_evaluation
from chunkgrpo.toy.model import ToyModelConfig, build_toy_model, read_meta

TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")


def test_eval_toy_scores_held_out_prompts_with_the_exact_detector(tmp_path):
    model = build_toy_model(
        tmp_path / "model",
        ToyModelConfig(steps=10, batch_size=8, pool=128, eval_per_category=1, eval_samples=1, sample_steps=4),
        cache_dir=tmp_path / "cache",
        progress=False,
    )
    files = read_meta(model)["files"]
    cfg = EvalConfig.load(
        "eval_toy",
        [
            f"base_model={model}",
            f"geneval_metadata={model / files['heldout_metadata']}",
            f"hpdv2_prompts={model / files['heldout_prompts']}",
            "geneval_samples=2",
            "sampling.num_steps=4",
            "sampling.trained_steps=4",
            f"output_dir={tmp_path / 'eval'}",
            "num_prompts=0",
        ],
    )
    result = run_evaluation(cfg)  # no detector weights, no colour model: the toy detector needs none
    m = result["metrics"]
    assert {f"geneval.{t}.base" for t in TAGS} <= set(m) and 0 <= m["geneval.overall.base"] <= 1
    assert {"hpdv2.toy_geneval.base", "hpdv2.contrast.base"} <= set(m)
    saved = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert saved["metrics"]["geneval.overall.base"] == m["geneval.overall.base"]
    assert (tmp_path / "eval" / "report.html").exists()

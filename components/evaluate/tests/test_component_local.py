"""evaluate under kfp.local: the tiny base model on two HPDv2 prompts with programmatic scorers."""

import json

import pytest

from components.evaluate.component import evaluate

pytestmark = pytest.mark.integration


def test_evaluate_base_model_locally(local_runner, tiny_model_dir):
    bucket = local_runner.env["CHUNKGRPO_S3_BUCKET"]
    task = evaluate(preset="eval_tiny", overrides=[], benchmarks=["hpdv2"], num_prompts=2,
                    base_model=str(tiny_model_dir), registered_model="", alias="", artifact_root=f"s3://{bucket}/comp-eval",
                    run_id="comp-eval-run", stage="evaluate", experiment="comp", parent_run_id="")
    result = json.loads(open(task.outputs["results"].path).read())
    assert result["benchmarks"]["hpdv2"]["n_prompts"] == 2
    assert any(k.startswith("hpdv2.brightness") for k in result["metrics"])
    assert open(task.outputs["report"].path).read().lstrip().lower().startswith("<!doctype html")

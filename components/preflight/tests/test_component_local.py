"""preflight under kfp.local against the local S3 + MLflow."""

import pytest

from components.preflight.component import preflight

pytestmark = pytest.mark.integration


def test_preflight_locally(local_runner, tiny_model_dir, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\n")
    args = dict(
        preset="tiny_cpu",
        train_overrides=[],
        reward_weights={},
        scorer_weights={},
        eval_preset="eval_tiny",
        eval_benchmarks=[],
        eval_overrides=[],
        artifact_root=f"s3://{local_runner.env['CHUNKGRPO_S3_BUCKET']}/runs",
    )
    task = preflight(model=str(tiny_model_dir), prompts=str(prompts), **args)
    assert task.outputs["Output"] == "ok"
    assert open(task.outputs["capacity"].path).read().startswith("# Capacity plan: tiny_cpu")
    with pytest.raises(RuntimeError):  # the task fails (kfp.local raise_on_error)
        preflight(model="s3://chunkgrpo/models/acme/missing", prompts=str(prompts), **args)

"""The pipeline's parent MLflow run, once closed, shows the stages' headline results (the run the pipeline
summary links to): final reward/mean, the evaluation's trained/base/delta means, the registered version."""

import pytest

from chunkgrpo import tracking
from chunkgrpo.stages.tracking import close_run
from chunkgrpo.train.metric_names import training_metrics_for_mlflow

pytestmark = pytest.mark.integration


def test_close_run_copies_the_headline_results_onto_the_parent(services_env, capsys):
    from mlflow import MlflowClient

    client = MlflowClient()
    exp, kfp_id = "parent-summary", "kfp-run-summary-1"
    parent, created = tracking.open_pipeline_run(client, exp, "run", kfp_run_id=kfp_id)
    assert created
    with tracking.stage_run("train", parent_run_id=parent.run_id) as train:
        for step, r in ((1, 0.2), (2, 0.35), (3, 0.5)):
            train.log_metrics(training_metrics_for_mlflow({"reward_mean": r, "loss": 0.1}),
                              step=step)
    with tracking.stage_run("evaluate", parent_run_id=parent.run_id) as ev:
        ev.log_metrics({"hpdv2.pickscore.trained": 22.5, "hpdv2.pickscore.base": 22.0,
                        "hpdv2.pickscore.delta": 0.5, "hpdv2.pickscore.delta_ci_low": 0.1})
    with tracking.stage_run("register", parent_run_id=parent.run_id) as reg:
        client.create_registered_model("summary-model")
        mv = client.create_model_version("summary-model", f"{reg.artifact_uri}/model", run_id=reg.run_id)
    # before closing: the parent has nothing of its own
    assert client.get_run(parent.run_id).data.metrics == {}

    close_run(exp, kfp_id, "SUCCEEDED")
    run = client.get_run(parent.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.metrics == {"reward/mean": 0.5, "eval/hpdv2.pickscore.trained": 22.5,
                                "eval/hpdv2.pickscore.base": 22.0, "eval/hpdv2.pickscore.delta": 0.5}
    assert [m.step for m in client.get_metric_history(parent.run_id, "reward/mean")] == [3]
    assert run.data.tags["chunkgrpo.registered_model"] == "summary-model"
    assert run.data.tags["chunkgrpo.registered_version"] == str(mv.version)
    assert "copied 4 headline metrics, model summary-model version 1" in capsys.readouterr().out


def test_a_parent_without_stages_closes_with_no_metrics(services_env):
    from mlflow import MlflowClient

    client = MlflowClient()
    parent, _ = tracking.open_pipeline_run(client, "parent-summary", "empty", kfp_run_id="kfp-run-empty")
    close_run("parent-summary", "kfp-run-empty", "FAILED", "boom")
    run = client.get_run(parent.run_id)
    assert run.info.status == "FAILED" and run.data.metrics == {}
    assert "chunkgrpo.registered_model" not in run.data.tags

"""evaluate / check_regression: python_func with the evaluation runner stubbed; the regression rule."""

import json

import pytest

from components.evaluate.component import check_regression, evaluate


def test_evaluate_passes_scorer_weights_and_outputs(monkeypatch, artifact, tmp_path):
    import chunkgrpo.eval.runner as runner

    seen = {}

    def fake_run(cfg):
        seen["cfg"] = cfg
        from pathlib import Path

        Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
        (Path(cfg.output_dir) / "report.html").write_text("<!doctype html>")
        return {"metrics": {"hpdv2.hpsv3.trained": 0.3}, "base_model": cfg.base_model, "mlflow_run_id": "",
                "benchmarks": {}}

    monkeypatch.setattr(runner, "run_evaluation", fake_run)
    monkeypatch.setattr(runner, "summary_lines", lambda r: [])
    metrics, report, results = artifact("m"), artifact("r.html"), artifact("res.json")
    evaluate.python_func(preset="eval_hpdv2", overrides=[], benchmarks=["hpdv2"], num_prompts=4,
                         base_model="s3://bkt/models/flux", registered_model="", alias="", artifact_root="s3://bkt/runs",
                         run_id="r1", stage="evaluate", experiment="e", parent_run_id="", metrics=metrics,
                         report=report, results=results, model=None,
                         scorer_weights={"hpsv3": "s3://bkt/models/MizzenAI/HPSv3", "imagereward": "s3://bkt/models/IR",
                                         "hpsv3.processor": "s3://bkt/models/Qwen"})
    cfg = seen["cfg"]
    assert cfg.scorer_weights == {"hpsv3": "s3://bkt/models/MizzenAI/HPSv3", "imagereward": "s3://bkt/models/IR"}
    assert cfg.scorer_options["hpsv3"]["processor"] == "s3://bkt/models/Qwen"
    assert cfg.num_prompts == 4 and cfg.output_uri == "s3://bkt/runs/r1/evaluate"
    assert (
        metrics.metrics == {"hpdv2.hpsv3.trained": 0.3} and json.loads(open(results.path).read())["metrics"]
    )


class FakeMlflow:
    """MlflowClient stand-in: the champion was registered with hpsv3 = 0.30."""

    def __init__(self, *a, **k):
        self.tags = {}

    gate = {"gate.metric": "eval.hpdv2.hpsv3", "gate.direction": "max"}

    def get_registered_model(self, name):
        import types

        return types.SimpleNamespace(tags=dict(self.gate))

    run_metrics = {"hpdv2.hpsv3.trained": 0.30}  # the champion's evaluation run

    def get_model_version_by_alias(self, name, alias):
        import types

        return types.SimpleNamespace(version="3", tags={"eval.run_id": "evalrun1"}, run_id="", source="")

    def get_run(self, run_id):
        import types

        assert run_id == "evalrun1"
        return types.SimpleNamespace(data=types.SimpleNamespace(metrics=dict(self.run_metrics)))

    def set_tag(self, *a):
        pass

    def log_metric(self, *a):
        pass

    def set_model_version_tag(self, name, version, key, value):
        self.tags[key] = value


@pytest.mark.parametrize("today,regressed", [(0.30, False), (0.296, False), (0.294, True)])
def test_regression_rule(monkeypatch, artifact, today, regressed):
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.invalid")
    monkeypatch.setattr(mlflow, "MlflowClient", FakeMlflow)
    res = artifact(
        "res.json", json.dumps({"metrics": {"hpdv2.hpsv3.trained": today, "hpdv2.hpsv3.base": 0.28}})
    )
    args = dict(
        results=res,
        model_name="m",
        alias="champion",
        metric="hpdv2.hpsv3",
        direction="max",
        tolerance=0.005,
        parent_run_id="",
        summary=artifact("s.md"),
    )
    assert check_regression.python_func(fail_on_regression=False, **args) is regressed
    if regressed:
        with pytest.raises(RuntimeError, match="regressed"):
            check_regression.python_func(fail_on_regression=True, **args)


def test_regression_direction_is_the_registered_models(monkeypatch, artifact):
    """For the nightly check: a flag cannot turn a drop of a higher-is-better metric into a gain."""
    import mlflow

    from chunkgrpo.errors import UserError

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.invalid")
    monkeypatch.setattr(mlflow, "MlflowClient", FakeMlflow)
    res = artifact("res.json", json.dumps({"metrics": {"hpdv2.hpsv3.trained": 0.2}}))  # a big drop from 0.30
    args = dict(results=res, model_name="m", alias="champion", metric="hpdv2.hpsv3", tolerance=0.005,
                fail_on_regression=False, parent_run_id="", summary=artifact("s.md"))
    assert check_regression.python_func(direction="", **args) is True  # max: the model's gate.direction
    with pytest.raises(UserError, match="higher-is-better"):
        check_regression.python_func(direction="min", **args)
    # a metric nothing records a direction for: the asserted one is used, none at all is refused
    res2 = artifact("res2.json", json.dumps({"metrics": {"custom.loss.trained": 0.2}}))
    args2 = {**args, "results": res2, "metric": "custom.loss"}
    monkeypatch.setattr(FakeMlflow, "run_metrics", {"custom.loss.trained": 0.30})
    assert (
        check_regression.python_func(direction="min", **args2) is False
    )  # 0.30 -> 0.20 is better when lower
    with pytest.raises(UserError, match="direction of 'eval.custom.loss' is unknown"):
        check_regression.python_func(direction="", **args2)

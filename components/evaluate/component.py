"""Evaluation (hybrid inference on HPDv2 / GenEval / WISE) and the nightly regression check. The steps are
`chunkgrpo.stages.evaluate.evaluate` and `chunkgrpo.stages.regression.check_regression`."""

from kfp import dsl
from kfp.dsl import HTML, Artifact, Input, Markdown, Metrics, Model, Output

from components.images import EVAL_IMAGE, RUNTIME_IMAGE


@dsl.component(base_image=EVAL_IMAGE, install_kfp_package=False)
def evaluate(preset: str, overrides: list, benchmarks: list, num_prompts: int, base_model: str,
             registered_model: str, alias: str, artifact_root: str, run_id: str, stage: str, experiment: str,
             parent_run_id: str, metrics: Output[Metrics], report: Output[HTML], results: Output[Artifact],
             model: Input[Model] = None, scorer_weights: dict = {}):
    """Generate and score benchmark images for the trained model and the base model (same seeds).

    Args:
        preset: evaluation preset (eval_hpdv2, eval_tiny, or a YAML path).
        overrides: extra evaluation overrides (key=value).
        benchmarks: benchmark suites to run (hpdv2, geneval, wise); empty = the preset's.
        num_prompts: first N prompts per benchmark (0 = the preset's value).
        base_model: base FLUX model ('' = the one recorded with the trained model).
        registered_model: registered model name to evaluate instead of `model` ('' = use `model`).
        alias: alias of registered_model to evaluate (champion).
        artifact_root: s3:// prefix; images + report go to <root>/<run_id>/<stage>.
        run_id: KFP run id.
        stage: name of this evaluation in S3/MLflow (evaluate, nightly-champion, ...).
        experiment: MLflow experiment.
        parent_run_id: MLflow parent run id ('' = none).
        model: model pointer from `train` / `launch_trainjob`.
        scorer_weights: {scorer: weights URI, '<scorer>.processor': URI} (e.g. hpsv3, hpsv3.processor,
            imagereward).
    """
    import json
    import shutil
    from pathlib import Path

    from chunkgrpo.stages.task import stage_env

    stage_env(parent_run_id)
    from chunkgrpo.stages.evaluate import EvalRequest
    from chunkgrpo.stages.evaluate import evaluate as evaluate_stage

    with evaluate_stage(EvalRequest(preset, list(overrides), list(benchmarks), num_prompts, base_model,
                                    model.path if model is not None else "", registered_model, alias,
                                    artifact_root, run_id, stage, experiment, dict(scorer_weights))) as ev:
        shutil.copyfile(ev.report, report.path)  # the stage's scratch folder goes at the block's end
    for name, value in ev.metrics.items():
        metrics.log_metric(name, value)
    Path(results.path).write_text(json.dumps(ev.result, indent=1, default=str))
    results.metadata.update(ev.metadata)
    report.metadata.update(ev.metadata)


@dsl.component(base_image=RUNTIME_IMAGE, install_kfp_package=False)
def check_regression(results: Input[Artifact], model_name: str, alias: str, metric: str, direction: str,
                     tolerance: float, fail_on_regression: bool, parent_run_id: str,
                     summary: Output[Markdown]) -> bool:
    """Compare tonight's score of the registry model with the score it was registered with.

    Args:
        results: metrics.json of the nightly `evaluate` step.
        model_name: registered model name.
        alias: alias that was evaluated (champion).
        metric: benchmark metric without label, e.g. hpdv2.hpsv3 (as its evaluation run logged it), or a
            paired-CI bound such as hpdv2.hpsv3.delta_ci_low (tonight's bound vs the registered one).
        direction: '' = the registered model's (its gate.direction when `metric` is its gate metric, else the
            metric's known direction); max/min only to assert it (a different one fails the check), or to name
            the direction of a metric nothing records.
        tolerance: allowed drop (absolute) before it counts as a regression.
        fail_on_regression: fail the run on a regression (besides flagging it).
        parent_run_id: MLflow parent run id: gets tag chunkgrpo.regression=true|false.

    Returns:
        True if the model regressed.
    """
    import json
    from pathlib import Path

    from chunkgrpo.stages.task import stage_env

    stage_env(parent_run_id)
    from chunkgrpo.stages.regression import check_regression as check

    return check(results=json.loads(Path(results.path).read_text()), model_name=model_name, alias=alias,
                 metric=metric, direction=direction, tolerance=tolerance,
                 fail_on_regression=fail_on_regression, parent_run_id=parent_run_id, summary_out=summary.path)

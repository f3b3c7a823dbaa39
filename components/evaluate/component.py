"""Evaluation (hybrid inference on HPDv2 / GenEval / WISE) and the nightly regression check."""

from kfp import dsl
from kfp.dsl import HTML, Artifact, Input, Markdown, Metrics, Model, Output

from components._shared import run_prefix, stage_env
from components.images import EVAL_IMAGE, RUNTIME_IMAGE


@dsl.component(base_image=EVAL_IMAGE, install_kfp_package=False, additional_funcs=[run_prefix, stage_env])
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
    import tempfile
    from pathlib import Path

    stage_env(parent_run_id)
    from chunkgrpo.errors import UserError
    from chunkgrpo.eval.config import EvalConfig
    from chunkgrpo.eval.runner import run_evaluation, summary_lines

    work = Path(tempfile.mkdtemp(prefix="chunkgrpo-eval-"))
    source = ""
    if model is not None and Path(model.path).exists():
        shutil.copyfile(model.path, work / "pointer.json")  # load_trained verifies the manifest digest
        source = str(work / "pointer.json")
    elif registered_model:
        from mlflow import MlflowClient

        from chunkgrpo.store.client import ArtifactStore

        name, registered_model = registered_model, f"models:/{registered_model}@{alias or 'champion'}"
        try:
            mv = MlflowClient().get_model_version_by_alias(name, alias or "champion")
        except Exception as e:
            raise UserError(f"cannot resolve {registered_model}: {e}") from None
        tags = mv.tags or {}
        base_model = base_model or tags.get("base_model", "")
        ckpt = tags.get("checkpoint_uri", "")
        manifest = ArtifactStore().read_manifest(ckpt) if ckpt else None
        if manifest is not None and manifest.content_sha256 == tags.get("content_sha256"):
            # the immutable S3 folder the version was registered from (checksums verified on download)
            source = ckpt
        else:
            from chunkgrpo.registry.load import load_registered_model

            source = str(load_registered_model(registered_model, work / "registered").weights_dir)
        print(f"{registered_model} = v{mv.version} <- {source}")
    elif not base_model:
        raise UserError("nothing to evaluate: give a model artifact, registered_model or base_model")
    from chunkgrpo.eval.base_cache import default_prefix
    from chunkgrpo.model_cache import scorer_weight_overrides

    over = [
        f"base_cache={default_prefix(artifact_root)}",  # base images shared between runs; overrides win
        *scorer_weight_overrides(dict(scorer_weights)),
        *overrides,
        f"model={source}",
        f"output_dir={work / 'out'}",
        f"output_uri={run_prefix(artifact_root, run_id, stage)}",
        f"experiment={experiment}",
    ]
    if base_model:
        over.append(f"base_model={base_model}")
    if benchmarks:
        over.append(f"benchmarks={json.dumps(list(benchmarks))}")
    if num_prompts > 0:
        over.append(f"num_prompts={num_prompts}")
    cfg = EvalConfig.load(preset, over)
    result = run_evaluation(cfg)
    for line in summary_lines(result):
        print(line)
    for k, v in sorted(result["metrics"].items()):
        metrics.log_metric(k, float(v))
    shutil.copyfile(Path(cfg.output_dir) / "report.html", report.path)
    Path(results.path).write_text(json.dumps(result, indent=1, default=str))
    meta = {"output_uri": cfg.output_uri, "mlflow_run_id": result.get("mlflow_run_id") or "",
            "model": registered_model or source or "(base only)", "base_model": result["base_model"]}
    for a in (results, report):
        a.metadata.update(meta)


@dsl.component(base_image=RUNTIME_IMAGE, install_kfp_package=False, additional_funcs=[stage_env])
def check_regression(results: Input[Artifact], model_name: str, alias: str, metric: str, direction: str,
                     tolerance: float, fail_on_regression: bool, parent_run_id: str,
                     summary: Output[Markdown]) -> bool:
    """Compare tonight's score of the registry model with the score it was registered with.

    Args:
        results: metrics.json of the nightly `evaluate` step.
        model_name: registered model name.
        alias: alias that was evaluated (champion).
        metric: benchmark metric without label, e.g. hpdv2.hpsv3 (registry tag metric.eval.<metric>), or a
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
    import os
    from pathlib import Path

    stage_env(parent_run_id)
    m = json.loads(Path(results.path).read_text())["metrics"]
    today, base = m.get(f"{metric}.trained", m.get(metric)), m.get(f"{metric}.base")
    reference, version = None, None
    if os.environ.get("MLFLOW_TRACKING_URI"):
        from mlflow import MlflowClient

        client = MlflowClient()
        mv = client.get_model_version_by_alias(model_name, alias)
        version = mv.version
        raw = (mv.tags or {}).get(f"metric.eval.{metric}")
        reference = float(raw) if raw not in (None, "") else None
        from chunkgrpo.registry.promotion import metric_direction

        direction = metric_direction(client, model_name, f"eval.{metric}", direction)  # never a flag's
    else:
        from chunkgrpo.registry.gate import known_direction

        direction = direction or known_direction(f"eval.{metric}") or "max"
    if today is None:
        raise ValueError(f"metric {metric}.trained not in tonight's results (have {sorted(m)[:20]})")
    sign = 1.0 if direction == "max" else -1.0
    drop = None if reference is None else sign * (reference - today)
    regressed = drop is not None and drop > tolerance
    lines = [f"# Nightly benchmark: {model_name}@{alias} (v{version})", "",
             f"| | {metric} |", "|---|---|", f"| tonight | {today:.6g} |",
             f"| at registration | {reference if reference is None else f'{reference:.6g}'} |",
             f"| base model tonight | {base if base is None else f'{base:.6g}'} |", "",
             ("**REGRESSION**" if regressed else "no regression") +
             (f": drop {drop:+.6g} vs tolerance {tolerance:g} ({direction} is better)" if drop is not None
              else ": no registered reference value")]
    if base is not None and sign * (today - base) <= 0:
        lines.append(f"\nnote: the {alias} does not beat the base model on {metric} tonight")
    if metric.endswith((".delta_ci_low", ".delta_ci_high")) and sign * today <= 0:
        lines.append(
            f"\nnote: tonight the {alias} is not significantly better than the base model ({metric})"
        )
    Path(summary.path).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if parent_run_id and os.environ.get("MLFLOW_TRACKING_URI"):
        client.set_tag(parent_run_id, "chunkgrpo.regression", str(regressed).lower())
        client.set_tag(parent_run_id, "chunkgrpo.regression.metric", metric)
        client.log_metric(parent_run_id, f"nightly.{metric}", float(today))
        if version:
            client.set_model_version_tag(
                model_name, version, "nightly.last_regression", str(regressed).lower()
            )
    if regressed and fail_on_regression:
        raise RuntimeError(f"{model_name}@{alias} regressed on {metric}: {today:.6g} vs {reference:.6g}")
    return regressed

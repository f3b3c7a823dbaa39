"""The nightly toy-world ablation that accumulates: each night adds `seeds` seeds of chunk (SDE dynamics plan)
vs step-level GRPO from the same toy base model to one series in S3 (runs keyed by seed, earlier nights'
runs reused), so the paired difference and its CI tighten night after night; a changed engine or
configuration starts a new series. The step is `chunkgrpo.stages.ablation.ablation`."""

from kfp import dsl
from kfp.dsl import Artifact, Markdown, Metrics, Output

from components.images import RUNTIME_IMAGE


@dsl.component(base_image=RUNTIME_IMAGE, install_kfp_package=False)
def toy_ablation(model: str, methods: list, seeds: int, steps: int, artifact_root: str, run_id: str,
                 parent_run_id: str, results: Output[Artifact], table: Output[Markdown],
                 curves: Output[Artifact], metrics: Output[Metrics], series_root: str = "",
                 plan: str = "dynamics", eval_per_category: int = 4, eval_samples: int = 4,
                 eval_points: int = 2):
    """Add `seeds` seeds of every method to the ablation series and report all seeds so far.

    Args:
        model: toy base model folder (`chunkgrpo toy-model --out DIR`) or an s3:// folder artifact of one.
        methods: arms of chunkgrpo.toy.ablation_design.ARMS; must hold the primary pair chunk_dynamics,
            step_flow.
        seeds: seeds added tonight (the series keeps every earlier night's).
        steps: optimizer steps per step/chunk run (a multiple of eval_points).
        artifact_root: s3:// prefix; tonight's results folder goes to <root>/<run_id>/ablation.
        run_id: KFP run id.
        parent_run_id: MLflow parent run id ('' = none): a nested run "ablation" gets metrics and artifacts.
        series_root: s3:// prefix of the accumulating series ('' = <artifact_root>/ablation-series); runs are
            kept under <series_root>/<series key>/runs/<method>/seed-<s>.json.
        plan: chunk strategy of chunk_dynamics (dynamics = planned on the SDE profile).
        eval_per_category: held-out prompts per GenEval category.
        eval_samples: images per held-out prompt.
        eval_points: evaluations per run (learning curve; the last is the endpoint).
    """
    import shutil

    from chunkgrpo.stages.task import stage_env

    stage_env(parent_run_id)
    from chunkgrpo.stages.ablation import AblationRequest
    from chunkgrpo.stages.ablation import ablation as ablation_stage

    req = AblationRequest(model, list(methods), seeds, steps, artifact_root, run_id, parent_run_id,
                          series_root, plan, eval_per_category, eval_samples, eval_points)
    with ablation_stage(req) as ab:  # its results folder is removed at the block's end
        shutil.copyfile(ab.out / "ablation.json", results.path)
        shutil.copyfile(ab.out / "ablation.md", table.path)
        if ab.curves:
            shutil.copyfile(ab.curves, curves.path)
    for name, value in ab.metrics.items():
        metrics.log_metric(name, float(value))
    results.metadata.update(ab.metadata)

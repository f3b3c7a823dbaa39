"""Preflight: fail a run in seconds, with one line naming what is missing, before any GPU is requested.
The steps are `chunkgrpo.stages.preflight`."""

from kfp import dsl
from kfp.dsl import Markdown, Output

from components.images import RUNTIME_IMAGE


@dsl.component(base_image=RUNTIME_IMAGE, install_kfp_package=False)
def preflight(model: str, prompts: str, preset: str, train_overrides: list, reward_weights: dict,
              scorer_weights: dict, eval_preset: str, eval_benchmarks: list, eval_overrides: list,
              artifact_root: str, capacity: Output[Markdown], method: str = "chunk", pool: str = "",
              reward_url: str = "", chunks: str = "", nodes: int = 1, max_iterations: int = 0) -> str:
    """Check the base model, prompts, the training config, reward/scorer weights, S3, MLflow, the WISE judge
    key and the capacity plan.

    Args:
        model: base model (s3:// folder artifact, folder in the image/PVC, or hub id in the image's cache).
        prompts: training prompt file.
        preset: training preset (only the weights of its rewards are checked).
        train_overrides: training overrides (key=value).
        reward_weights: {reward: weights URI, '<reward>.processor': URI} for training.
        scorer_weights: {scorer: weights URI, '<scorer>.processor': URI} for evaluation.
        eval_preset: evaluation preset (its benchmarks are used when eval_benchmarks is empty).
        eval_benchmarks: benchmark suites of this run ([] = the preset's).
        eval_overrides: evaluation overrides (key=value).
        artifact_root: s3:// prefix for the run's outputs (its bucket must exist).
        capacity: the capacity plan (per-rank GPU memory, host memory, bytes per volume) as Markdown.
        method: training method (its own preset when `preset` is '').
        pool: GPU pool of the train step (h800 | h100: checked against its training runtime; else CPU,
            unchecked).
        reward_url: a reward server for every training reward without a url of its own ('' = none).
        chunks: the plan step's chunk plan spec ('' = unchecked).
        nodes: training nodes (pods of `pool`) the capacity plan is made for.
        max_iterations: the train step's length in rollouts (0 = the preset's), validated with the preset.

    Returns:
        "ok" (the step fails with one line listing every problem otherwise).
    """
    from chunkgrpo.stages.task import stage_env

    stage_env("")
    from chunkgrpo.stages.preflight import preflight as check

    print(check(model=model, prompts=prompts, preset=preset, method=method,
                train_overrides=list(train_overrides), reward_weights=dict(reward_weights),
                scorer_weights=dict(scorer_weights), eval_preset=eval_preset,
                eval_benchmarks=list(eval_benchmarks), eval_overrides=list(eval_overrides),
                artifact_root=artifact_root, pool=pool, capacity_out=capacity.path,
                reward_url=reward_url, chunks=chunks, nodes=nodes, max_iterations=max_iterations))
    return "ok"


@dsl.component(base_image=RUNTIME_IMAGE, install_kfp_package=False)
def benchmark_preflight(model_name: str, alias: str, base_model: str, eval_preset: str, eval_benchmarks: list,
                        eval_overrides: list, scorer_weights: dict, artifact_root: str) -> str:
    """The nightly benchmark's preflight: the registry version, its base model, scorer weights, S3, MLflow,
    judge key.

    Args:
        model_name: registered model name.
        alias: alias of the version to benchmark (it must exist).
        base_model: base model ('' = the one the version was registered with, tag base_model).
        eval_preset: evaluation preset (its benchmarks are used when eval_benchmarks is empty).
        eval_benchmarks: benchmark suites of this run ([] = the preset's).
        eval_overrides: evaluation overrides (key=value).
        scorer_weights: {scorer: weights URI, '<scorer>.processor': URI} for evaluation.
        artifact_root: s3:// prefix for the benchmark's outputs (its bucket must exist).

    Returns:
        "ok" (the step fails with one line listing every problem otherwise).
    """
    from chunkgrpo.stages.task import stage_env

    stage_env("")
    from chunkgrpo.stages.preflight import benchmark_preflight as check

    print(check(model_name=model_name, alias=alias, base_model=base_model, eval_preset=eval_preset,
                eval_benchmarks=list(eval_benchmarks), eval_overrides=list(eval_overrides),
                scorer_weights=dict(scorer_weights), artifact_root=artifact_root))
    return "ok"

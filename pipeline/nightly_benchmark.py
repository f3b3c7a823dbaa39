"""Nightly benchmark: evaluate the registry champion (hybrid inference) and the base model on the
benchmark suites with fixed seeds, log to MLflow, flag a regression against the champion's own
registered score; optionally (`ablation_model`) the toy-world ablation (chunk with the SDE dynamics plan vs
step-level GRPO from the same toy base model: `components/ablation`), which adds `ablation_seeds` seeds
per night to one series in S3, so each morning shows the primary difference with its CI, the seeds so
far and the minimum detectable effect at that count. Scheduled by `chunkgrpo pipeline schedule`
(default 02:00 UTC).

Caching is off on every step (a benchmark that is served from cache measures nothing). The first step,
`benchmark_preflight`, checks in seconds that the alias exists and that its base model, the scorer
weights, S3, MLflow and (for WISE) the judge key are there, and `eval_preflight`, on the evaluation image,
that the image builds every scorer and loads a LoRA adapter, before the GPU evaluation is scheduled.
The regression check compares in the registered model's direction (`regression_direction` may only
assert it).
"""

from kfp import dsl

from components import benchmark_preflight, check_regression, eval_preflight, evaluate, open_run, toy_ablation
from components.k8s import POOLS, configure, on_pool, small, with_judge
from pipeline.train_and_evaluate import DEFAULT_SCORER_WEIGHTS, DIRECTIONS, _exit_handler

NAME = "chunkgrpo-nightly-benchmark"
LITERALS = {"regression_direction": ("", *DIRECTIONS)}


def make_nightly_benchmark(pool: str = "cpu"):
    if pool not in POOLS:
        raise ValueError(f"pool={pool!r} must be one of {sorted(POOLS)}")
    gpu_pool = POOLS[pool]

    def nightly_benchmark(
        model_name: str = "chunkgrpo-flux",
        alias: str = "champion",
        base_model: str = "",
        eval_preset: str = "eval_hpdv2",
        eval_benchmarks: list = ["hpdv2", "geneval", "wise"],
        eval_num_prompts: int = 0,
        eval_overrides: list = [],
        scorer_weights: dict = DEFAULT_SCORER_WEIGHTS,
        regression_metric: str = "hpdv2.hpsv3",
        regression_direction: str = "",
        tolerance: float = 0.005,
        fail_on_regression: bool = False,
        experiment: str = "chunkgrpo-nightly",
        artifact_root: str = "s3://chunkgrpo-checkpoints/nightly",
        ablation_model: str = "",
        ablation_methods: list = ["step_flow", "chunk_dynamics"],
        ablation_seeds: int = 2,
        ablation_steps: int = 8,
        ablation_series_root: str = "",
    ):
        """Benchmark the champion against the base model and flag regressions.

        Args:
            model_name: Registered model name in MLflow.
            alias: Alias of the version to benchmark (champion).
            base_model: Base FLUX model ('' = the one the champion was trained from).
            eval_preset: Evaluation preset (eval_hpdv2, eval_toy, eval_tiny) or a YAML path in the image.
            eval_benchmarks: Benchmark suites as a JSON list (hpdv2, geneval, wise); [] = the preset's.
            eval_num_prompts: Only the first N prompts per benchmark (0 = the preset's setting, i.e. all).
            eval_overrides: Extra evaluation overrides as a JSON list of "key=value" strings.
            scorer_weights: Weights of the scorers as a JSON object {scorer: URI, "<scorer>.processor": URI}
                (S3 model cache).
            regression_metric: Metric compared with the champion's registered score, e.g. hpdv2.hpsv3, or the
                lower bound of the paired 95% CI of champion − base, hpdv2.hpsv3.delta_ci_low
                (docs/evaluation.md).
            regression_direction: Empty = the registered model's (gate.direction, or the metric's known
                direction); max/min only to assert it or for a metric nothing records.
            tolerance: Allowed drop (absolute) before it counts as a regression.
            fail_on_regression: Also fail the run on a regression (it is always flagged in MLflow and the UI).
            experiment: MLflow experiment of the nightly runs.
            artifact_root: s3:// prefix for the benchmark images and reports (<root>/<run id>/benchmark).
            ablation_model: Toy base model (`chunkgrpo toy-model` folder or s3:// folder) for the accumulating
                step-vs-chunk ablation; '' = skip it.
            ablation_methods: Ablation methods as a JSON list (step_flow, step_dance, chunk_uniform,
                chunk_dynamics, chunk_ws, tempflow, granular); must hold chunk_dynamics and step_flow
                (the primary pair).
            ablation_seeds: Seeds added to the ablation series each night
                (earlier nights' seeds are reused from S3).
            ablation_steps: Optimizer steps per ablation run (a multiple of 2: two evaluation points per run).
            ablation_series_root: s3:// prefix of the accumulating ablation series
                ('' = <artifact_root>/ablation-series); a changed engine or configuration starts a new series
                under it.
        """
        with dsl.ExitHandler(_exit_handler(experiment), name="nightly"):
            pre = benchmark_preflight(model_name=model_name, alias=alias, base_model=base_model,
                                      eval_preset=eval_preset, eval_benchmarks=eval_benchmarks,
                                      eval_overrides=eval_overrides, scorer_weights=scorer_weights,
                                      artifact_root=artifact_root)
            with_judge(configure(small(pre, "2G"), display_name="preflight", cache=False, retries=0))
            ev_pre = eval_preflight(eval_preset=eval_preset, eval_benchmarks=eval_benchmarks,
                                    eval_overrides=eval_overrides, scorer_weights=scorer_weights)
            configure(small(ev_pre, "2G"), display_name="preflight (eval image)", cache=False, retries=0)
            opened = open_run(experiment=experiment, run_name=dsl.PIPELINE_JOB_NAME_PLACEHOLDER,
                              kfp_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER, pipeline=NAME)
            configure(small(opened), display_name="mlflow run", cache=False, retries=3, backoff="10s")
            opened.after(pre, ev_pre)
            ev = evaluate(preset=eval_preset, overrides=eval_overrides, benchmarks=eval_benchmarks,
                          num_prompts=eval_num_prompts, base_model=base_model, registered_model=model_name,
                          alias=alias, artifact_root=artifact_root, run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
                          stage="benchmark", experiment=experiment, parent_run_id=opened.output,
                          scorer_weights=scorer_weights)
            with_judge(
                configure(
                    on_pool(ev, gpu_pool, 1),
                    display_name="benchmark champion vs base",
                    cache=False,
                    retries=1,
                )
            )
            ev.after(pre, ev_pre)
            reg = check_regression(
                results=ev.outputs["results"],
                model_name=model_name,
                alias=alias,
                metric=regression_metric,
                direction=regression_direction,
                tolerance=tolerance,
                fail_on_regression=fail_on_regression,
                parent_run_id=opened.output,
            )
            configure(small(reg), display_name="regression check", cache=False, retries=2)
            with dsl.If(ablation_model != "", name="toy-ablation"):
                ab = toy_ablation(model=ablation_model, methods=ablation_methods, seeds=ablation_seeds,
                                  steps=ablation_steps, artifact_root=artifact_root,
                                  run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER, parent_run_id=opened.output,
                                  series_root=ablation_series_root)
                configure(small(ab, "16G").set_cpu_request("2"), display_name="toy ablation (step vs chunk)",
                          cache=False, retries=1)
                ab.after(pre)

    return dsl.pipeline(name=NAME, description="Nightly: champion vs base model on HPDv2/GenEval/WISE; "
                        "logs to MLflow and flags regressions.")(nightly_benchmark)


nightly_benchmark = make_nightly_benchmark()

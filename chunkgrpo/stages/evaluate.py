"""Evaluation: hybrid inference of a trained or registered model and its base model on HPDv2 / GenEval /
WISE (same seeds), scored, with metrics.json and report.html."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from chunkgrpo.config import option
from chunkgrpo.stages.task import OwnsScratch, run_prefix


@dataclass(frozen=True)
class EvalRequest:
    """A pipeline run's evaluation: which model, which benchmarks, where the outputs go."""

    preset: str = option(help="evaluation preset (eval_hpdv2, eval_tiny, or a YAML path)")
    overrides: list = option([], "extra evaluation overrides (key=value)")
    benchmarks: list = option([], "suites to run ([] = the preset's)")
    num_prompts: int = option(0, "first N prompts per benchmark (0 = the preset's)")
    base_model: str = option("", "base model ('' = the one recorded with the trained / registered model)")
    model_pointer: str = option("", "path of a model pointer from train / launch_trainjob ('' = none)")
    registered_model: str = option("", "registered model to evaluate instead ('' = the pointer's)")
    alias: str = option("", "alias of registered_model ('' = champion)")
    artifact_root: str = option("", "s3:// prefix; outputs go to <root>/<run_id>/<stage>")
    run_id: str = option("", "KFP run id")
    stage: str = option("evaluate", "name of this evaluation in S3/MLflow")
    experiment: str = option("", "MLflow experiment")
    scorer_weights: dict = option({}, "{scorer: URI, '<scorer>.processor': URI}")


@dataclass(frozen=True)
class Evaluation(OwnsScratch):
    """A finished evaluation; `report` is in its scratch folder, removed by `cleanup()` / a `with` block."""

    result: dict          # what chunkgrpo.eval.runner.run_evaluation returned (metrics, base_model, ...)
    report: Path          # the self-contained report.html
    metadata: dict        # output_uri, mlflow_run_id, model, base_model (artifact metadata)
    scratch: Path | None = None  # the images, report and downloads (uploaded to output_uri)

    @property
    def metrics(self) -> dict:
        return {k: float(v) for k, v in sorted(self.result["metrics"].items())}


def resolve_registered(name: str, alias: str, base_model: str, work: Path) -> tuple[str, str]:
    """(weights source, base model) of `name@alias`: the immutable S3 folder the version was registered
    from when its manifest still matches the version's digest, else the registry's own copy."""
    from mlflow import MlflowClient

    from chunkgrpo.errors import UserError
    from chunkgrpo.store.client import ArtifactStore

    uri = f"models:/{name}@{alias or 'champion'}"
    try:
        mv = MlflowClient().get_model_version_by_alias(name, alias or "champion")
    except Exception as e:
        raise UserError(f"cannot resolve {uri}: {e}") from None
    from chunkgrpo.registry.client import version_details
    from chunkgrpo.registry.gate import WEIGHTS_TAG

    tags = mv.tags or {}
    ckpt = str(version_details(MlflowClient(), mv).get("checkpoint_uri") or "")
    manifest = ArtifactStore().read_manifest(ckpt) if ckpt else None
    # the checkpoint counts only when it holds the weights the registry recorded (tag weights.sha256)
    if manifest is not None and manifest.content_sha256 == tags.get(WEIGHTS_TAG):
        source = ckpt  # checksums are verified on download
    else:
        from chunkgrpo.registry.load import load_registered_model

        source = str(load_registered_model(uri, work / "registered").weights_dir)
    print(f"{uri} = v{mv.version} <- {source}")
    return source, base_model or tags.get("base_model", "")


def run(cfg) -> dict:
    """Evaluate an EvalConfig (the CLI's `chunkgrpo evaluate` and the pipeline step)."""
    from chunkgrpo.eval.runner import run_evaluation

    return run_evaluation(cfg)


def evaluate(req: EvalRequest) -> Evaluation:
    """Generate and score the benchmark images of the model and its base model; base images are shared
    between runs (`base_cache`); outputs uploaded to `<artifact_root>/<run_id>/<stage>`. The local files
    are in a scratch folder the result owns (`with evaluate(req) as ev:`); removed here on failure."""
    from chunkgrpo.tempdirs import owned_on_failure

    with owned_on_failure("chunkgrpo-eval-") as work:
        return _evaluate(req, work)


def _evaluate(req: EvalRequest, work: Path) -> Evaluation:
    from chunkgrpo.errors import UserError
    from chunkgrpo.eval.base_cache import default_prefix
    from chunkgrpo.eval.config import EvalConfig
    from chunkgrpo.eval.runner import summary_lines
    from chunkgrpo.model_cache import scorer_weight_overrides

    source, base_model, label = "", req.base_model, ""
    if req.model_pointer and Path(req.model_pointer).exists():
        source = str(work / "pointer.json")  # load_trained verifies the manifest digest
        Path(source).write_bytes(Path(req.model_pointer).read_bytes())
    elif req.registered_model:
        source, base_model = resolve_registered(req.registered_model, req.alias, base_model, work)
        label = f"models:/{req.registered_model}@{req.alias or 'champion'}"
    elif not base_model:
        raise UserError("nothing to evaluate: give a model artifact, registered_model or base_model")
    over = [
        f"base_cache={default_prefix(req.artifact_root)}",  # base images shared between runs; overrides win
        *scorer_weight_overrides(dict(req.scorer_weights)),
        *req.overrides,
        f"model={source}",
        f"output_dir={work / 'out'}",
        f"output_uri={run_prefix(req.artifact_root, req.run_id, req.stage)}",
        f"experiment={req.experiment}",
        *([f"base_model={base_model}"] if base_model else []),
        *([f"benchmarks={json.dumps(list(req.benchmarks))}"] if req.benchmarks else []),
        *([f"num_prompts={req.num_prompts}"] if req.num_prompts > 0 else []),
    ]
    cfg = EvalConfig.load(req.preset, over)
    result = run(cfg)
    for line in summary_lines(result):
        print(line)
    meta = {"output_uri": cfg.output_uri, "mlflow_run_id": result.get("mlflow_run_id") or "",
            "model": label or source or "(base only)", "base_model": result["base_model"]}
    return Evaluation(result, Path(cfg.output_dir) / "report.html", meta, scratch=work)

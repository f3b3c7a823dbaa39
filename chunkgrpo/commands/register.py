"""Register a trained model (LoRA adapter or full transformer) as an MLflow model version.

    chunkgrpo register --model-dir DIR --name NAME --base-model BASE [--kind lora|full]
                       [--metrics metrics.json] [--plan plan.json] [--checkpoint-uri s3://...]
                       [--gate-metric eval.hpdv2.hpsv3 --gate-direction max] [--eval-preset eval_hpdv2]

`--model-dir` may also be an `s3://` checkpoint folder (downloaded and verified first; it is then
also the recorded checkpoint URI). Tags: git sha, config hash, chunk plan, eval metrics
(`metric.<name>`), checkpoint URI, base model, kind. The new version gets the alias `challenger`.
A `--metrics` file written by `chunkgrpo evaluate` (format chunkgrpo.eval-metrics/v1) is recognised:
its `mlflow_run_id` (the evaluation stage's run) is linked as tag `eval.run_id` and promotion trusts
only that run's metrics, which the version's `metric.*` tags repeat (a file's numbers must agree with
the run and are otherwise only logged on the registration run); its eval protocol (preset, prompt
counts, seeds, sampling) is recorded, so promotion compares like with like. NaN, ±Infinity,
non-numeric values or a non-object file are refused (exit 2). The version is an MLflow pyfunc:
`chunkgrpo.registry.load.load_pyfunc("models:/NAME/V")` (verified) generates images. With
$CHUNKGRPO_PROMOTER_URL set, the promoter service creates the version (pipeline users: READ only).
`--gate-metric/--gate-direction` set the promotion gate of a NEW registered model only.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

NAME = "register"
HELP = "register a trained model version in the MLflow registry"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model-dir", required=True, help="folder with the weights, or an s3:// checkpoint folder"
    )
    parser.add_argument("--name", required=True, help="registered model name")
    parser.add_argument("--base-model", required=True, help="base model reference (HF id or path)")
    parser.add_argument(
        "--kind", choices=["lora", "full"], default="lora", help="LoRA adapter or full transformer"
    )
    parser.add_argument("--metrics", help="JSON file of evaluation metrics (nested keys are joined with '.')")
    parser.add_argument("--plan", help="JSON file with the chunk plan")
    parser.add_argument("--checkpoint-uri", help="s3:// URI of the checkpoint folder in the artifact store")
    parser.add_argument("--config-hash", default="", help="hash of the training config")
    parser.add_argument(
        "--git-sha", default=None, help="code version (default: git HEAD or $CHUNKGRPO_GIT_SHA)"
    )
    parser.add_argument("--external-weights", action="store_true",
                        help="do not copy weights into MLflow; keep them at --checkpoint-uri")
    parser.add_argument("--experiment", default="chunkgrpo", help="MLflow experiment of the registration run")
    parser.add_argument("--gate-metric", default=None, help="gate metric of a new registered model "
                        "(default eval.hpdv2.hpsv3); ignored (with a warning) for an existing one")
    parser.add_argument(
        "--gate-direction",
        choices=["max", "min"],
        default=None,
        help="direction of --gate-metric for a new registered model (default: the metric's known one)",
    )
    parser.add_argument(
        "--eval-preset", default="", help="evaluation preset the --metrics file came from (protocol)"
    )
    parser.add_argument("--eval-run-id", default=None,
                        help="the evaluation stage's MLflow run (default: the --metrics file's "
                             "mlflow_run_id); "
                             "promotion trusts only that run's metrics")


def _read_json(path: str | None, what: str):
    from chunkgrpo.inputs import read_json

    if not path:
        return None
    return read_json(path, f"--{what}")


def check_model_name(name: str) -> None:
    """MLflow's registered-model name rules, checked before anything is uploaded."""
    from chunkgrpo.errors import UserError
    from chunkgrpo.registry.gate import check_name

    try:
        check_name(name)
    except UserError as e:
        raise UserError(f"--name: {e}") from None
    try:
        from mlflow.exceptions import MlflowException
        from mlflow.utils.validation import _validate_model_name
    except ImportError:  # private helper moved: the rules above still apply
        return
    try:
        _validate_model_name(name)
    except MlflowException as e:
        raise UserError(f"--name {name!r}: {e.message}") from None


def run(args: argparse.Namespace) -> int:
    import tempfile

    from chunkgrpo.errors import UserError
    from chunkgrpo.registry.gate import flat_metrics, metrics_from_eval
    from chunkgrpo.registry.registration import Registration, register_model

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    check_model_name(args.name)  # before any upload or run is created

    metrics, plan = _read_json(args.metrics, "metrics"), _read_json(args.plan, "plan")
    if metrics is not None and not isinstance(metrics, dict):
        raise UserError(f"--metrics {args.metrics}: expected a JSON object (an evaluation's metrics.json), "
                        f"got a JSON {type(metrics).__name__}")
    protocol = sampling = None
    eval_run_id = args.eval_run_id
    if isinstance(metrics, dict) and str(metrics.get("format", "")).startswith("chunkgrpo.eval-metrics/"):
        eval_run_id = eval_run_id or metrics.get("mlflow_run_id") or None
        metrics, protocol, sampling = metrics_from_eval(metrics, args.eval_preset)
    flat_metrics(metrics, f"--metrics {args.metrics}")  # NaN/inf/non-numeric: one line, before any upload
    checkpoint = args.checkpoint_uri
    with tempfile.TemporaryDirectory(prefix="chunkgrpo-ckpt-") as tmp:
        model_dir = args.model_dir
        if model_dir.startswith("s3://"):
            from chunkgrpo.store.client import ArtifactStore

            ArtifactStore().get_folder(model_dir, tmp)
            checkpoint = checkpoint or model_dir
            model_dir = tmp
        elif not Path(model_dir).is_dir():
            raise FileNotFoundError(2, "no such directory", model_dir)
        req = Registration(args.name, args.base_model, model_dir, kind=args.kind, checkpoint_uri=checkpoint,
                           include_weights=False if args.external_weights else None, metrics=metrics,
                           eval_run_id=eval_run_id, eval_protocol=protocol, sampling=sampling, plan=plan,
                           git=args.git_sha, cfg_hash=args.config_hash, gate_metric=args.gate_metric,
                           gate_direction=args.gate_direction)
        rv = register_model(req, experiment=args.experiment)
    print(
        f"{rv.name} version {rv.version}{' (existing, same content)' if rv.reused else ''}: "
        f"{rv.uri}  source {rv.source}"
    )
    return 0

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


def run(args: argparse.Namespace) -> int:
    from dataclasses import fields

    from chunkgrpo.stages.register import FolderRegistration, register_folder

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # the request's fields are the arguments' names
    req = FolderRegistration(**{f.name: getattr(args, f.name) for f in fields(FolderRegistration)})
    rv = register_folder(req)
    print(
        f"{rv.name} version {rv.version}{' (existing, same content)' if rv.reused else ''}: "
        f"{rv.uri}  source {rv.source}"
    )
    return 0

"""The MLflow parent run of a pipeline run: opened by the first step (found again on a retry), closed by
the exit handler with the KFP run's final state, after the run's leftover training jobs are deleted."""

from __future__ import annotations

import math
import os
from typing import Any

KFP_TO_MLFLOW = {"SUCCEEDED": "FINISHED", "FAILED": "FAILED", "CANCELED": "KILLED", "CANCELLED": "KILLED"}


HEADLINE_SUFFIXES = (".trained", ".base", ".delta")  # an evaluation's per-label means and paired delta


def _stage_runs(client, run) -> dict[str, Any]:
    """The latest run of each stage (tag chunkgrpo.stage) nested under `run`."""
    children = client.search_runs([run.info.experiment_id],
                                  filter_string=f"tags.`mlflow.parentRunId` = '{run.info.run_id}'",
                                  order_by=["attributes.start_time ASC"], max_results=1000)
    return {c.data.tags.get("chunkgrpo.stage", c.info.run_name): c for c in children}


def summarize_parent(client, run_id: str) -> dict[str, Any]:
    """Copy the headline results of the stage runs under `run_id` onto it, so the pipeline's run page shows
    them: the training's final `reward/mean` (at its last step), the evaluation's trained/base/delta means
    as `eval/<benchmark>.<metric>.<label>`, and the registered model and version as tags
    `chunkgrpo.registered_model` / `chunkgrpo.registered_version`. Returns what was copied."""
    run = client.get_run(run_id)
    stages = _stage_runs(client, run)
    metrics: dict[str, tuple[float, int]] = {}
    train = stages.get("train")
    if train is not None:
        hist = client.get_metric_history(train.info.run_id, "reward/mean")
        if hist:
            last = max(hist, key=lambda m: (m.step, m.timestamp))
            metrics["reward/mean"] = (last.value, last.step)
    evaluate = stages.get("evaluate")
    if evaluate is not None:
        for k, v in evaluate.data.metrics.items():
            if k.endswith(HEADLINE_SUFFIXES):
                metrics[f"eval/{k}"] = (v, 0)
    tags: dict[str, str] = {}
    for rid in [run_id, *(st.info.run_id for st in stages.values())]:  # a register step may log into either
        for mv in client.search_model_versions(f"run_id = '{rid}'"):
            tags = {"chunkgrpo.registered_model": mv.name, "chunkgrpo.registered_version": str(mv.version)}
    for k, (v, step) in metrics.items():
        if math.isfinite(v):
            client.log_metric(run_id, k, v, step=step)
    for k, v in tags.items():
        client.set_tag(run_id, k, v)
    return {"metrics": {k: v for k, (v, _) in metrics.items()}, "tags": tags}


def open_run(experiment: str, run_name: str, kfp_run_id: str, pipeline: str) -> str:
    """The parent run's id (tag kfp.run_id makes this idempotent); '' when MLFLOW_TRACKING_URI is unset."""
    if not os.environ.get("MLFLOW_TRACKING_URI"):
        print("MLFLOW_TRACKING_URI is not set: MLflow tracking is off for this run")
        return ""
    from mlflow import MlflowClient

    from chunkgrpo.tracking import open_pipeline_run

    run, created = open_pipeline_run(MlflowClient(), experiment, run_name, {"kfp.pipeline": pipeline},
                                     kfp_run_id=kfp_run_id)
    if not created:
        print(f"MLflow parent run {run.run_id} (existing, retry)")
        return run.run_id
    print(
        f"MLflow parent run {run.run_id} in experiment {experiment!r} at {os.environ['MLFLOW_TRACKING_URI']}"
    )
    return run.run_id


def cleanup_jobs(kfp_run_id: str, namespace: str = "") -> None:
    """Delete the run's still-active TrainJobs/PyTorchJobs (a launcher step that was evicted or SIGKILLed
    cannot delete its own); a failure is printed, never raised (the run's state must still be recorded)."""
    from chunkgrpo.k8s import launcher

    ns = namespace or launcher.current_namespace("kubeflow")
    try:
        deleted = launcher.cleanup_run(launcher.load_api(), ns, kfp_run_id)
        print(f"deleted orphaned training jobs: {', '.join(deleted)}" if deleted
              else "no active training jobs left")
    except Exception as e:
        print(f"ERROR: could not clean up the training jobs of run {kfp_run_id} in {ns}: {e}", flush=True)


def close_run(experiment: str, kfp_run_id: str, state: str, error_message: str = "") -> None:
    """Set the parent run's final MLflow status (and tags kfp.state, kfp.error) from the KFP run's state."""
    if not os.environ.get("MLFLOW_TRACKING_URI"):
        return
    from mlflow import MlflowClient

    from chunkgrpo.tracking import find_pipeline_run

    client = MlflowClient()
    run_id = find_pipeline_run(client, experiment, kfp_run_id)
    if not run_id:
        print(f"no MLflow parent run tagged kfp.run_id={kfp_run_id}")
        return
    status = KFP_TO_MLFLOW.get(str(state).upper(), "FINISHED")
    try:  # the run's page shows its results; a failure here must not keep the run's state unrecorded
        copied = summarize_parent(client, run_id)
        print(f"MLflow parent run {run_id}: copied {len(copied['metrics'])} headline metrics"
              + (f", model {copied['tags']['chunkgrpo.registered_model']} version "
                 f"{copied['tags']['chunkgrpo.registered_version']}" if copied["tags"] else ""))
    except Exception as e:
        print(f"WARNING: could not copy the stage results onto MLflow parent run {run_id}: {e}", flush=True)
    client.set_tag(run_id, "kfp.state", str(state))
    if error_message:
        client.set_tag(run_id, "kfp.error", str(error_message)[:4000])
    client.set_terminated(run_id, status=status)
    print(f"MLflow parent run {run_id}: {status}")

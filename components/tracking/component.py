"""MLflow parent run of a pipeline run: `open_run` (first step) and `close_run` (exit handler)."""

from kfp import dsl

from components._shared import stage_env
from components.images import RUNTIME_IMAGE


@dsl.component(base_image=RUNTIME_IMAGE, install_kfp_package=False, additional_funcs=[stage_env])
def open_run(experiment: str, run_name: str, kfp_run_id: str, pipeline: str) -> str:
    """Create the MLflow parent run of this pipeline run, or find it again on a retry.

    Args:
        experiment: MLflow experiment name.
        run_name: MLflow run name (the KFP run name).
        kfp_run_id: KFP run id; stored as tag `kfp.run_id`, which makes the step idempotent.
        pipeline: pipeline name, stored as tag `kfp.pipeline`.

    Returns:
        The MLflow run id ('' when MLFLOW_TRACKING_URI is not set: tracking off).
    """
    import os

    stage_env("")
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


@dsl.component(base_image=RUNTIME_IMAGE, install_kfp_package=False)
def close_run(
    experiment: str,
    kfp_run_id: str,
    status: dsl.PipelineTaskFinalStatus,
    cleanup_jobs: bool = False,
    job_namespace: str = "",
):
    """Exit handler: delete the run's still-active training jobs, then set the parent run's final
    MLflow status from the KFP run's state.

    Args:
        experiment: MLflow experiment name.
        kfp_run_id: KFP run id (tag `kfp.run_id` of the parent run; label of its training jobs).
        cleanup_jobs: delete TrainJobs/PyTorchJobs labelled with this run that are still active (a
            launcher step that was evicted or SIGKILLed cannot delete its own job).
        job_namespace: namespace of the training jobs ('' = this pod's).
    """
    import os

    if cleanup_jobs:
        from chunkgrpo.k8s import launcher

        ns = job_namespace or launcher.current_namespace("kubeflow")
        try:
            deleted = launcher.cleanup_run(launcher.load_api(), ns, kfp_run_id)
            print(
                f"deleted orphaned training jobs: {', '.join(deleted)}"
                if deleted
                else "no active training jobs left"
            )
        except Exception as e:
            print(f"ERROR: could not clean up the training jobs of run {kfp_run_id} in {ns}: {e}", flush=True)

    if not os.environ.get("MLFLOW_TRACKING_URI"):
        return
    from mlflow import MlflowClient

    from chunkgrpo.tracking import find_pipeline_run

    client = MlflowClient()
    run_id = find_pipeline_run(client, experiment, kfp_run_id)
    if not run_id:
        print(f"no MLflow parent run tagged kfp.run_id={kfp_run_id}")
        return
    state = {"SUCCEEDED": "FINISHED", "FAILED": "FAILED", "CANCELED": "KILLED", "CANCELLED": "KILLED"}.get(
        str(status.state).upper(), "FINISHED")
    client.set_tag(run_id, "kfp.state", str(status.state))
    if status.error_message:
        client.set_tag(run_id, "kfp.error", str(status.error_message)[:4000])
    client.set_terminated(run_id, status=state)
    print(f"MLflow parent run {run_id}: {state}")

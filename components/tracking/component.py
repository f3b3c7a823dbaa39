"""MLflow parent run of a pipeline run: `open_run` (first step) and `close_run` (exit handler). The steps
are `chunkgrpo.stages.tracking`."""

from kfp import dsl

from components.images import RUNTIME_IMAGE


@dsl.component(base_image=RUNTIME_IMAGE, install_kfp_package=False)
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
    from chunkgrpo.stages.task import stage_env

    stage_env("")
    from chunkgrpo.stages.tracking import open_run as open_stage

    return open_stage(experiment, run_name, kfp_run_id, pipeline)


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
    from chunkgrpo.stages import tracking

    if cleanup_jobs:
        tracking.cleanup_jobs(kfp_run_id, job_namespace)
    tracking.close_run(experiment, kfp_run_id, str(status.state), str(status.error_message or ""))

"""Multi-node training: create (or re-attach to) a Kubeflow Trainer TrainJob / PyTorchJob and wait.
The step is `chunkgrpo.stages.launch.launch`."""

from kfp import dsl
from kfp.dsl import Metrics, Model, Output

from components.images import LAUNCHER_IMAGE


@dsl.component(base_image=LAUNCHER_IMAGE, install_kfp_package=False)
def launch_trainjob(
    kind: str, namespace: str, image: str, num_nodes: int, nproc_per_node: int, gpus_per_node: int,
    node_selector: dict, tolerations: list, shm_size: str, model: str, prompts: str, preset: str, method: str,
    chunks: str, max_iterations: int, overrides: list, artifact_root: str, run_id: str, experiment: str,
    parent_run_id: str, timeout_hours: float, trained_model: Output[Model], metrics: Output[Metrics],
    queue_name: str = "", image_pull_secrets: list = [], reward_weights: dict = {}, keep_failed: bool = False,
    schedule_grace_minutes: float = 15.0, reward_url: str = "",
):
    """Run `torchrun -m chunkgrpo.train` on `num_nodes` nodes as a TrainJob (Trainer v2) or PyTorchJob (v1).

    The job is named from the KFP run id, so a retried step re-attaches to it instead of starting a
    second one; cancelling the run (SIGTERM) deletes it. Status changes are printed; a failed job
    fails the step with the job's reason. The job's pods and events are read on every poll: pods
    that cannot be created (PodSecurity, quota), stay unschedulable past `schedule_grace_minutes`,
    cannot pull their image, are OOMKilled or evicted end the step in one line naming the cause and
    the fix, and the job is deleted unless `keep_failed`.

    Args:
        kind: TrainJob (Kubeflow Trainer v2, runtime chunkgrpo-torch) | PyTorchJob (Training Operator v1).
        namespace: namespace for the job ('' = this pod's namespace).
        image: training image (the runtime image).
        num_nodes: nodes.
        nproc_per_node: torchrun processes per node.
        gpus_per_node: GPUs per node (0 = the runtime's/template's, which also keeps its RDMA devices, CPU and
            memory; > 0 is merged into them).
        node_selector: extra node labels for the training pods (the runtime already pins the pool).
        tolerations: extra tolerations for the training pods, added to the runtime's (Trainer replaces the
            runtime's list with a patch's, so the launcher sends the runtime's plus these).
        shm_size: size of the memory-backed /dev/shm ('' = the runtime's, e.g. 128Gi on the GPU overlays).
        model: base model (s3:// folder artifact or hub id cached in the image/PVC).
        prompts: prompt file: must be readable in the training pods (an s3:// object is downloaded first).
        preset: training preset ('' = the method's own preset).
        method: chunk | chunk+ws | dance | tempflow | granular.
        chunks: chunk plan (`sizes:...` from the plan step).
        max_iterations: training length in rollouts (iterations); 0 = the preset's length (< 0 is rejected).
        overrides: extra training overrides (key=value).
        artifact_root: s3:// prefix; the model goes to <root>/<run_id>/train/final.
        run_id: KFP run id (job name and label).
        experiment: MLflow experiment.
        parent_run_id: MLflow parent run id.
        timeout_hours: fail (and delete the job) after this long.
        queue_name: Kueue LocalQueue ('' = no Kueue); the job is created suspended and Kueue admits it.
        image_pull_secrets: Secrets for pulling the training image from a private registry.
        reward_weights: {reward: weights URI, '<reward>.processor': URI} for the preset's rewards.
        keep_failed: keep a job the launcher found blocked (for `kubectl describe`); default: delete it.
        schedule_grace_minutes: how long pods may stay unschedulable before the step fails.
        reward_url: a reward server for every reward without a url of its own ('' = none).
    """
    from chunkgrpo.stages.task import stage_env

    stage_env(parent_run_id)
    from chunkgrpo.stages.launch import JobOptions, launch
    from chunkgrpo.stages.train import TrainRequest

    req = TrainRequest(model, prompts, preset, method, chunks, max_iterations, list(overrides), artifact_root,
                       run_id, experiment, parent_run_id, dict(reward_weights), reward_url)
    job = JobOptions(kind, namespace, image, num_nodes, nproc_per_node, gpus_per_node, dict(node_selector),
                     list(tolerations), shm_size, timeout_hours, queue_name, list(image_pull_secrets),
                     keep_failed, schedule_grace_minutes)
    out = launch(req, job)
    out.write(trained_model.path)
    trained_model.metadata.update(out.metadata)
    for name, value in out.metrics.items():
        metrics.log_metric(name, value)

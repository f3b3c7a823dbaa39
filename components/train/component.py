"""Single-node training inside the KFP task: torchrun (rendezvous on 127.0.0.1), final model -> S3,
pointer. The step is `chunkgrpo.stages.train.train`."""

from kfp import dsl
from kfp.dsl import Metrics, Model, Output

from components.images import RUNTIME_IMAGE


@dsl.component(base_image=RUNTIME_IMAGE, install_kfp_package=False)
def train(model: str, prompts: str, preset: str, method: str, chunks: str, max_iterations: int,
          nproc_per_node: int, overrides: list, artifact_root: str, run_id: str, experiment: str,
          parent_run_id: str, trained_model: Output[Model], metrics: Output[Metrics],
          reward_weights: dict = {}, reward_url: str = ""):
    """GRPO fine-tuning with `python -m chunkgrpo.torchrun_local --nproc-per-node=N -m chunkgrpo.train`
    (torchrun, rendezvous store listening on 127.0.0.1 only).

    Args:
        model: base model (diffusers folder, s3:// folder artifact or cached hub id).
        prompts: training prompt file (local path or s3:// object).
        preset: training preset (chunk_grpo_flux, chunk_grpo_ws_flux, step_grpo_flux, dance_grpo_flux,
            tempflow_grpo_flux, granular_grpo_flux, tiny_cpu, ... or a YAML path); '' = the method's own
            preset.
        method: chunk | chunk+ws | dance | tempflow | granular.
        chunks: the chunk plan spec (`sizes:...` from the plan step, or uniform:N | step | whole).
        max_iterations: training length in rollouts (iterations); 0 = the preset's length (< 0 is rejected).
        nproc_per_node: torchrun processes (= GPUs of the task).
        overrides: extra training overrides (key=value).
        artifact_root: s3:// prefix for large outputs; the model goes to <root>/<run_id>/train/final.
        run_id: KFP run id.
        experiment: MLflow experiment.
        parent_run_id: MLflow parent run id ('' = none).
        reward_weights: {reward: weights URI, '<reward>.processor': URI} for the preset's rewards.
        reward_url: a reward server for every reward without a url of its own ('' = none).
    """
    from chunkgrpo.stages.task import stage_env

    stage_env(parent_run_id)
    from chunkgrpo.stages.train import TrainRequest
    from chunkgrpo.stages.train import train as train_stage

    req = TrainRequest(model, prompts, preset, method, chunks, max_iterations, list(overrides), artifact_root,
                       run_id, experiment, parent_run_id, dict(reward_weights), reward_url)
    out = train_stage(req, nproc_per_node)
    out.write(trained_model.path)
    trained_model.metadata.update(out.metadata)
    for name, value in out.metrics.items():
        metrics.log_metric(name, value)

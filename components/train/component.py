"""Single-node training inside the KFP task: torchrun (rendezvous on 127.0.0.1), final model -> S3,
pointer."""

from kfp import dsl
from kfp.dsl import Metrics, Model, Output

from components._shared import local_file, run_prefix, stage_env
from components.images import RUNTIME_IMAGE


@dsl.component(base_image=RUNTIME_IMAGE, install_kfp_package=False,
               additional_funcs=[local_file, run_prefix, stage_env])
def train(
    model: str,
    prompts: str,
    preset: str,
    method: str,
    chunks: str,
    max_iterations: int,
    nproc_per_node: int,
    overrides: list,
    artifact_root: str,
    run_id: str,
    experiment: str,
    parent_run_id: str,
    trained_model: Output[Model],
    metrics: Output[Metrics],
    reward_weights: dict = {},
):
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
    """
    import json
    import shlex
    import tempfile
    from pathlib import Path

    stage_env(parent_run_id)
    from chunkgrpo.model_cache import reward_weight_overrides
    from chunkgrpo.recipes import preset_for
    from chunkgrpo.store.client import ArtifactStore
    from chunkgrpo.store.manifest import make_pointer

    preset = preset_for(method, preset)

    prefix = run_prefix(artifact_root, run_id, "train")
    out = Path(tempfile.mkdtemp(prefix="chunkgrpo-train-")) / "out"
    args = [
        *overrides,
        *reward_weight_overrides(preset, list(overrides), dict(reward_weights)),
        f"model={model}",
        f"prompts={local_file(prompts)}",
        f"method={method}",
        f"chunks={chunks}",
        *(
            [f"max_iterations={max_iterations}"] if max_iterations != 0 else []
        ),  # negative: the trainer says why
        f"output_dir={out}",  # progress: plain lines in the task's log (every 10 % or 30 s), not a bar
        f"checkpoint.s3_prefix={prefix}/checkpoints",  # a retried task resumes from here
        f"tracking.experiment={experiment}",
        f"tracking.parent_run_id={parent_run_id}",
        f"tracking.run_name=train-{run_id[:8]}",
    ]
    from chunkgrpo.torchrun_local import command

    # torchrun on one node, rendezvous store on 127.0.0.1 only (--standalone listens on every interface)
    cmd = command(nproc_per_node, "-m", "chunkgrpo.train", "--config", preset, *args)
    print("+ torchrun " + shlex.join(cmd[3:]), flush=True)
    from chunkgrpo.torchrun import run_torchrun

    run_torchrun(
        cmd
    )  # ranks' output streamed into the task log; a rank's user error becomes this task's error

    summary = json.loads((out / "train_summary.json").read_text())
    info = json.loads((out / "final" / "chunkgrpo_model.json").read_text())
    uri = f"{prefix}/final"
    store = ArtifactStore()
    manifest = store.put_folder(out / "final", uri, meta={"kind": "model", "run_id": run_id})
    store.put_file(out / "train_summary.json", f"{prefix}/train_summary.json")
    pointer = make_pointer(
        uri,
        manifest.sha256,
        info["kind"],
        base_model=model,
        method=method,
        chunk_sizes=summary["chunk_sizes"],
        optimizer_steps=summary["optimizer_steps"],
        config_hash=summary["config_hash"],
        mlflow_run_id=summary.get("mlflow_run_id") or "",
        kfp_run_id=run_id,
    )
    Path(trained_model.path).write_text(json.dumps(pointer, indent=1))
    trained_model.metadata.update({k: v for k, v in pointer.items() if isinstance(v, (str, int, float))})
    hist = summary["history"]
    metrics.log_metric("optimizer_steps", float(summary["optimizer_steps"]))
    metrics.log_metric("reward_mean.first", float(hist[0]["reward_mean"]))
    metrics.log_metric("reward_mean.last", float(hist[-1]["reward_mean"]))
    metrics.log_metric("loss.last", float(hist[-1]["loss"]))
    print(f"model -> {uri} (manifest sha256 {manifest.sha256[:12]}, {manifest.total_bytes / 1e6:.1f} MB)")

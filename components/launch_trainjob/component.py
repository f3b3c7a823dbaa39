"""Multi-node training: create (or re-attach to) a Kubeflow Trainer TrainJob / PyTorchJob and wait."""

from kfp import dsl
from kfp.dsl import Metrics, Model, Output

from components._shared import run_prefix, stage_env
from components.images import LAUNCHER_IMAGE


@dsl.component(base_image=LAUNCHER_IMAGE, install_kfp_package=False, additional_funcs=[run_prefix, stage_env])
def launch_trainjob(
    kind: str,
    namespace: str,
    image: str,
    num_nodes: int,
    nproc_per_node: int,
    gpus_per_node: int,
    node_selector: dict,
    tolerations: list,
    shm_size: str,
    model: str,
    prompts: str,
    preset: str,
    method: str,
    chunks: str,
    max_iterations: int,
    overrides: list,
    artifact_root: str,
    run_id: str,
    experiment: str,
    parent_run_id: str,
    timeout_hours: float,
    trained_model: Output[Model],
    metrics: Output[Metrics],
    queue_name: str = "",
    image_pull_secrets: list = [],
    reward_weights: dict = {},
    keep_failed: bool = False,
    schedule_grace_minutes: float = 15.0,
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
    """
    import json
    from pathlib import Path

    stage_env(parent_run_id)
    from chunkgrpo.k8s import jobspec, launcher, trainjob
    from chunkgrpo.k8s.diagnose import JobProbe
    from chunkgrpo.model_cache import reward_weight_overrides
    from chunkgrpo.recipes import preset_for
    from chunkgrpo.store.client import ArtifactStore
    from chunkgrpo.store.manifest import make_pointer

    preset = preset_for(method, preset)

    prefix = run_prefix(artifact_root, run_id, "train")
    ns = namespace or launcher.current_namespace("kubeflow")
    prompts_path = (
        "/tmp/inputs/prompts" + (Path(prompts).suffix or ".txt") if prompts.startswith("s3://") else prompts
    )
    spec = jobspec.JobSpec(
        name=jobspec.job_name(run_id, "train"),
        namespace=ns,
        image=image,
        num_nodes=num_nodes,
        nproc_per_node=nproc_per_node,
        gpus_per_node=gpus_per_node,
        node_selector=dict(node_selector),
        tolerations=list(tolerations),
        shm_size=shm_size,
        run_id=run_id,
        upload_final_to=f"{prefix}/final",
        fetch={prompts_path: prompts} if prompts.startswith("s3://") else {},
        active_deadline_seconds=int(timeout_hours * 3600) or None,
        queue_name=queue_name,
        image_pull_secrets=list(image_pull_secrets),
        secret_env={
            "AWS_ACCESS_KEY_ID": ("chunkgrpo-s3", "AWS_ACCESS_KEY_ID"),
            "AWS_SECRET_ACCESS_KEY": ("chunkgrpo-s3", "AWS_SECRET_ACCESS_KEY"),
        },
        env={"CHUNKGRPO_MLFLOW_PARENT_RUN_ID": parent_run_id},
        train_args=[
            "--config",
            preset,
            *overrides,
            *reward_weight_overrides(preset, list(overrides), dict(reward_weights)),
            f"model={model}",
            f"prompts={prompts_path}",
            f"method={method}",
            f"chunks={chunks}",
            *(
                [f"max_iterations={max_iterations}"] if max_iterations != 0 else []
            ),  # negative: the trainer says why
            "progress=false",
            f"checkpoint.s3_prefix={prefix}/checkpoints",
            f"tracking.experiment={experiment}",
            f"tracking.parent_run_id={parent_run_id}",
            f"tracking.run_name=train-{run_id[:8]}",
        ],
    )
    api = launcher.load_api()
    try:  # ownerReference to the run's Argo Workflow: deleting the run deletes the job
        spec.owner = launcher.owner_from_pod(launcher.this_pod_getter(ns))
    except Exception as e:
        print(f"warning: no ownerReference for the job ({type(e).__name__}: {e})", flush=True)
    if kind == "PyTorchJob":
        template = launcher.read_template(api, ns)  # TemplateError (one line) if missing or forbidden
    elif trainjob.needs_runtime(spec):  # resource overrides / extra tolerations are merged into the runtime's
        template = launcher.read_runtime(api, spec.runtime_name, spec.runtime_kind, ns)
    else:
        template = None
    obj = launcher.build_job(kind, spec, template)
    core = launcher.load_core_api()  # the job's pods and events: blockers end the step in one line

    def probe(created: dict):
        return JobProbe.for_job(core, created, schedule_grace_s=schedule_grace_minutes * 60)

    launcher.launch(api, obj, timeout_s=timeout_hours * 3600, poll_s=20, probe_factory=probe,
              keep_failed=keep_failed, logs=trainjob.trainjob_log_tail,  # node 0's log tail (kubeflow SDK)
              on_status=lambda line: print(line, flush=True))

    store = ArtifactStore()
    manifest = store.read_manifest(f"{prefix}/final")
    if manifest is None:
        raise RuntimeError(f"{kind} {spec.name} succeeded but {prefix}/final holds no complete model")
    summary = json.loads(store.get_bytes(f"{prefix}/final.train_summary.json"))
    info = json.loads(store.get_bytes(f"{prefix}/final/chunkgrpo_model.json"))
    pointer = make_pointer(
        f"{prefix}/final",
        manifest.sha256,
        info["kind"],
        base_model=model,
        method=method,
        chunk_sizes=summary["chunk_sizes"],
        optimizer_steps=summary["optimizer_steps"],
        config_hash=summary["config_hash"],
        kfp_run_id=run_id,
        job=f"{kind}/{ns}/{spec.name}",
    )
    Path(trained_model.path).write_text(json.dumps(pointer, indent=1))
    trained_model.metadata.update({k: v for k, v in pointer.items() if isinstance(v, (str, int, float))})
    metrics.log_metric("optimizer_steps", float(summary["optimizer_steps"]))
    metrics.log_metric("reward_mean.last", float(summary["history"][-1]["reward_mean"]))
    print(f"model -> {prefix}/final (manifest sha256 {manifest.sha256[:12]})")

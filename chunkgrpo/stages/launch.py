"""Multi-node training: create (or re-attach to) a Kubeflow Trainer TrainJob or a PyTorchJob for a
`TrainRequest`, watch it until it ends, and return the model it wrote. Needs no torch (launcher image)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from chunkgrpo.config import option
from chunkgrpo.stages.train import TrainedModel, TrainRequest, model_pointer

S3_SECRET_ENV = {"AWS_ACCESS_KEY_ID": ("chunkgrpo-s3", "AWS_ACCESS_KEY_ID"),
                 "AWS_SECRET_ACCESS_KEY": ("chunkgrpo-s3", "AWS_SECRET_ACCESS_KEY")}


@dataclass(frozen=True)
class JobOptions:
    """Where and how the training job runs."""

    kind: str = option("TrainJob", "TrainJob (Kubeflow Trainer v2) | PyTorchJob (Training Operator v1)")
    namespace: str = option("", "namespace of the job ('' = this pod's)")
    image: str = option("", "training image (the runtime image)")
    num_nodes: int = option(1, "training nodes")
    nproc_per_node: int = option(8, "torchrun processes per node")
    gpus_per_node: int = option(0, "GPUs per node (0 = the runtime's/template's resources)")
    node_selector: dict = option({}, "extra node labels for the training pods")
    tolerations: list = option([], "extra tolerations, added to the runtime's")
    shm_size: str = option("", "memory-backed /dev/shm ('' = the runtime's)")
    timeout_hours: float = option(48.0, "fail (and delete the job) after this long")
    queue_name: str = option("", "Kueue LocalQueue ('' = no Kueue)")
    image_pull_secrets: list = option([], "Secrets for pulling the training image")
    keep_failed: bool = option(False, "keep a job found blocked (for `kubectl describe`)")
    schedule_grace_minutes: float = option(15.0, "how long pods may stay unschedulable")


def _reward_token(req: TrainRequest) -> dict:
    """The reward server's token (Secret chunkgrpo-reward in the job's namespace) when a reward is served."""
    from chunkgrpo.scoring.service import TOKEN_ENV
    from chunkgrpo.stages.train import reward_servers

    served = reward_servers(req.config, list(req.overrides), req.reward_url)
    return {TOKEN_ENV: ("chunkgrpo-reward", TOKEN_ENV)} if served else {}


def job_spec(req: TrainRequest, job: JobOptions, namespace: str):
    """The JobSpec of a run: named from the run id (a retry re-attaches), the model uploaded to
    `<prefix>/final` by node 0, an s3:// prompt file fetched into the pods first."""
    from chunkgrpo.k8s import jobspec

    preset, prefix, prompts = req.config, req.prefix, req.prompts
    fetched = prompts.startswith("s3://")
    prompts_path = "/tmp/inputs/prompts" + (Path(prompts).suffix or ".txt") if fetched else prompts
    return jobspec.JobSpec(
        name=jobspec.job_name(req.run_id, "train"), namespace=namespace, image=job.image,
        num_nodes=job.num_nodes, nproc_per_node=job.nproc_per_node, gpus_per_node=job.gpus_per_node,
        node_selector=dict(job.node_selector), tolerations=list(job.tolerations), shm_size=job.shm_size,
        run_id=req.run_id, upload_final_to=f"{prefix}/final",
        fetch={prompts_path: prompts} if fetched else {},
        active_deadline_seconds=int(job.timeout_hours * 3600) or None, queue_name=job.queue_name,
        image_pull_secrets=list(job.image_pull_secrets), secret_env={**S3_SECRET_ENV, **_reward_token(req)},
        env={"CHUNKGRPO_MLFLOW_PARENT_RUN_ID": req.parent_run_id},
        train_args=["--config", preset, *req.train_args(prompts_path)],
    )


def launch(req: TrainRequest, job: JobOptions) -> TrainedModel:
    """Run the job to its end (status lines printed; pods that cannot start end it in one line naming the
    cause), then read the model it uploaded."""
    from chunkgrpo.k8s import cancel, launcher, trainjob
    from chunkgrpo.k8s.diagnose import JobProbe
    from chunkgrpo.store.client import ArtifactStore

    ns = job.namespace or launcher.current_namespace("kubeflow")
    spec = job_spec(req, job, ns)
    api = launcher.load_api()
    get_pod = None
    try:  # ownerReference to the run's Argo Workflow: deleting the run deletes the job
        get_pod = launcher.this_pod_getter(ns)
        spec.owner = launcher.owner_from_pod(get_pod)
    except Exception as e:
        print(f"warning: no ownerReference for the job ({type(e).__name__}: {e})", flush=True)
    # on SIGTERM: a cancelled run deletes the job, a drained launcher pod leaves it for the retry
    is_cancellation = cancel.for_launcher(api, spec.owner, ns, get_pod)
    if job.kind == "PyTorchJob":
        template = launcher.read_template(api, ns)  # TemplateError (one line) if missing or forbidden
    elif trainjob.needs_runtime(spec):  # resource overrides / extra tolerations merge into the runtime's
        template = launcher.read_runtime(api, spec.runtime_name, spec.runtime_kind, ns)
    else:
        template = None
    obj = launcher.build_job(job.kind, spec, template)
    core = launcher.load_core_api()  # the job's pods and events: blockers end the step in one line

    def probe(created: dict):
        return JobProbe.for_job(core, created, schedule_grace_s=job.schedule_grace_minutes * 60)

    launcher.launch(api, obj, timeout_s=job.timeout_hours * 3600, poll_s=20, probe_factory=probe,
                    keep_failed=job.keep_failed, logs=trainjob.trainjob_log_tail,  # node 0's log tail
                    is_cancellation=is_cancellation,
                    on_status=lambda line: print(line, flush=True))

    prefix = req.prefix
    store = ArtifactStore()
    manifest = store.read_manifest(f"{prefix}/final")
    if manifest is None:
        raise RuntimeError(f"{job.kind} {spec.name} succeeded but {prefix}/final holds no complete model")
    summary = json.loads(store.get_bytes(f"{prefix}/final.train_summary.json"))
    info = json.loads(store.get_bytes(f"{prefix}/final/chunkgrpo_model.json"))
    pointer = model_pointer(req, f"{prefix}/final", manifest.sha256, info, summary, kfp_run_id=req.run_id,
                            job=f"{job.kind}/{ns}/{spec.name}")
    metrics = {"optimizer_steps": float(summary["optimizer_steps"]),
               "reward_mean.last": float(summary["history"][-1]["reward_mean"])}
    print(f"model -> {prefix}/final (manifest sha256 {manifest.sha256[:12]})")
    return TrainedModel(pointer, metrics)

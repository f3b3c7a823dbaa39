"""Kubeflow Trainer v2 (v2.2 / v2.3): a `trainer.kubeflow.org/v1alpha1` TrainJob built as a plain dict.

    runtime = read_runtime(api) if needs_runtime(spec) else None      # launcher.read_runtime
    obj = build_trainjob(spec, runtime)

Contracts: `spec.runtimeRef` names the ClusterTrainingRuntime `chunkgrpo-torch`
(manifests/base/training); `spec.trainer` carries image/command/args/env/numNodes/numProcPerNode; one
`runtimePatches` entry keyed by `MANAGER` carries pod labels/annotations, node selector, tolerations,
image pull secrets and (only when asked) `/dev/shm` of replicated job `node`. Trainer replaces the
container's resources wholesale with `resourcesPerNode` and a patch's tolerations replace the
runtime's (atomic list), so both are the runtime's with this job's additions merged in, and the
runtime object must then be passed in (`needs_runtime`). v2.1 has no `runtimePatches`.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from chunkgrpo.k8s.jobspec import (
    KINDS,
    POD_ANNOTATIONS,
    JobSpec,
    TemplateError,
    merge_resources,
    with_spec_hash,
)

log = logging.getLogger(__name__)

MANAGER = "chunkgrpo.io/train-launcher"       # runtimePatches owner (immutable per entry)


def runtime_container(runtime: dict, job: str = "node", container: str = "node") -> dict:
    """The trainer container of a (Cluster)TrainingRuntime (replicated job `node`, container `node`)."""
    for rj in runtime["spec"]["template"]["spec"]["replicatedJobs"]:
        if rj["name"] == job:
            for c in rj["template"]["spec"]["template"]["spec"]["containers"]:
                if c["name"] == container:
                    return c
    raise TemplateError(f"{runtime.get('kind')} {runtime['metadata']['name']} has no container {container!r} "
                        f"in replicated job {job!r}")


def runtime_pod_spec(runtime: dict, job: str = "node") -> dict:
    """The pod spec of replicated job `job` of a (Cluster)TrainingRuntime."""
    for rj in runtime["spec"]["template"]["spec"]["replicatedJobs"]:
        if rj["name"] == job:
            return rj["template"]["spec"]["template"]["spec"]
    raise TemplateError(f"{runtime.get('kind')} {runtime['metadata']['name']} has no replicated job {job!r}")


def merge_tolerations(base: list[dict] | None, extra: list[dict] | None) -> list[dict]:
    """`base` + the entries of `extra` not already in it (order kept, no duplicates).

    Trainer v2.2/v2.3 apply `runtimePatches` with a strategic merge patch, and `PodSpec.tolerations`
    is an atomic list (no patch strategy): a patch's list REPLACES the runtime's. A patch that
    only named the extra tolerations would drop the runtime's GPU taint toleration.
    """
    out = copy.deepcopy(list(base or []))
    for t in extra or []:
        if t not in out:
            out.append(copy.deepcopy(t))
    return out


def needs_runtime(spec: JobSpec) -> bool:
    """Whether `build_trainjob` needs the runtime object: resource overrides (resourcesPerNode replaces
    the runtime's resources) and extra tolerations (the patch's list replaces the runtime's)."""
    return bool(spec.resources() or spec.tolerations)


def _pod_patch(spec: JobSpec, runtime: dict | None = None) -> dict:
    pod: dict[str, Any] = {}
    if spec.node_selector:  # a map: merged key by key with the runtime's
        pod["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:   # atomic list: the runtime's + ours, or the runtime's would be lost
        if runtime is None:
            raise ValueError("extra tolerations need the runtime object (read_runtime): Trainer replaces the "
                             "runtime's tolerations with the patch's, so they are merged into the runtime's")
        pod["tolerations"] = merge_tolerations(runtime_pod_spec(runtime).get("tolerations"), spec.tolerations)
    if spec.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": n} for n in spec.image_pull_secrets]
    if spec.shm_size:  # replaces the runtime's `dshm` volume by name (list map keyed by name)
        pod["volumes"] = [spec.shm_volume()]
        pod["containers"] = [{"name": "node", "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}]}]
    return pod


def build_trainjob(spec: JobSpec, runtime: dict | None = None) -> dict:
    """A `trainer.kubeflow.org/v1alpha1` TrainJob for Trainer v2.2 / v2.3 (`runtimePatches`).

    `runtime` (the referenced runtime object, `read_runtime`) is needed only when the job overrides
    resources or adds tolerations (`needs_runtime`): Trainer replaces the container's resources
    wholesale with `resourcesPerNode`, which is therefore the runtime's resources with the overrides
    merged in; and a patch's tolerations replace the runtime's (atomic list), so the patch carries
    the runtime's tolerations plus the extra ones (`merge_tolerations`).
    """
    command, args = spec.container_command()
    trainer: dict[str, Any] = {"image": spec.image, "command": command, "args": args,
                               "numNodes": spec.num_nodes, "numProcPerNode": spec.nproc_per_node}
    env = spec.env_list()
    if env:
        trainer["env"] = env
    overrides = spec.resources()
    if overrides:
        if runtime is None:
            raise ValueError(
                "resource overrides need the runtime object (read_runtime): Trainer replaces the "
                "container's resources wholesale, so they are merged into the runtime's"
            )
        trainer["resourcesPerNode"] = merge_resources(runtime_container(runtime).get("resources"), overrides)
    pod_template: dict[str, Any] = {
        "metadata": {"labels": spec.all_labels(), "annotations": dict(POD_ANNOTATIONS)}
    }
    pod = _pod_patch(spec, runtime)
    if pod:
        pod_template["spec"] = pod
    body: dict[str, Any] = {
        "apiVersion": KINDS["TrainJob"].api_version,
        "kind": "TrainJob",
        "metadata": spec.metadata(),
        "spec": {
            "runtimeRef": {
                "apiGroup": "trainer.kubeflow.org",
                "kind": spec.runtime_kind,
                "name": spec.runtime_name,
            },
            "trainer": trainer,
            "runtimePatches": [
                {
                    "manager": MANAGER,
                    "trainingRuntimeSpec": {
                        "template": {
                            "spec": {
                                "replicatedJobs": [
                                    {"name": "node", "template": {"spec": {"template": pod_template}}}
                                ]
                            }
                        }
                    },
                }
            ],
        },
    }
    if spec.queue_name:
        body["spec"]["suspend"] = True  # Kueue admits (unsuspends) it when the quota allows
    if spec.active_deadline_seconds:
        body["spec"]["activeDeadlineSeconds"] = int(spec.active_deadline_seconds)
    return with_spec_hash(body)


def trainjob_log_tail(obj: dict, lines: int = 40, client=None) -> list[str]:
    """The last `lines` log lines of node 0 of a TrainJob, read with the kubeflow SDK
    (`kubeflow.trainer.TrainerClient.get_job_logs`: finds the pod by its JobSet labels, reads the
    `node` container). [] for a PyTorchJob, or when the pod is gone or unreadable: a diagnosis aid
    printed before a failed job is reported, never an error of its own."""
    if obj.get("kind") != "TrainJob":
        return []
    name, ns = obj["metadata"]["name"], obj["metadata"]["namespace"]
    try:
        if client is None:
            from kubeflow.trainer import KubernetesBackendConfig, TrainerClient

            client = TrainerClient(KubernetesBackendConfig(namespace=ns))
        return list(client.get_job_logs(name))[-lines:]
    except Exception as e:
        log.warning("no logs of %s/%s (%s: %s)", ns, name, type(e).__name__, e)
        return []

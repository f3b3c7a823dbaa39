"""Multi-node training jobs: Kubeflow Trainer v2 `TrainJob` (default) or Training Operator v1
`PyTorchJob`, built as plain dicts, submitted idempotently, watched, and deleted on cancellation.

    spec = JobSpec(name=job_name(kfp_run_id, "train"), namespace="kubeflow",
                   image="ghcr.io/chunkgrpo/chunkgrpo-runtime:0.1.0", num_nodes=2, nproc_per_node=8,
                   gpus_per_node=8, train_args=["--config", "chunk_grpo_flux", "max_iterations=151"],
                   upload_final_to="s3://chunkgrpo-checkpoints/pipeline-runs/<run>/final")
    api = load_api()                                   # kubernetes CustomObjectsApi (in-cluster or kubeconfig)
    final = launch(api, build_trainjob(spec), timeout_s=48 * 3600)

Design (ecosystem.md §2.4):
* **Deterministic names.** `job_name(run_id, task)` hashes the KFP run id + task name, so a retried
  launcher step computes the same name; `submit_or_attach` turns the 409 Conflict of the second
  create into "attach to the existing job" (after checking the `chunkgrpo.io/spec-hash` annotation,
  so a different job that happens to share the name is never adopted). A job that already FAILED
  is deleted and recreated on attach (training resumes from the S3 checkpoint mirror), which is
  what a KFP retry of the launcher is for.
* **Trainer v2 (v2.2 and v2.3; v2.1 has no `runtimePatches`).** `spec.runtimeRef` ->
  ClusterTrainingRuntime `chunkgrpo-torch` (manifests/base/training), `spec.trainer`
  (image/command/args/env/numNodes/numProcPerNode) and one manager-keyed `runtimePatches` entry for
  pod labels/annotations, node selector, tolerations (the runtime's + the extra ones: Trainer's
  strategic merge replaces the atomic list, `merge_tolerations`), image pull secrets and (only when
  asked) `/dev/shm` of replicated job `node`. **Resources:** Trainer replaces the container's resources
  wholesale with `trainer.resourcesPerNode`, so it is left out unless a job overrides something,
  and then it is the runtime's resources (GPUs, RDMA devices, CPU, memory, ephemeral storage) with
  the overrides merged in (`merge_resources`); the runtime must then be passed in (`read_runtime`).
* **Training Operator v1.** Master (+ Worker x num_nodes-1), container `pytorch`, derived from the
  suspended template `PyTorchJob/chunkgrpo-torch-template` that manifests/components/training-operator-v1
  installs (its resources are merged, never replaced); a missing or unreadable template is an
  error (`TemplateError`), never a silent fallback to a bare pod.
* **Shared clusters.** Training pods carry `sidecar.istio.io/inject: "false"` (an Istio sidecar
  would hold the pod open after torchrun exits and intercept NCCL traffic); `queue_name` adds the
  Kueue label `kueue.x-k8s.io/queue-name` and creates the job suspended (Kueue admits it).
* **No orphans.** `owner` (the Argo Workflow of the KFP run, `owner_from_pod`) becomes the job's
  ownerReference, so deleting the run deletes the job; `cleanup_run` (the pipeline's exit handler)
  deletes every still-active job labelled with the run id, so an evicted or SIGKILLed launcher
  step cannot leave GPUs busy until `activeDeadlineSeconds`.
* **The final model leaves the pod.** The trainer writes `<output_dir>/final` on node 0; with
  `upload_final_to` the container runs `torchrun ... && python -m chunkgrpo.k8s.trainjob upload-final`
  on node rank 0, which uploads it with `ArtifactStore.put_folder` (manifest last).
* **Fail fast.** `launch(..., probe_factory=diagnose.JobProbe.for_job)` reads the job's pods and
  events on every poll: FailedCreate (PodSecurity, quota), unschedulable past a grace period, image
  pull errors, OOMKilled and evictions end the step in one line with the fix (JobBlockedError) and
  delete the job unless `keep_failed`; `logs=trainjob_log_tail` prints node 0's last log lines
  (Kubeflow SDK `TrainerClient.get_job_logs`) before a failure is raised.
* **Cancellation.** `delete_on_cancel` installs SIGTERM/SIGINT handlers (KFP/Argo stop a cancelled
  step with SIGTERM) that delete the job before exiting.

The API boundary is any object with the `CustomObjectsApi` methods `create_/get_/delete_namespaced_custom_object`
(errors carry an HTTP `.status`), so tests use a fake; nothing here imports kfp.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import logging
import re
import shlex
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from decimal import Decimal
from typing import Any, NamedTuple

log = logging.getLogger(__name__)


class Kind(NamedTuple):
    group: str
    version: str
    plural: str

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"


KINDS: dict[str, Kind] = {
    "TrainJob": Kind("trainer.kubeflow.org", "v1alpha1", "trainjobs"),
    "PyTorchJob": Kind("kubeflow.org", "v1", "pytorchjobs"),
}
MANAGER = "chunkgrpo.io/train-launcher"       # runtimePatches owner (immutable per entry)
LABEL_RUN = "chunkgrpo.io/pipeline-run"
LABEL_QUEUE = "kueue.x-k8s.io/queue-name"
POD_ANNOTATIONS = {"sidecar.istio.io/inject": "false"}
LABEL_PART_OF = "app.kubernetes.io/part-of"
SPEC_HASH = "chunkgrpo.io/spec-hash"
DEFAULT_COMMAND = ("torchrun", "-m", "chunkgrpo.train")
PYTORCHJOB_TEMPLATE = "chunkgrpo-torch-template"
_DNS1123_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_NS_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


class JobFailedError(RuntimeError):
    """The training job reached a terminal failure (message carries the job's reason)."""


class JobBlockedError(JobFailedError):
    """The job cannot make progress (pods not created / unschedulable / image / OOM / evicted):
    one line naming the cause and the fix, from `chunkgrpo.k8s.diagnose`."""


class JobCancelledError(SystemExit):
    """Raised from the SIGTERM handler after the job was deleted (exit status 128 + signal)."""


class TemplateError(RuntimeError):
    """The runtime / PyTorchJob template the job is built from is missing or not readable (one line)."""


# ------------------------------------------------------------------------------------------ names


def job_name(run_id: str, task: str = "train", prefix: str = "cg") -> str:
    """`cg-<10 hex of sha256(run_id/task)>-<task slug>`: DNS-1123, starts with a letter, <= 40 chars.

    Stable for a given (run id, task), so every attempt of a KFP step computes the same name. Kept
    well under 63 characters because Trainer/JobSet derive pod and service names from it.
    """
    if not run_id:
        raise ValueError("job_name needs a non-empty run id (e.g. the KFP pipeline job uuid)")
    if not re.fullmatch(r"[a-z][a-z0-9]{0,7}", prefix):
        raise ValueError(f"prefix {prefix!r} must be 1-8 lowercase letters/digits, starting with a letter")
    digest = hashlib.sha256(f"{run_id}/{task}".encode()).hexdigest()[:10]
    slug = re.sub(r"[^a-z0-9]+", "-", task.lower()).strip("-")[:20].strip("-")
    name = f"{prefix}-{digest}" + (f"-{slug}" if slug else "")
    assert _DNS1123_LABEL.match(name) and len(name) <= 40, name
    return name


def label_value(text: str) -> str:
    """A Kubernetes label value (<= 63 chars of [A-Za-z0-9._-], alnum at both ends) derived from text."""
    v = re.sub(r"[^A-Za-z0-9._-]+", "-", text)[:63].strip("-._")
    return v


def current_namespace(default: str = "default") -> str:
    """The pod's namespace (service-account mount), else `default`."""
    try:
        with open(_NS_FILE) as f:
            return f.read().strip() or default
    except OSError:
        return default


# ------------------------------------------------------------------------------------------- spec


@dataclasses.dataclass
class JobSpec:
    """What to run, where: everything the TrainJob / PyTorchJob builders need."""

    name: str
    image: str
    namespace: str = "kubeflow"
    train_args: list[str] = dataclasses.field(default_factory=list)  # after `-m chunkgrpo.train`
    output_dir: str = "/cache/train"                                # in the pod: the runtime's /cache volume
    command: list[str] = dataclasses.field(default_factory=lambda: list(DEFAULT_COMMAND))
    num_nodes: int = 1
    nproc_per_node: int = 1
    gpus_per_node: int = 0                                          # 0 = the runtime's / template's
    accelerator: str = "nvidia.com/gpu"                             # resource name of the GPU
    cpu: str = ""                                                   # per node (request = limit); '' = runtime's
    memory: str = ""                                                # '' = runtime's
    node_selector: dict[str, str] = dataclasses.field(default_factory=dict)
    tolerations: list[dict] = dataclasses.field(default_factory=list)
    shm_size: str = ""                                              # memory-backed /dev/shm ('' = runtime's)
    image_pull_secrets: list[str] = dataclasses.field(default_factory=list)
    queue_name: str = ""                                            # Kueue LocalQueue ('' = no Kueue)
    owner: dict | None = None                                       # ownerReference (the run's Workflow)
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    secret_env: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)  # ENV -> (secret, key)
    labels: dict[str, str] = dataclasses.field(default_factory=dict)
    run_id: str = ""                                                # KFP run id, as a label
    upload_final_to: str = ""                                       # s3:// URI for <output_dir>/final
    fetch: dict[str, str] = dataclasses.field(default_factory=dict)  # pod path -> s3:// object, before torchrun
    runtime_name: str = "chunkgrpo-torch"
    runtime_kind: str = "ClusterTrainingRuntime"
    active_deadline_seconds: int | None = None

    def __post_init__(self) -> None:
        if not _DNS1123_LABEL.match(self.name) or len(self.name) > 63:
            raise ValueError(f"job name {self.name!r} is not a DNS-1123 label starting with a letter (<= 63)")
        if self.num_nodes < 1 or self.nproc_per_node < 1 or self.gpus_per_node < 0:
            raise ValueError(f"num_nodes={self.num_nodes}, nproc_per_node={self.nproc_per_node} must be >= 1 "
                             f"and gpus_per_node={self.gpus_per_node} >= 0")
        if self.gpus_per_node and self.nproc_per_node > self.gpus_per_node:
            raise ValueError(f"nproc_per_node={self.nproc_per_node} > gpus_per_node={self.gpus_per_node}")
        for uri in [self.upload_final_to, *self.fetch.values()]:
            if uri and not uri.startswith("s3://"):
                raise ValueError(f"{uri!r} must be an s3:// URI")
        if self.runtime_kind not in ("ClusterTrainingRuntime", "TrainingRuntime"):
            raise ValueError(f"runtime_kind={self.runtime_kind!r}")

    # ---- pieces shared by both builders
    def all_labels(self) -> dict[str, str]:
        out = {LABEL_PART_OF: "chunkgrpo", **self.labels}
        if self.run_id:
            out[LABEL_RUN] = label_value(self.run_id)
        return out

    def args(self) -> list[str]:
        """Trainer arguments, with `output_dir` pinned to the pod path (last override wins)."""
        return [*self.train_args, f"output_dir={self.output_dir}"]

    def container_command(self) -> tuple[list[str], list[str]]:
        """(command, args): plain torchrun, or a shell wrapper that first fetches s3:// inputs and
        afterwards uploads final/ from node rank 0."""
        if not self.upload_final_to and not self.fetch:
            return list(self.command), self.args()
        lines = ["set -e"]
        for path, uri in sorted(self.fetch.items()):
            lines.append(f"python -m chunkgrpo.k8s.trainjob fetch {shlex.quote(uri)} {shlex.quote(path)}")
        lines.append(f'{shlex.join(self.command)} "$@"')
        if self.upload_final_to:
            final = f"{self.output_dir.rstrip('/')}/final"
            lines += ['if [ "${PET_NODE_RANK:-0}" = "0" ]; then',
                      f"  python -m chunkgrpo.k8s.trainjob upload-final {shlex.quote(final)} "
                      f"{shlex.quote(self.upload_final_to)}",
                      "fi"]
        return ["/bin/sh", "-c", "\n".join(lines) + "\n", "chunkgrpo-train"], self.args()

    def env_list(self) -> list[dict]:
        out: list[dict] = [{"name": k, "value": str(v)} for k, v in self.env.items()]
        for k, (secret, key) in self.secret_env.items():
            out.append({"name": k, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}})
        return out

    def resources(self) -> dict:
        """The per-node resource OVERRIDES of this job (empty = keep the runtime's / template's)."""
        req: dict[str, Any] = {}
        if self.cpu:
            req["cpu"] = self.cpu
        if self.memory:
            req["memory"] = self.memory
        if self.gpus_per_node:
            req[self.accelerator] = self.gpus_per_node
        return {"requests": dict(req), "limits": dict(req)} if req else {}

    def metadata(self) -> dict:
        labels = self.all_labels()
        if self.queue_name:
            labels[LABEL_QUEUE] = self.queue_name
        meta: dict[str, Any] = {"name": self.name, "namespace": self.namespace, "labels": labels}
        if self.owner:
            meta["ownerReferences"] = [dict(self.owner)]
        return meta

    def shm_volume(self) -> dict:
        return {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": self.shm_size}}


def _spec_hash(obj: dict) -> str:
    return hashlib.sha256(json.dumps(obj.get("spec", {}), sort_keys=True).encode()).hexdigest()[:16]


def _finish(obj: dict) -> dict:
    obj["metadata"].setdefault("annotations", {})[SPEC_HASH] = _spec_hash(obj)
    return obj


# ---------------------------------------------------------------------------------------- builders

def quantity(value) -> Decimal:
    """A Kubernetes quantity ('128Gi', '500m', 8) as an exact number (`kubernetes.utils.parse_quantity`)."""
    from kubernetes.utils import parse_quantity

    try:
        return parse_quantity(value)
    except ValueError:
        raise ValueError(f"{value!r} is not a Kubernetes quantity") from None


def merge_resources(base: dict | None, overrides: dict | None) -> dict:
    """`base` requests/limits with `overrides` merged in key by key (RDMA devices, ephemeral storage
    and everything else the overrides do not name are kept). A request is raised to its limit when
    the override would leave it above the limit."""
    out = {k: dict(v) for k, v in (base or {}).items() if k in ("requests", "limits", "claims")}
    for bound in ("requests", "limits"):
        for key, value in ((overrides or {}).get(bound) or {}).items():
            out.setdefault(bound, {})[key] = value
    req, lim = out.get("requests", {}), out.get("limits", {})
    for key in list(req):
        if key in lim and quantity(req[key]) > quantity(lim[key]):
            lim[key] = req[key]
    return out


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
            raise ValueError("resource overrides need the runtime object (read_runtime): Trainer replaces the "
                             "container's resources wholesale, so they are merged into the runtime's")
        trainer["resourcesPerNode"] = merge_resources(runtime_container(runtime).get("resources"), overrides)
    pod_template: dict[str, Any] = {"metadata": {"labels": spec.all_labels(), "annotations": dict(POD_ANNOTATIONS)}}
    pod = _pod_patch(spec, runtime)
    if pod:
        pod_template["spec"] = pod
    body: dict[str, Any] = {
        "apiVersion": KINDS["TrainJob"].api_version,
        "kind": "TrainJob",
        "metadata": spec.metadata(),
        "spec": {
            "runtimeRef": {"apiGroup": "trainer.kubeflow.org", "kind": spec.runtime_kind, "name": spec.runtime_name},
            "trainer": trainer,
            "runtimePatches": [{
                "manager": MANAGER,
                "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [
                    {"name": "node", "template": {"spec": {"template": pod_template}}}]}}},
            }],
        },
    }
    if spec.queue_name:
        body["spec"]["suspend"] = True  # Kueue admits (unsuspends) it when the quota allows
    if spec.active_deadline_seconds:
        body["spec"]["activeDeadlineSeconds"] = int(spec.active_deadline_seconds)
    return _finish(body)


def _set_pod(spec: JobSpec, pod: dict, command: list[str], args: list[str]) -> None:
    """Apply this job's settings to a PyTorchJob pod template (in place), merging, never replacing."""
    meta = pod.setdefault("metadata", {})
    meta.setdefault("labels", {}).update(spec.all_labels())
    meta.setdefault("annotations", {}).update(POD_ANNOTATIONS)
    ps = pod["spec"]
    c = next((c for c in ps["containers"] if c["name"] == "pytorch"), None)
    if c is None:
        raise TemplateError("the PyTorchJob template has no container named 'pytorch'")
    c.update({"image": spec.image, "command": command, "args": args})
    if spec.env_list():
        names = {e["name"] for e in spec.env_list()}
        c["env"] = [e for e in c.get("env", []) if e["name"] not in names] + spec.env_list()
    if spec.resources():
        c["resources"] = merge_resources(c.get("resources"), spec.resources())
    if spec.node_selector:
        ps["nodeSelector"] = {**ps.get("nodeSelector", {}), **spec.node_selector}
    if spec.tolerations:
        ps["tolerations"] = ps.get("tolerations", []) + [t for t in copy.deepcopy(spec.tolerations)
                                                          if t not in ps.get("tolerations", [])]
    if spec.image_pull_secrets:
        have = ps.setdefault("imagePullSecrets", [])
        have += [{"name": n} for n in spec.image_pull_secrets if {"name": n} not in have]
    if spec.shm_size:
        ps["volumes"] = [v for v in ps.get("volumes", []) if v["name"] != "dshm"] + [spec.shm_volume()]
        mounts = c.setdefault("volumeMounts", [])
        if not any(m["name"] == "dshm" for m in mounts):
            mounts.append({"name": "dshm", "mountPath": "/dev/shm"})


def build_pytorchjob(spec: JobSpec, template: dict) -> dict:
    """A `kubeflow.org/v1` PyTorchJob (Training Operator v1.9): Master + (num_nodes - 1) Workers.

    Built from `template`, the suspended `PyTorchJob/chunkgrpo-torch-template` read from the cluster
    (`read_template`): its pod templates (pool placement, RDMA devices, memory, /dev/shm, security)
    are kept, this job's image/command/args/env are set and its resource overrides MERGED into the
    template's; `runPolicy.suspend` becomes false (true with a Kueue queue, which admits it).
    """
    if not template or "pytorchReplicaSpecs" not in (template.get("spec") or {}):
        raise TemplateError("build_pytorchjob needs the PyTorchJob template (read_template); "
                            "install manifests/components/training-operator-v1")
    command, args = spec.container_command()
    tspec = copy.deepcopy(template["spec"])
    master = tspec["pytorchReplicaSpecs"]["Master"]
    master["replicas"] = 1
    replicas = {"Master": master}
    if spec.num_nodes > 1:
        worker = tspec["pytorchReplicaSpecs"].get("Worker") or copy.deepcopy(master)
        worker["replicas"] = spec.num_nodes - 1
        replicas["Worker"] = worker
    for rs in replicas.values():
        _set_pod(spec, rs["template"], command, args)
    run_policy = {**tspec.get("runPolicy", {}), "suspend": bool(spec.queue_name)}
    if spec.active_deadline_seconds:
        run_policy["activeDeadlineSeconds"] = int(spec.active_deadline_seconds)
    body: dict[str, Any] = {
        "apiVersion": KINDS["PyTorchJob"].api_version,
        "kind": "PyTorchJob",
        "metadata": spec.metadata(),
        "spec": {"nprocPerNode": str(spec.nproc_per_node), "runPolicy": run_policy, "pytorchReplicaSpecs": replicas},
    }
    return _finish(body)


def build_job(kind: str, spec: JobSpec, template: dict | None = None) -> dict:
    """TrainJob (`template` = the runtime, needed only for resource overrides) or PyTorchJob (`template` = its template)."""
    if kind == "TrainJob":
        return build_trainjob(spec, template)
    if kind == "PyTorchJob":
        return build_pytorchjob(spec, template)
    raise ValueError(f"kind={kind!r} must be one of {sorted(KINDS)}")


# ---------------------------------------------------------------------------------------- status


def _status_code(exc: BaseException) -> int | None:
    code = getattr(exc, "status", None)
    return int(code) if isinstance(code, int) or (isinstance(code, str) and code.isdigit()) else None


def _kind_of(obj: dict) -> tuple[str, Kind]:
    kind = obj.get("kind", "")
    if kind not in KINDS:
        raise ValueError(f"unsupported kind {kind!r}")
    return kind, KINDS[kind]


def job_state(obj: dict) -> tuple[str, str, str]:
    """(state, reason, message); state is Pending | Running | Suspended | Succeeded | Failed."""
    kind = obj.get("kind")
    conds = [c for c in (obj.get("status") or {}).get("conditions") or [] if str(c.get("status")) == "True"]
    by_type = {c.get("type"): c for c in conds}

    def out(state: str, c: dict | None) -> tuple[str, str, str]:
        return state, (c or {}).get("reason", ""), (c or {}).get("message", "")

    if kind == "TrainJob":
        if "Failed" in by_type:
            return out("Failed", by_type["Failed"])
        if "Complete" in by_type:
            return out("Succeeded", by_type["Complete"])
        if "Suspended" in by_type:
            return out("Suspended", by_type["Suspended"])
        jobs = (obj.get("status") or {}).get("jobsStatus") or []
        if any((j.get("active") or 0) > 0 or (j.get("ready") or 0) > 0 for j in jobs):
            return "Running", "", ""
        return "Pending", "", ""
    # PyTorchJob (Training Operator v1): Created / Running / Restarting / Succeeded / Failed
    for t, state in (("Failed", "Failed"), ("Succeeded", "Succeeded"), ("Restarting", "Running"),
                     ("Running", "Running")):
        if t in by_type:
            return out(state, by_type[t])
    if (obj.get("spec") or {}).get("runPolicy", {}).get("suspend"):
        return "Suspended", "", ""
    return out("Pending", by_type.get("Created"))


# ------------------------------------------------------------------------------------- API calls


def _get(api, kind: Kind, name: str, namespace: str) -> dict:
    return api.get_namespaced_custom_object(kind.group, kind.version, namespace, kind.plural, name)


def _wait_gone(api, kind: Kind, name: str, namespace: str, timeout_s: float, poll_s: float,
               sleep: Callable[[float], None], clock: Callable[[], float]) -> None:
    deadline = clock() + timeout_s
    while True:
        try:
            _get(api, kind, name, namespace)
        except Exception as e:  # noqa: BLE001 - only a 404 ends the wait
            if _status_code(e) == 404:
                return
            raise
        if clock() > deadline:
            raise TimeoutError(f"{name} still exists {timeout_s:.0f}s after deletion")
        sleep(poll_s)


def submit_or_attach(api, obj: dict, *, recreate_failed: bool = True, poll_s: float = 5.0,
                     sleep: Callable[[float], None] = time.sleep,
                     clock: Callable[[], float] = time.monotonic) -> tuple[dict, bool]:
    """Create the job; on 409 Conflict attach to the existing one. Returns (object, attached).

    Attaching checks the spec-hash annotation (a job with the same name but another spec is an
    error, never silently adopted). An attached job that already failed is deleted and created
    again when `recreate_failed` (a KFP retry of the launcher means "try again").
    """
    kind_name, kind = _kind_of(obj)
    name, ns = obj["metadata"]["name"], obj["metadata"]["namespace"]
    try:
        created = api.create_namespaced_custom_object(kind.group, kind.version, ns, kind.plural, obj)
        log.info("created %s %s/%s", kind_name, ns, name)
        return created or obj, False
    except Exception as e:  # noqa: BLE001 - classified by HTTP status
        if _status_code(e) != 409:
            raise
    existing = _get(api, kind, name, ns)
    want = obj["metadata"].get("annotations", {}).get(SPEC_HASH)
    have = (existing.get("metadata") or {}).get("annotations", {}).get(SPEC_HASH)
    if want and have != want:
        raise JobFailedError(f"{kind_name} {ns}/{name} already exists with a different spec (spec-hash {have} != "
                             f"{want}); refusing to attach. Delete it or use another run id.")
    state, reason, _ = job_state(existing)
    if state == "Failed" and recreate_failed:
        log.warning("%s %s/%s exists but failed (%s); deleting and creating it again", kind_name, ns, name, reason)
        delete(api, existing)
        _wait_gone(api, kind, name, ns, timeout_s=600, poll_s=poll_s, sleep=sleep, clock=clock)
        return api.create_namespaced_custom_object(kind.group, kind.version, ns, kind.plural, obj) or obj, False
    log.info("attached to existing %s %s/%s (state %s)", kind_name, ns, name, state)
    return existing, True


def wait(api, obj: dict, *, timeout_s: float, poll_s: float = 15.0,
         on_status: Callable[[str], None] | None = None, max_api_errors: int = 20,
         probe=None, sleep: Callable[[float], None] = time.sleep,
         clock: Callable[[], float] = time.monotonic) -> dict:
    """Poll until the job succeeds (returns its object) or fails (raises JobFailedError with the
    job's reason and message). Every change of state/reason is passed to `on_status`. Transient API
    errors (5xx, connection) are retried up to `max_api_errors` times in a row.

    `probe` (a `diagnose.JobProbe`, anything with `check(now) -> Finding | None`) reads the job's
    pods and events on every poll while it is not finished; a finding raises JobBlockedError with
    its one line (PodSecurity/quota FailedCreate, unschedulable past the grace period, image pull,
    OOMKilled, evicted), minutes instead of the job's 48 h deadline."""
    kind_name, kind = _kind_of(obj)
    name, ns = obj["metadata"]["name"], obj["metadata"]["namespace"]
    emit = on_status or (lambda line: log.info("%s", line))
    deadline = clock() + timeout_s
    last, errors = None, 0
    while True:
        try:
            cur = _get(api, kind, name, ns)
            errors = 0
        except Exception as e:  # noqa: BLE001
            code = _status_code(e)
            if code == 404:
                raise JobFailedError(f"{kind_name} {ns}/{name} disappeared (deleted outside this step?)") from None
            if code is not None and code < 500 and code != 429:
                raise
            errors += 1
            if errors > max_api_errors:
                raise
            log.warning("API error watching %s (%d/%d): %s", name, errors, max_api_errors, e)
            sleep(poll_s)
            continue
        state, reason, message = job_state(cur)
        if (state, reason, message) != last:
            emit(f"{kind_name} {name}: {state}" + (f" ({reason})" if reason else "") + (f": {message}" if message else ""))
            last = (state, reason, message)
        if state == "Succeeded":
            return cur
        if state == "Failed":
            raise JobFailedError(f"{kind_name} {ns}/{name} failed: {reason or 'unknown reason'}"
                                 + (f": {message}" if message else ""))
        if probe is not None and state != "Suspended":  # suspended (Kueue): no pods yet, nothing to read
            try:
                finding = probe.check(clock())
            except Exception as e:  # noqa: BLE001 - a diagnosis aid: unreadable pods never fail the job
                if _status_code(e) == 403:
                    log.warning("cannot read the pods of %s (HTTP 403): grant get/list on pods, events", name)
                    probe = None
                    finding = None
                else:
                    log.warning("reading the pods of %s: %s", name, e)
                    finding = None
            if finding is not None:
                raise JobBlockedError(f"{kind_name} {ns}/{name}: {finding.line()}")
        if clock() > deadline:
            raise TimeoutError(f"{kind_name} {ns}/{name} did not finish within {timeout_s:.0f}s (last state {state})")
        sleep(poll_s)


def delete(api, obj: dict) -> bool:
    """Delete the job (background propagation: its pods go too). False if it was already gone."""
    kind_name, kind = _kind_of(obj)
    name, ns = obj["metadata"]["name"], obj["metadata"]["namespace"]
    try:
        api.delete_namespaced_custom_object(kind.group, kind.version, ns, kind.plural, name,
                                            propagation_policy="Background")
    except Exception as e:  # noqa: BLE001
        if _status_code(e) == 404:
            return False
        raise
    log.warning("deleted %s %s/%s", kind_name, ns, name)
    return True


@contextlib.contextmanager
def delete_on_cancel(api, obj: dict, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> Iterator[None]:
    """While active, SIGTERM/SIGINT delete the job, then exit with 128 + signal (JobCancelledError).

    KFP cancels a run by stopping its pods with SIGTERM; without this the TrainJob would keep
    its GPUs. Handlers can only be installed from the main thread; elsewhere this is a no-op.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}

    def handler(signum, frame):  # noqa: ARG001
        log.warning("received signal %d: deleting %s %s", signum, obj["kind"], obj["metadata"]["name"])
        try:
            delete(api, obj)
        finally:
            raise JobCancelledError(128 + signum)

    for s in signals:
        previous[s] = signal.signal(s, handler)
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


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
    except Exception as e:  # noqa: BLE001
        log.warning("no logs of %s/%s (%s: %s)", ns, name, type(e).__name__, e)
        return []


def launch(api, obj: dict, *, timeout_s: float, poll_s: float = 15.0, recreate_failed: bool = True,
           on_status: Callable[[str], None] | None = None, probe_factory: Callable[[dict], Any] | None = None,
           keep_failed: bool = False, logs: Callable[[dict], list[str]] | None = None,
           sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic) -> dict:
    """submit_or_attach + wait, with the job deleted if this process is cancelled. Returns the final object.

    `probe_factory(created_object)` builds the pod/event probe (`diagnose.JobProbe.for_job`); when it
    finds a blocker the job is deleted (its pods would otherwise hold or wait for GPUs until the
    deadline) unless `keep_failed`, and JobBlockedError carries the one line. `logs(obj)` (e.g.
    `trainjob_log_tail`) is printed through `on_status` when the job fails or is blocked, before
    anything is deleted; the error itself stays one line.
    """
    cur, attached = submit_or_attach(api, obj, recreate_failed=recreate_failed, poll_s=poll_s, sleep=sleep, clock=clock)
    emit = on_status or (lambda line: log.info("%s", line))
    emit(f"{'attached to' if attached else 'submitted'} {obj['kind']} {obj['metadata']['namespace']}/"
         f"{obj['metadata']['name']}")
    probe = None
    if probe_factory is not None:
        try:
            probe = probe_factory({**obj, **(cur or {}), "kind": obj["kind"]})
        except Exception as e:  # noqa: BLE001 - without pods/events the job is still watched (conditions)
            log.warning("cannot read the pods/events of %s (%s): blocked pods will not be detected early",
                        obj["metadata"]["name"], e)
    try:
        with delete_on_cancel(api, obj):
            try:
                return wait(api, obj, timeout_s=timeout_s, poll_s=poll_s, on_status=on_status, probe=probe,
                            sleep=sleep, clock=clock)
            except JobFailedError:
                tail = logs(obj) if logs is not None else []
                if tail:
                    emit(f"last {len(tail)} log lines of {obj['metadata']['name']} node 0:")
                    for line in tail:
                        emit(f"  | {line}")
                raise
    except JobBlockedError as e:
        if keep_failed:
            raise JobBlockedError(f"{e} (job kept: keep_failed; delete it with `kubectl -n "
                                  f"{obj['metadata']['namespace']} delete {obj['kind'].lower()} "
                                  f"{obj['metadata']['name']}`)") from None
        delete(api, obj)
        raise JobBlockedError(f"{e} (job deleted)") from None
    finally:
        if probe is not None and hasattr(probe, "close"):
            probe.close()


def _read(api, kind: Kind, name: str, namespace: str | None, what: str, install_hint: str) -> dict:
    try:
        if namespace is None:  # cluster-scoped
            return api.get_cluster_custom_object(kind.group, kind.version, kind.plural, name)
        return _get(api, kind, name, namespace)
    except Exception as e:  # noqa: BLE001 - classified by HTTP status
        code = _status_code(e)
        where = f" in namespace {namespace}" if namespace else ""
        if code == 404:
            raise TemplateError(f"{what} {name!r} not found{where}: {install_hint}") from None
        if code == 403:
            raise TemplateError(f"not allowed to read {what} {name!r}{where} (HTTP 403): bind the run's service "
                                "account to the chunkgrpo-training Role / chunkgrpo-runtime-reader ClusterRole "
                                "(manifests/base/pipeline/rbac.yaml)") from None
        raise


def read_template(api, namespace: str, name: str = PYTORCHJOB_TEMPLATE) -> dict:
    """The suspended PyTorchJob template installed by manifests/components/training-operator-v1.

    Missing (404) or forbidden (403) is a TemplateError naming the fix: a job built without the
    template would silently lose the pool's RDMA devices, memory and /dev/shm settings.
    """
    return _read(api, KINDS["PyTorchJob"], name, namespace, "PyTorchJob template",
                 "add manifests/components/training-operator-v1 to the overlay")


def read_runtime(api, name: str = "chunkgrpo-torch", kind: str = "ClusterTrainingRuntime",
                 namespace: str = "") -> dict:
    """The (Cluster)TrainingRuntime a TrainJob references (for merging resource overrides)."""
    plural = "clustertrainingruntimes" if kind == "ClusterTrainingRuntime" else "trainingruntimes"
    k = Kind("trainer.kubeflow.org", "v1alpha1", plural)
    return _read(api, k, name, None if kind == "ClusterTrainingRuntime" else namespace, kind,
                 "apply the overlay (manifests/base/training) first")


def owner_from_pod(get_pod: Callable[[], dict]) -> dict | None:
    """The ownerReference for a training job: the Argo Workflow that owns this (launcher) pod.

    `get_pod()` returns the pod as a dict (`CoreV1Api.read_namespaced_pod(...).to_dict()` or raw
    JSON). The reference is neither `controller` nor `blockOwnerDeletion` (setting the latter would
    need update rights on workflows/finalizers): garbage collection deletes the job when the KFP
    run's Workflow is deleted. None when the pod has no Workflow owner (e.g. run outside Argo).
    """
    pod = get_pod()
    refs = (pod.get("metadata") or {}).get("ownerReferences") or (pod.get("metadata") or {}).get("owner_references") or []
    for ref in refs:
        if ref.get("kind") == "Workflow":
            return {"apiVersion": ref.get("apiVersion") or ref.get("api_version"), "kind": "Workflow",
                    "name": ref["name"], "uid": ref["uid"], "controller": False, "blockOwnerDeletion": False}
    return None


def cleanup_run(api, namespace: str, run_id: str, *, kinds: tuple[str, ...] = ("TrainJob", "PyTorchJob"),
                only_active: bool = True) -> list[str]:
    """Delete the training jobs labelled with this KFP run id (the pipeline's exit handler).

    Jobs that already succeeded or failed are kept (their status and logs stay inspectable) unless
    `only_active=False`. A kind whose CRD is not installed (404 on list) is skipped. Returns
    `Kind/name` of every deleted job.
    """
    selector = f"{LABEL_RUN}={label_value(run_id)}"
    deleted = []
    for kind_name in kinds:
        kind = KINDS[kind_name]
        try:
            listing = api.list_namespaced_custom_object(kind.group, kind.version, namespace, kind.plural,
                                                        label_selector=selector)
        except Exception as e:  # noqa: BLE001
            if _status_code(e) == 404:
                continue
            raise
        for obj in listing.get("items") or []:
            obj.setdefault("kind", kind_name)
            obj.setdefault("metadata", {}).setdefault("namespace", namespace)
            state = job_state(obj)[0]
            if only_active and state in ("Succeeded", "Failed"):
                continue
            if delete(api, obj):
                deleted.append(f"{kind_name}/{obj['metadata']['name']}")
    return deleted


def _load_config() -> None:
    from kubernetes import config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()


def load_api():
    """A `kubernetes.client.CustomObjectsApi` (in-cluster config, else ~/.kube/config / $KUBECONFIG)."""
    from kubernetes import client

    _load_config()
    return client.CustomObjectsApi()


def load_core_api():
    """A `kubernetes.client.CoreV1Api` (pods and events of the job, for `diagnose.JobProbe`)."""
    from kubernetes import client

    _load_config()
    return client.CoreV1Api()


def this_pod_getter(namespace: str) -> Callable[[], dict]:
    """`get_pod()` for `owner_from_pod`: reads this pod ($HOSTNAME) through the CoreV1 API."""
    import os

    from kubernetes import client

    _load_config()
    core = client.CoreV1Api()
    name = os.environ.get("HOSTNAME", "")
    return lambda: core.api_client.sanitize_for_serialization(core.read_namespaced_pod(name, namespace))


# -------------------------------------------------------------------------------------- entrypoint


def _upload_final(local_dir: str, uri: str) -> None:
    """Node-rank-0 step of the training container: upload `<output_dir>/final` (manifest last)."""
    from pathlib import Path

    from chunkgrpo.store.client import ArtifactStore

    final = Path(local_dir)
    if not (final / "chunkgrpo_model.json").exists():
        raise SystemExit(f"upload-final: {final} holds no exported model (chunkgrpo_model.json missing)")
    summary = final.parent / "train_summary.json"
    m = ArtifactStore().put_folder(final, uri, meta={"kind": "model"})
    if summary.exists():
        ArtifactStore().put_file(summary, uri.rstrip("/") + ".train_summary.json")
    print(f"uploaded {final} -> {uri} (manifest sha256 {m.sha256})", flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) == 3 and argv[0] in ("upload-final", "fetch"):
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        if argv[0] == "upload-final":
            _upload_final(argv[1], argv[2])
        else:
            from pathlib import Path

            from chunkgrpo.store.client import ArtifactStore

            Path(argv[2]).parent.mkdir(parents=True, exist_ok=True)
            ArtifactStore().get_file(argv[1], argv[2])
        return 0
    print("usage: python -m chunkgrpo.k8s.trainjob upload-final LOCAL_DIR s3://bucket/prefix\n"
          "       python -m chunkgrpo.k8s.trainjob fetch s3://bucket/key LOCAL_PATH", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

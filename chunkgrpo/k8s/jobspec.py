"""What a training job runs, where: `JobSpec` and the pieces both job kinds share.

    spec = JobSpec(name=job_name(kfp_run_id, "train"), namespace="kubeflow",
                   image="ghcr.io/chunkgrpo/chunkgrpo-runtime:0.1.0", num_nodes=2, nproc_per_node=8,
                   gpus_per_node=8, train_args=["--config", "chunk_grpo_flux", "max_iterations=151"],
                   upload_final_to="s3://chunkgrpo-checkpoints/pipeline-runs/<run>/final")

Contracts: `job_name(run_id, task)` is deterministic (a retried launcher step computes the same name);
every built object carries the `chunkgrpo.io/spec-hash` annotation (`with_spec_hash`), which
`launcher.submit_or_attach` compares before adopting an existing job; resource overrides are merged
into the runtime's / template's key by key (`merge_resources`), never replace them. Training pods
carry `sidecar.istio.io/inject: "false"`; `queue_name` adds the Kueue queue label. Pure: no
Kubernetes API calls (`quantity` imports the `kubernetes` client lazily). Design:
docs/training-jobs.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import shlex
from decimal import Decimal
from typing import Any, NamedTuple


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
LABEL_RUN = "chunkgrpo.io/pipeline-run"
LABEL_QUEUE = "kueue.x-k8s.io/queue-name"
POD_ANNOTATIONS = {"sidecar.istio.io/inject": "false"}
LABEL_PART_OF = "app.kubernetes.io/part-of"
SPEC_HASH = "chunkgrpo.io/spec-hash"
DEFAULT_COMMAND = ("torchrun", "-m", "chunkgrpo.train")
_DNS1123_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


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
    accelerator: str = "nvidia.com/gpu"  # resource name of the GPU
    cpu: str = ""  # per node (request = limit); '' = runtime's
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
    upload_final_to: str = ""  # s3:// URI for <output_dir>/final
    fetch: dict[str, str] = dataclasses.field(
        default_factory=dict
    )  # pod path -> s3:// object, before torchrun
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
            lines.append(f"python -m chunkgrpo.k8s.pod fetch {shlex.quote(uri)} {shlex.quote(path)}")
        lines.append(f'{shlex.join(self.command)} "$@"')
        if self.upload_final_to:
            final = f"{self.output_dir.rstrip('/')}/final"
            lines += ['if [ "${PET_NODE_RANK:-0}" = "0" ]; then',
                      f"  python -m chunkgrpo.k8s.pod upload-final {shlex.quote(final)} "
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


def with_spec_hash(obj: dict) -> dict:
    """`obj` with the `chunkgrpo.io/spec-hash` annotation: 16 hex of sha256 over its sorted-JSON `spec`."""
    digest = hashlib.sha256(json.dumps(obj.get("spec", {}), sort_keys=True).encode()).hexdigest()[:16]
    obj["metadata"].setdefault("annotations", {})[SPEC_HASH] = digest
    return obj


# -------------------------------------------------------------------------------------- resources

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

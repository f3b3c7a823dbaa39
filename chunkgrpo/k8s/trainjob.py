"""Multi-node training jobs: Kubeflow Trainer v2 `TrainJob` (default) or Training Operator v1
`PyTorchJob`, built as plain dicts, submitted idempotently, watched, and deleted on cancellation.

    spec = JobSpec(name=job_name(kfp_run_id, "train"), namespace="kubeflow",
                   image="ghcr.io/chunkgrpo/chunkgrpo-runtime:0.1.0", num_nodes=2, nproc_per_node=8,
                   gpus_per_node=8, train_args=["--config", "chunk_grpo_flux", "max_steps=151"],
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
* **Trainer v2.** `spec.runtimeRef` -> ClusterTrainingRuntime `chunkgrpo-torch` (manifests/base/training),
  `spec.trainer` (image/command/args/env/numNodes/numProcPerNode/resourcesPerNode) and one
  manager-keyed `runtimePatches` entry (Trainer >= 2.2) for pod labels, node selector, tolerations
  and the memory-backed `/dev/shm` of replicated job `node`, container `node`.
* **Training Operator v1.** Master (+ Worker x num_nodes-1), container `pytorch`; optionally
  derived from the suspended template `PyTorchJob/chunkgrpo-torch-template` that
  manifests/components/training-operator-v1 installs.
* **The final model leaves the pod.** The trainer writes `<output_dir>/final` on node 0; with
  `upload_final_to` the container runs `torchrun ... && python -m chunkgrpo.k8s.trainjob upload-final`
  on node rank 0, which uploads it with `ArtifactStore.put_folder` (manifest last).
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
LABEL_PART_OF = "app.kubernetes.io/part-of"
SPEC_HASH = "chunkgrpo.io/spec-hash"
DEFAULT_COMMAND = ("torchrun", "-m", "chunkgrpo.train")
PYTORCHJOB_TEMPLATE = "chunkgrpo-torch-template"
_DNS1123_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_NS_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


class JobFailedError(RuntimeError):
    """The training job reached a terminal failure (message carries the job's reason)."""


class JobCancelledError(SystemExit):
    """Raised from the SIGTERM handler after the job was deleted (exit status 128 + signal)."""


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
    output_dir: str = "/tmp/train"                                  # in the pod (emptyDir /tmp)
    command: list[str] = dataclasses.field(default_factory=lambda: list(DEFAULT_COMMAND))
    num_nodes: int = 1
    nproc_per_node: int = 1
    gpus_per_node: int = 0
    accelerator: str = "nvidia.com/gpu"                             # resource name of the GPU
    cpu: str = ""                                                   # per node (request = limit)
    memory: str = ""
    node_selector: dict[str, str] = dataclasses.field(default_factory=dict)
    tolerations: list[dict] = dataclasses.field(default_factory=list)
    shm_size: str = "64Gi"                                          # memory-backed /dev/shm ('' = runtime's)
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    secret_env: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)  # ENV -> (secret, key)
    config_map_env: str = "chunkgrpo-env"                           # envFrom (PyTorchJob; the v2 runtime has it)
    labels: dict[str, str] = dataclasses.field(default_factory=dict)
    run_id: str = ""                                                # KFP run id, as a label
    upload_final_to: str = ""                                       # s3:// URI for <output_dir>/final
    fetch: dict[str, str] = dataclasses.field(default_factory=dict)  # pod path -> s3:// object, before torchrun
    runtime_name: str = "chunkgrpo-torch"
    runtime_kind: str = "ClusterTrainingRuntime"
    service_account: str = "chunkgrpo-trainer"                      # PyTorchJob pods (v2: the runtime's)
    active_deadline_seconds: int | None = None
    ttl_seconds_after_finished: int = 7 * 24 * 3600                  # PyTorchJob cleanup

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
        req: dict[str, Any] = {}
        if self.cpu:
            req["cpu"] = self.cpu
        if self.memory:
            req["memory"] = self.memory
        if self.gpus_per_node:
            req[self.accelerator] = self.gpus_per_node
        return {"requests": dict(req), "limits": dict(req)} if req else {}

    def shm_volume(self) -> dict:
        return {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": self.shm_size}}


def _spec_hash(obj: dict) -> str:
    return hashlib.sha256(json.dumps(obj.get("spec", {}), sort_keys=True).encode()).hexdigest()[:16]


def _finish(obj: dict) -> dict:
    obj["metadata"].setdefault("annotations", {})[SPEC_HASH] = _spec_hash(obj)
    return obj


# ---------------------------------------------------------------------------------------- builders


def build_trainjob(spec: JobSpec) -> dict:
    """A `trainer.kubeflow.org/v1alpha1` TrainJob (Trainer >= 2.2, `runtimePatches`)."""
    command, args = spec.container_command()
    trainer: dict[str, Any] = {"image": spec.image, "command": command, "args": args,
                               "numNodes": spec.num_nodes, "numProcPerNode": spec.nproc_per_node}
    env = spec.env_list()
    if env:
        trainer["env"] = env
    res = spec.resources()
    if res:
        trainer["resourcesPerNode"] = res
    pod: dict[str, Any] = {}
    if spec.node_selector:
        pod["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod["tolerations"] = copy.deepcopy(spec.tolerations)
    if spec.shm_size:  # merges with the runtime's `dshm` volume by name (server-side apply)
        pod["volumes"] = [spec.shm_volume()]
        pod["containers"] = [{"name": "node", "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}]}]
    pod_template: dict[str, Any] = {"metadata": {"labels": spec.all_labels()}}
    if pod:
        pod_template["spec"] = pod
    body: dict[str, Any] = {
        "apiVersion": KINDS["TrainJob"].api_version,
        "kind": "TrainJob",
        "metadata": {"name": spec.name, "namespace": spec.namespace, "labels": spec.all_labels()},
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
    if spec.active_deadline_seconds:
        body["spec"]["activeDeadlineSeconds"] = int(spec.active_deadline_seconds)
    return _finish(body)


def _pytorch_pod(spec: JobSpec, command: list[str], args: list[str]) -> dict:
    container: dict[str, Any] = {
        "name": "pytorch", "image": spec.image, "imagePullPolicy": "IfNotPresent", "command": command, "args": args,
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}, {"name": "tmp", "mountPath": "/tmp"}],
        "securityContext": {"allowPrivilegeEscalation": False, "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}},
    }
    env = spec.env_list()
    if env:
        container["env"] = env
    if spec.config_map_env:
        container["envFrom"] = [{"configMapRef": {"name": spec.config_map_env}}]
    res = spec.resources()
    if res:
        container["resources"] = res
    pod: dict[str, Any] = {
        "serviceAccountName": spec.service_account, "automountServiceAccountToken": False,
        "enableServiceLinks": False, "restartPolicy": "Never",
        "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
        "volumes": [spec.shm_volume() if spec.shm_size else {"name": "dshm", "emptyDir": {"medium": "Memory"}},
                    {"name": "tmp", "emptyDir": {}}],
    }
    if spec.node_selector:
        pod["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod["tolerations"] = copy.deepcopy(spec.tolerations)
    return {"metadata": {"labels": spec.all_labels()}, "spec": pod}


def build_pytorchjob(spec: JobSpec, template: dict | None = None) -> dict:
    """A `kubeflow.org/v1` PyTorchJob: Master + (num_nodes - 1) Workers, `nprocPerNode` processes each.

    With `template` (the suspended `PyTorchJob/chunkgrpo-torch-template` read from the cluster),
    its pod templates (pool placement, RDMA, security) are kept and only image, command/args, env,
    replicas and placement overrides are set; `runPolicy.suspend` becomes false.
    """
    command, args = spec.container_command()
    if template is None:
        pod = _pytorch_pod(spec, command, args)
        replicas = {"Master": {"replicas": 1, "restartPolicy": "Never", "template": pod}}
        if spec.num_nodes > 1:
            replicas["Worker"] = {"replicas": spec.num_nodes - 1, "restartPolicy": "Never",
                                  "template": copy.deepcopy(pod)}
        run_policy = {"cleanPodPolicy": "Running", "backoffLimit": 0, "suspend": False,
                      "ttlSecondsAfterFinished": spec.ttl_seconds_after_finished}
    else:
        tspec = copy.deepcopy(template["spec"])
        master = tspec["pytorchReplicaSpecs"]["Master"]
        replicas = {"Master": master}
        if spec.num_nodes > 1:
            worker = tspec["pytorchReplicaSpecs"].get("Worker") or copy.deepcopy(master)
            worker["replicas"] = spec.num_nodes - 1
            replicas["Worker"] = worker
        for rs in replicas.values():
            pod = rs["template"]
            pod.setdefault("metadata", {}).setdefault("labels", {}).update(spec.all_labels())
            ps = pod["spec"]
            c = next(c for c in ps["containers"] if c["name"] == "pytorch")
            c.update({"image": spec.image, "command": command, "args": args})
            if spec.env_list():
                names = {e["name"] for e in spec.env_list()}
                c["env"] = [e for e in c.get("env", []) if e["name"] not in names] + spec.env_list()
            if spec.resources():
                c["resources"] = spec.resources()
            if spec.node_selector:
                ps["nodeSelector"] = dict(spec.node_selector)
            if spec.tolerations:
                ps["tolerations"] = copy.deepcopy(spec.tolerations)
        run_policy = {**tspec.get("runPolicy", {}), "suspend": False}
    body: dict[str, Any] = {
        "apiVersion": KINDS["PyTorchJob"].api_version,
        "kind": "PyTorchJob",
        "metadata": {"name": spec.name, "namespace": spec.namespace, "labels": spec.all_labels()},
        "spec": {"nprocPerNode": str(spec.nproc_per_node), "runPolicy": run_policy, "pytorchReplicaSpecs": replicas},
    }
    if spec.active_deadline_seconds:
        body["spec"]["runPolicy"]["activeDeadlineSeconds"] = int(spec.active_deadline_seconds)
    return _finish(body)


def build_job(kind: str, spec: JobSpec, template: dict | None = None) -> dict:
    if kind == "TrainJob":
        return build_trainjob(spec)
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
         sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic) -> dict:
    """Poll until the job succeeds (returns its object) or fails (raises JobFailedError with the
    job's reason and message). Every change of state/reason is passed to `on_status`. Transient API
    errors (5xx, connection) are retried up to `max_api_errors` times in a row."""
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


def launch(api, obj: dict, *, timeout_s: float, poll_s: float = 15.0, recreate_failed: bool = True,
           on_status: Callable[[str], None] | None = None, sleep: Callable[[float], None] = time.sleep,
           clock: Callable[[], float] = time.monotonic) -> dict:
    """submit_or_attach + wait, with the job deleted if this process is cancelled. Returns the final object."""
    cur, attached = submit_or_attach(api, obj, recreate_failed=recreate_failed, poll_s=poll_s, sleep=sleep, clock=clock)
    emit = on_status or (lambda line: log.info("%s", line))
    emit(f"{'attached to' if attached else 'submitted'} {obj['kind']} {obj['metadata']['namespace']}/"
         f"{obj['metadata']['name']}")
    with delete_on_cancel(api, obj):
        return wait(api, obj, timeout_s=timeout_s, poll_s=poll_s, on_status=on_status, sleep=sleep, clock=clock)


def read_template(api, namespace: str, name: str = PYTORCHJOB_TEMPLATE) -> dict | None:
    """The suspended PyTorchJob template installed by manifests/components/training-operator-v1, if any."""
    kind = KINDS["PyTorchJob"]
    try:
        return _get(api, kind, name, namespace)
    except Exception as e:  # noqa: BLE001
        if _status_code(e) in (404, 403):
            return None
        raise


def load_api():
    """A `kubernetes.client.CustomObjectsApi` (in-cluster config, else ~/.kube/config)."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.CustomObjectsApi()


# -------------------------------------------------------------------------------------- entrypoint


def _upload_final(local_dir: str, uri: str) -> None:
    """Node-rank-0 step of the training container: upload `<output_dir>/final` (manifest last)."""
    from pathlib import Path

    from chunkgrpo.store import ArtifactStore

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

            from chunkgrpo.store import ArtifactStore

            Path(argv[2]).parent.mkdir(parents=True, exist_ok=True)
            ArtifactStore().get_file(argv[1], argv[2])
        return 0
    print("usage: python -m chunkgrpo.k8s.trainjob upload-final LOCAL_DIR s3://bucket/prefix\n"
          "       python -m chunkgrpo.k8s.trainjob fetch s3://bucket/key LOCAL_PATH", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

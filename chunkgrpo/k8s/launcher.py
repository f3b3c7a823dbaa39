"""The launcher's side of a training job: read the runtime / template, submit idempotently, watch,
fail fast, delete on cancellation, clean up a run's jobs.

    api = load_api()                     # kubernetes CustomObjectsApi (in-cluster or kubeconfig)
    final = launch(api, build_job("TrainJob", spec, runtime), timeout_s=48 * 3600)

Contracts: the API boundary is any object with the `CustomObjectsApi` methods
`create_/get_/delete_/list_namespaced_custom_object` (errors carry an HTTP `.status`), so tests use a
fake. Objects are created with `fieldValidation=Strict` (`create_strict`): a field the cluster's CRD
lacks is refused in one line instead of being pruned. `submit_or_attach` turns a 409 into attaching
(only to a job with the same spec hash) and
recreates an attached job that already FAILED; `wait` raises `JobFailedError` with the job's reason,
or `JobBlockedError` with the one line of a `diagnose.JobProbe` finding; `launch` deletes a blocked
job unless `keep_failed`; `delete_on_cancel` deletes the job on SIGTERM/SIGINT; `owner` (the run's
Argo Workflow, `owner_from_pod`) and `cleanup_run` (the exit handler) leave no orphaned GPU jobs.
No kfp import; the `kubernetes` client and the kubeflow SDK are imported lazily. Design:
docs/training-jobs.md.
"""

from __future__ import annotations

import contextlib
import logging
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from chunkgrpo.k8s.jobspec import (
    KINDS,
    LABEL_RUN,
    SPEC_HASH,
    JobBlockedError,
    JobCancelledError,
    JobFailedError,
    JobSpec,
    Kind,
    TemplateError,
    label_value,
)
from chunkgrpo.k8s.pytorchjob import PYTORCHJOB_TEMPLATE, build_pytorchjob
from chunkgrpo.k8s.trainjob import build_trainjob

log = logging.getLogger(__name__)

_NS_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


# ---------------------------------------------------------------------------------------- build


def build_job(kind: str, spec: JobSpec, template: dict | None = None) -> dict:
    """TrainJob (`template` = the runtime, needed only for resource overrides) or PyTorchJob (`template` = its
    template)."""
    if kind == "TrainJob":
        return build_trainjob(spec, template)
    if kind == "PyTorchJob":
        return build_pytorchjob(spec, template)
    raise ValueError(f"kind={kind!r} must be one of {sorted(KINDS)}")


# ---------------------------------------------------------------------------------------- status


def _status_code(exc: BaseException) -> int | None:
    code = getattr(exc, "status", None)
    return int(code) if isinstance(code, int) or (isinstance(code, str) and code.isdigit()) else None


# Every object is created with fieldValidation=Strict: a field the installed CRD does not know (Trainer
# v2.1's TrainJob has no `spec.runtimePatches`) is a 400 from the API server, never silently pruned
# (which would drop the job's labels, node selector and tolerations and still start it).
FIELD_VALIDATION = "Strict"
# What a field unknown to the cluster's CRD means, for the fields whose absence has a known cause.
MISSING_FIELD_CAUSE = {
    "spec.runtimePatches": "Kubeflow Trainer v2.1 (bundled with Kubeflow 1.11.0) has no TrainJob "
                           "spec.runtimePatches: install Trainer v2.2 or v2.3 (docs/training-jobs.md), or "
                           "train with trainer=torchrun (single node) or job_kind=PyTorchJob",
    "spec.activeDeadlineSeconds": "Kubeflow Trainer v2.1 has no TrainJob spec.activeDeadlineSeconds: install "
                                  "Trainer v2.2 or v2.3",
}


def _unknown_fields(exc: BaseException) -> list[str]:
    """The fields a Strict create was refused for ('strict decoding error: unknown field "spec.x"')."""
    text = " ".join(str(x) for x in (getattr(exc, "body", None), getattr(exc, "reason", None), exc) if x)
    return sorted(set(re.findall(r'unknown field \\?"([^"\\]+)\\?"', text)))


def create_strict(api, kind_name: str, kind: Kind, obj: dict) -> dict:
    """Create `obj` with fieldValidation=Strict. A field the installed CRD lacks is a TemplateError naming
    the fields and their cause in one line, and nothing is created."""
    ns = obj["metadata"]["namespace"]
    try:
        return api.create_namespaced_custom_object(kind.group, kind.version, ns, kind.plural, obj,
                                                   field_validation=FIELD_VALIDATION)
    except Exception as e:
        fields = _unknown_fields(e) if _status_code(e) == 400 else []
        if not fields:
            raise
        causes = [MISSING_FIELD_CAUSE[f] for f in fields if f in MISSING_FIELD_CAUSE]
        raise TemplateError(
            f"the cluster's {kind_name} CRD ({kind.group}/{kind.version}) has no field "
            f"{', '.join(fields)}; the API server refused the job instead of dropping the field"
            + (f": {'; '.join(causes)}" if causes else "")
        ) from None


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
        except Exception as e:
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
        created = create_strict(api, kind_name, kind, obj)
        log.info("created %s %s/%s", kind_name, ns, name)
        return created or obj, False
    except Exception as e:
        if _status_code(e) != 409:
            raise
    existing = _get(api, kind, name, ns)
    want = obj["metadata"].get("annotations", {}).get(SPEC_HASH)
    have = (existing.get("metadata") or {}).get("annotations", {}).get(SPEC_HASH)
    if want and have != want:
        raise JobFailedError(
            f"{kind_name} {ns}/{name} already exists with a different spec (spec-hash {have} != "
            f"{want}); refusing to attach. Delete it or use another run id."
        )
    state, reason, _ = job_state(existing)
    if state == "Failed" and recreate_failed:
        log.warning(
            "%s %s/%s exists but failed (%s); deleting and creating it again", kind_name, ns, name, reason
        )
        delete(api, existing)
        _wait_gone(api, kind, name, ns, timeout_s=600, poll_s=poll_s, sleep=sleep, clock=clock)
        return create_strict(api, kind_name, kind, obj) or obj, False
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
        except Exception as e:
            code = _status_code(e)
            if code == 404:
                raise JobFailedError(
                    f"{kind_name} {ns}/{name} disappeared (deleted outside this step?)"
                ) from None
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
            emit(
                f"{kind_name} {name}: {state}"
                + (f" ({reason})" if reason else "")
                + (f": {message}" if message else "")
            )
            last = (state, reason, message)
        if state == "Succeeded":
            return cur
        if state == "Failed":
            raise JobFailedError(f"{kind_name} {ns}/{name} failed: {reason or 'unknown reason'}"
                                 + (f": {message}" if message else ""))
        if probe is not None and state != "Suspended":  # suspended (Kueue): no pods yet, nothing to read
            try:
                finding = probe.check(clock())
            except Exception as e:
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
            raise TimeoutError(
                f"{kind_name} {ns}/{name} did not finish within {timeout_s:.0f}s (last state {state})"
            )
        sleep(poll_s)


def delete(api, obj: dict) -> bool:
    """Delete the job (background propagation: its pods go too). False if it was already gone."""
    kind_name, kind = _kind_of(obj)
    name, ns = obj["metadata"]["name"], obj["metadata"]["namespace"]
    try:
        api.delete_namespaced_custom_object(kind.group, kind.version, ns, kind.plural, name,
                                            propagation_policy="Background")
    except Exception as e:
        if _status_code(e) == 404:
            return False
        raise
    log.warning("deleted %s %s/%s", kind_name, ns, name)
    return True


@contextlib.contextmanager
def delete_on_cancel(
    api, obj: dict, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT),
    is_cancellation: Callable[[], Any] | None = None, emit: Callable[[str], None] | None = None,
) -> Iterator[None]:
    """While active, SIGTERM/SIGINT end this process with 128 + signal (JobCancelledError); the job is
    deleted first when the signal cancels the run.

    KFP cancels a run by stopping its pods with SIGTERM; without the delete the TrainJob would keep its
    GPUs. A drain or scale-down of the launcher's node sends the same SIGTERM: `is_cancellation()` (a
    `cancel.Verdict`, see `chunkgrpo.k8s.cancel`) tells them apart; when it says the run goes on, the job
    is left running and the step's retry re-attaches to it by name. SIGINT (a person at a terminal) and
    a missing `is_cancellation` always delete. Handlers can only be installed from the main thread;
    elsewhere this is a no-op.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}
    say = emit or (lambda line: log.warning("%s", line))
    kind, name = obj["kind"], obj["metadata"]["name"]

    def handler(signum, frame):
        verdict = None
        if is_cancellation is not None and signum != signal.SIGINT:
            try:
                verdict = is_cancellation()
            except Exception as e:  # undecidable: the job must not outlive a cancelled run
                say(f"received signal {signum}; cannot tell a cancellation from a drain ({e})")
        if verdict is not None and not verdict.cancel:
            say(f"received signal {signum}: {verdict.why}; leaving {kind} {name} running (a retry of "
                "this step re-attaches to it)")
            raise JobCancelledError(128 + signum)
        say(f"received signal {signum}" + (f": {verdict.why}" if verdict is not None else "")
            + f"; deleting {kind} {name}")
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
           on_status: Callable[[str], None] | None = None, probe_factory: Callable[[dict], Any] | None = None,
           keep_failed: bool = False, logs: Callable[[dict], list[str]] | None = None,
           is_cancellation: Callable[[], Any] | None = None,
           sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic) -> dict:
    """submit_or_attach + wait, with the job deleted if this process is cancelled. Returns the final object.

    `probe_factory(created_object)` builds the pod/event probe (`diagnose.JobProbe.for_job`); when it
    finds a blocker the job is deleted (its pods would otherwise hold or wait for GPUs until the
    deadline) unless `keep_failed`, and JobBlockedError carries the one line. `logs(obj)` (e.g.
    `trainjob_log_tail`) is printed through `on_status` when the job fails or is blocked, before
    anything is deleted; the error itself stays one line. `is_cancellation` (`cancel.for_launcher`)
    decides on SIGTERM whether the run is cancelled (delete the job) or only this launcher pod is
    stopped (leave it running for the retry to re-attach to).
    """
    cur, attached = submit_or_attach(
        api, obj, recreate_failed=recreate_failed, poll_s=poll_s, sleep=sleep, clock=clock
    )
    emit = on_status or (lambda line: log.info("%s", line))
    emit(f"{'attached to' if attached else 'submitted'} {obj['kind']} {obj['metadata']['namespace']}/"
         f"{obj['metadata']['name']}")
    probe = None
    if probe_factory is not None:
        try:
            probe = probe_factory({**obj, **(cur or {}), "kind": obj["kind"]})
        except Exception as e:
            log.warning("cannot read the pods/events of %s (%s): blocked pods will not be detected early",
                        obj["metadata"]["name"], e)
    try:
        with delete_on_cancel(api, obj, is_cancellation=is_cancellation, emit=on_status):
            try:
                return wait(api, obj, timeout_s=timeout_s, poll_s=poll_s, on_status=on_status, probe=probe,
                            sleep=sleep, clock=clock)
            except JobFailedError:  # a blocked job too (crash loop: its last lines say why)
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


# ------------------------------------------------------------------ the cluster's runtime, template, owner


def _read(api, kind: Kind, name: str, namespace: str | None, what: str, install_hint: str) -> dict:
    try:
        if namespace is None:  # cluster-scoped
            return api.get_cluster_custom_object(kind.group, kind.version, kind.plural, name)
        return _get(api, kind, name, namespace)
    except Exception as e:
        code = _status_code(e)
        where = f" in namespace {namespace}" if namespace else ""
        if code == 404:
            raise TemplateError(f"{what} {name!r} not found{where}: {install_hint}") from None
        if code == 403:
            raise TemplateError(
                f"not allowed to read {what} {name!r}{where} (HTTP 403): bind the run's service "
                "account to the chunkgrpo-training Role / chunkgrpo-runtime-reader ClusterRole "
                "(manifests/base/pipeline/rbac.yaml)"
            ) from None
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
    refs = (
        (pod.get("metadata") or {}).get("ownerReferences")
        or (pod.get("metadata") or {}).get("owner_references")
        or []
    )
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
        except Exception as e:
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


# ------------------------------------------------------------------------------------------ clients


def current_namespace(default: str = "default") -> str:
    """The pod's namespace (service-account mount), else `default`."""
    try:
        with open(_NS_FILE) as f:
            return f.read().strip() or default
    except OSError:
        return default


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
    return lambda: core.api_client.sanitize_for_serialization(
        core.read_namespaced_pod(name, namespace, _request_timeout=10))  # also read inside a SIGTERM handler

"""Fail fast on the cluster: read a training job's pods and events and turn the states that never
fix themselves (or not within minutes) into ONE line naming the cause and the fix.

A TrainJob's conditions say nothing while its pods cannot be created (PodSecurity, quota), cannot
be scheduled, cannot pull their image, or are OOM-killed / evicted and restarted by JobSet: the
launcher would wait until `activeDeadlineSeconds` (48 h) with GPUs reserved. `JobProbe.check()`
is called on every poll of `launcher.wait`; a non-None `Finding` ends the step.

    probe = JobProbe.for_job(core_v1, obj, schedule_grace_s=900)   # core_v1: kubernetes CoreV1Api
    finding = probe.check(now)                                      # None or Finding(cause, fix)

What is read (field names as the API returns them, camelCase JSON; model objects are converted
with `ApiClient.sanitize_for_serialization`):

* **Pods** of the job (`jobset.sigs.k8s.io/jobset-name=<name>` for TrainJob, the JobSet Trainer
  creates with the TrainJob's name; `training.kubeflow.org/job-name=<name>` for PyTorchJob):
  `status.phase/reason/message` (kubelet eviction: reason `Evicted`), `status.conditions`
  (`PodScheduled=False`, reason `Unschedulable`), `status.{init,}containerStatuses[].state /
  lastState` (`waiting.reason` ErrImagePull / ImagePullBackOff / InvalidImageName /
  CreateContainerConfigError; `terminated.reason` OOMKilled), `restartCount` and `waiting.reason`
  CrashLoopBackOff (a crash loop: the last exit code and the last line of the termination message,
  which `terminationMessagePolicy: FallbackToLogsOnError` fills with the log's tail), and pods in
  phase Failed (the crash loop of a job that creates new pods instead of restarting).
* **Events** (core/v1 `Event`, streamed with `kubernetes.watch.Watch` by `EventWatch`) whose
  `involvedObject.name` is the job or one of its children (`<name>-...`): reason `FailedCreate`
  (the Job controller / Training Operator could not create a pod: PodSecurity admission, quota) and
  `Evicted`; events older than the job (`since`: its creationTimestamp) are ignored, so the events
  of a deleted and recreated job of the same name do not end the new one. Unschedulable pods are
  read from the pod condition (the `FailedScheduling` event says the same, later).

Grace periods: `Unschedulable` must persist `schedule_grace_s` (GPUs may free up; gang scheduling
and autoscalers take minutes) and image pull errors `pull_grace_s` (registry hiccups), measured
from the first time this probe saw them; the others end the step at once. With Kueue
(`queue_name`) a suspended job has no pods, so nothing fires before admission.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable

log = logging.getLogger(__name__)

POD_LABEL = {"TrainJob": "jobset.sigs.k8s.io/jobset-name", "PyTorchJob": "training.kubeflow.org/job-name"}
PULL_ERRORS = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull")
_PODSECURITY = re.compile(r'violates PodSecurity "([a-z]+):[^"]*": (.*)$')


@dataclasses.dataclass(frozen=True)
class Finding:
    """A blocker: `kind` (stable id), `cause` (what happened, with the API's words), `fix`."""

    kind: str
    cause: str
    fix: str
    grace_s: float = 0.0          # how long it must persist before the step ends (0 = at once)
    key: str = ""                 # what it is about (pod/container), for the persistence clock

    def line(self) -> str:
        return f"{self.cause} -> fix: {self.fix}"


def _when(stamp) -> datetime.datetime | None:
    """An API timestamp ('2026-11-25T13:05:09Z', or with fractional seconds) as an aware datetime."""
    if not stamp:
        return None
    if isinstance(stamp, datetime.datetime):
        return stamp if stamp.tzinfo else stamp.replace(tzinfo=datetime.timezone.utc)
    return datetime.datetime.fromisoformat(str(stamp).replace("Z", "+00:00"))


def _short(text: str, n: int = 300) -> str:
    text = " ".join(str(text or "").split())
    return text if len(text) <= n else text[: n - 3] + "..."


# ------------------------------------------------------------------------------------------ pods

FIX_STORAGE = ("large files (model cache, embeddings, checkpoints) must go to the /cache volume "
               "(CHUNKGRPO_CACHE, output_dir), not /tmp or $HOME; or raise the runtime's ephemeral-storage / "
               "emptyDir sizeLimit")
FIX_NODE = "the node ran out of a resource: raise the pod's requests to what it uses"
FIX_SCHEDULE = ("check the pool (nodeSelector nvidia.com/gpu.product; `kubectl get nodes -L "
                "nvidia.com/gpu.product`), the GPU taint toleration, and free GPUs / RDMA devices; or use "
                "fewer num_nodes / a Kueue queue")
FIX_PULL = ("check the image name/tag (chunkgrpo pipeline compile --registry/--tag) and that the registry "
            "Secret is set (--image-pull-secret, components/image-pull-secret)")
FIX_CONFIG = ("create the missing Secret/ConfigMap in the job's namespace "
              "(manifests/README.md, install step 2)")
FIX_OOM = ("raise the runtime's memory limit, or lower host memory use (smaller policy_batch / num_workers, "
           "LoRA instead of full fine-tuning); see `chunkgrpo capacity`")
FIX_PODSECURITY = ("label the namespace pod-security.kubernetes.io/enforce=privileged (needed by the RDMA "
                   "component's IPC_LOCK; manifests/README.md, Security model) or drop components/rdma")
FIX_QUOTA = "raise the namespace ResourceQuota (kubectl describe quota) or request fewer nodes/GPUs"
FIX_CREATE = "fix what the message names (admission webhook, quota, service account)"
FIX_CRASH = ("the training process itself fails at every start: fix what its last log lines say (they are "
             "printed above), then run again")
# Restarts of a training container after which it is taken for a crash loop (restartPolicy OnFailure
# restarts in place; the Job's backoffLimit of 6 would otherwise take an hour of back-offs), and failed
# pods of a job with restartPolicy Never that mean the same. A rendezvous that waits for a peer that is
# not yet scheduled restarts every 10 min, so the Unschedulable grace ends such a job first.
CRASH_RESTARTS = 2


def _evicted_fix(msg: str) -> str:
    return FIX_STORAGE if ("ephemeral" in msg or "EmptyDir" in msg) else FIX_NODE


def _unschedulable(c: dict) -> bool:
    return (c.get("type") == "PodScheduled" and str(c.get("status")) == "False"
            and c.get("reason") == "Unschedulable")


def pod_findings(pod: dict, *, schedule_grace_s: float = 900.0, pull_grace_s: float = 180.0) -> list[Finding]:
    """Blockers visible in one pod (a dict shaped as the API returns it)."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    name = meta.get("name", "?")
    out: list[Finding] = []
    if status.get("reason") == "Evicted":
        msg = _short(status.get("message"))
        out.append(Finding("Evicted", f"pod {name} was Evicted by the kubelet: {msg}", _evicted_fix(msg),
                           key=name))
    for c in status.get("conditions") or []:
        if _unschedulable(c):
            out.append(Finding("Unschedulable", f"pod {name} cannot be scheduled: {_short(c.get('message'))}",
                               FIX_SCHEDULE, grace_s=schedule_grace_s, key=name))
    for cs in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
        where = f"pod {name} container {cs.get('name', '?')}"
        key = f"{name}/{cs.get('name', '?')}"
        waiting = (cs.get("state") or {}).get("waiting") or {}
        reason, detail = waiting.get("reason", ""), _short(waiting.get("message"))
        if reason in PULL_ERRORS:
            image = cs.get("image", "its image")
            grace = 0.0 if reason == "InvalidImageName" else pull_grace_s
            out.append(Finding("ImagePull", f"{where} cannot pull {image}: {reason}: {detail}", FIX_PULL,
                               grace_s=grace, key=key))
        elif reason == "CreateContainerConfigError":
            out.append(Finding("ContainerConfig", f"{where}: {detail}", FIX_CONFIG, grace_s=pull_grace_s,
                               key=key))
        oom = False
        for which in ("state", "lastState"):
            term = (cs.get(which) or {}).get("terminated") or {}
            if term.get("reason") == "OOMKilled":
                containers = (pod.get("spec") or {}).get("containers") or [{}]
                limit = (containers[0].get("resources") or {}).get("limits", {}).get("memory", "?")
                cause = f"{where} was OOMKilled (host memory limit {limit}, exit code {term.get('exitCode')})"
                out.append(Finding("OOMKilled", cause, FIX_OOM, key=key))
                oom = True
                break
        restarts = int(cs.get("restartCount") or 0)
        if not oom and (reason == "CrashLoopBackOff" or restarts >= CRASH_RESTARTS):
            out.append(Finding("CrashLoop", f"{where} is crash-looping ({restarts} restarts"
                               + (", CrashLoopBackOff" if reason == "CrashLoopBackOff" else "")
                               + f"): {_last_exit(cs)}", FIX_CRASH, key=key))
    return out


def _last_exit(cs: dict) -> str:
    """`exit code N (Reason): <last line of its termination message>` of a container's last run."""
    term = ((cs.get("lastState") or {}).get("terminated") or (cs.get("state") or {}).get("terminated") or {})
    lines = [ln for ln in str(term.get("message") or "").splitlines() if ln.strip()]
    return (f"exit code {term.get('exitCode', '?')} ({term.get('reason') or 'no reason'})"
            + (f": {_short(lines[-1], 200)}" if lines else ""))


def failed_pods_finding(pods: list[dict]) -> Finding | None:
    """A crash loop of a job whose pods are not restarted in place (restartPolicy Never): CRASH_RESTARTS
    or more of its pods Failed (not evicted, which has its own finding)."""
    failed = [p for p in pods if (p.get("status") or {}).get("phase") == "Failed"
              and (p.get("status") or {}).get("reason") != "Evicted"]
    if len(failed) < CRASH_RESTARTS:
        return None
    last = max(failed, key=lambda p: str((p.get("metadata") or {}).get("creationTimestamp") or ""))
    statuses = (last.get("status") or {}).get("containerStatuses") or [{}]
    return Finding("CrashLoop", f"{len(failed)} pods of the job failed, the last "
                   f"{(last.get('metadata') or {}).get('name', '?')}: {_last_exit(statuses[0])}", FIX_CRASH,
                   key="failed-pods")


# ---------------------------------------------------------------------------------------- events


def event_finding(event: dict) -> Finding | None:
    """A blocker in one core/v1 Event (dict as the API returns it), or None."""
    reason, msg = event.get("reason", ""), _short(event.get("message"), 400)
    obj = event.get("involvedObject") or {}
    what = f"{obj.get('kind', '?')} {obj.get('name', '?')}"
    if reason in ("FailedCreate", "FailedCreatePod"):
        m = _PODSECURITY.search(msg)
        if m:
            level, detail = m.groups()
            return Finding("PodSecurity", f"{what} cannot create pods: the namespace enforces PodSecurity "
                           f"\"{level}\", which rejects them: {detail}", FIX_PODSECURITY, key=what)
        if "exceeded quota" in msg:
            return Finding("Quota", f"{what} cannot create pods: {msg}", FIX_QUOTA, key=what)
        return Finding("FailedCreate", f"{what} cannot create pods: {msg}", FIX_CREATE, key=what)
    if reason == "Evicted":
        return Finding("Evicted", f"{what} was evicted: {msg}", _evicted_fix(msg), key=what)
    return None


class EventWatch:
    """Warning events of one job, streamed with `kubernetes.watch.Watch` over
    `CoreV1Api.list_namespaced_event`: `prime()` lists once, then the watch resumes from the last
    resourceVersion (a 410 Gone restarts it from now). `start()` runs it in a daemon thread; `pump()`
    runs one bounded stream (tests)."""

    def __init__(self, core, namespace: str, job_name: str, *, since: str = "",
                 watch_factory: Callable | None = None, timeout_s: int = 60):
        self.core, self.namespace, self.job_name = core, namespace, job_name
        self.since = _when(since)
        self.timeout_s = timeout_s
        self._watch_factory = watch_factory
        self._events: collections.deque = collections.deque(maxlen=1000)
        self._resource_version: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watch = None

    def relevant(self, event: dict) -> bool:
        name = (event.get("involvedObject") or {}).get("name", "")
        ours = name == self.job_name or name.startswith(self.job_name + "-")
        if event.get("type") != "Warning" or not ours:
            return False
        when = _when(event.get("lastTimestamp") or event.get("eventTime")
                     or (event.get("metadata") or {}).get("creationTimestamp"))
        return self.since is None or when is None or when >= self.since

    def prime(self) -> EventWatch:
        """List the namespace's events once (those already there when the launcher starts or
        re-attaches) and remember the list's resourceVersion for the watch: list-then-watch."""
        to_dict = self.core.api_client.sanitize_for_serialization
        listing = to_dict(self.core.list_namespaced_event(self.namespace))
        self._resource_version = (listing.get("metadata") or {}).get("resourceVersion") or None
        self._events.extend(e for e in listing.get("items") or [] if self.relevant(e))
        return self

    def pump(self) -> None:
        from kubernetes import watch

        self._watch = (self._watch_factory or watch.Watch)()
        kw = {"timeout_seconds": self.timeout_s}
        if self._resource_version:
            kw["resource_version"] = self._resource_version
        try:
            for item in self._watch.stream(self.core.list_namespaced_event, self.namespace, **kw):
                raw = item.get("raw_object") or {}
                rv = (raw.get("metadata") or {}).get("resourceVersion")
                if rv:
                    self._resource_version = rv
                if item.get("type") in ("ADDED", "MODIFIED") and self.relevant(raw):
                    self._events.append(raw)
                if self._stop.is_set():
                    break
        except Exception as e:
            if getattr(e, "status", None) == 410:
                self._resource_version = None
            else:
                raise
        finally:
            self._watch.stop()

    def _loop(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.pump()
            except Exception as e:
                log.warning("event watch for %s: %s", self.job_name, e)
                self._stop.wait(10)
            # a stream that ends at once (an API server closing the watch early) must not spin
            self._stop.wait(max(0.0, 1.0 - (time.monotonic() - started)))

    def start(self) -> EventWatch:
        self._thread = threading.Thread(target=self._loop, name=f"events-{self.job_name}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()

    def events(self) -> list[dict]:
        return list(self._events)


# ----------------------------------------------------------------------------------------- probe


class JobProbe:
    """Pods + events of one job -> the first blocker that has persisted past its grace period."""

    def __init__(self, list_pods: Callable[[], Iterable[dict]], events: Callable[[], Iterable[dict]], *,
                 schedule_grace_s: float = 900.0, pull_grace_s: float = 180.0):
        self.list_pods, self.events = list_pods, events
        self.schedule_grace_s, self.pull_grace_s = schedule_grace_s, pull_grace_s
        self._first_seen: dict[tuple[str, str], float] = {}

    @classmethod
    def for_job(cls, core, obj: dict, *, watch_events: bool = True, **kw) -> JobProbe:
        """Probe for a built TrainJob/PyTorchJob `obj` through a `kubernetes.client.CoreV1Api`."""
        name, ns = obj["metadata"]["name"], obj["metadata"]["namespace"]
        selector = f"{POD_LABEL[obj['kind']]}={name}"
        to_dict = core.api_client.sanitize_for_serialization

        def list_pods() -> list[dict]:
            return [to_dict(p) for p in core.list_namespaced_pod(ns, label_selector=selector).items]

        since = (obj.get("metadata") or {}).get("creationTimestamp") or ""
        watcher = None
        if watch_events:
            try:
                watcher = EventWatch(core, ns, name, since=since).prime().start()
            except Exception as e:
                log.warning("cannot list events in %s (%s): FailedCreate (PodSecurity, quota) will not be "
                            "seen; "
                            "grant list/watch on events", ns, e)
        probe = cls(list_pods, watcher.events if watcher else list, **kw)
        probe.watcher = watcher
        return probe

    def close(self) -> None:
        w = getattr(self, "watcher", None)
        if w is not None:
            w.stop()

    def findings(self) -> list[Finding]:
        out = []
        pods = list(self.list_pods())
        for pod in pods:
            out += pod_findings(pod, schedule_grace_s=self.schedule_grace_s, pull_grace_s=self.pull_grace_s)
        crashed = failed_pods_finding(pods)
        if crashed is not None:
            out.append(crashed)
        for ev in self.events():
            f = event_finding(ev)
            if f is not None:
                out.append(f)
        return out

    def check(self, now: float) -> Finding | None:
        """The first finding whose grace period has passed (measured from when this probe first saw it)."""
        found = self.findings()
        live = {(f.kind, f.key) for f in found}
        self._first_seen = {k: t for k, t in self._first_seen.items() if k in live}  # cleared ones start over
        for f in found:
            first = self._first_seen.setdefault((f.kind, f.key), now)
            if now - first >= f.grace_s:
                return f
        return None

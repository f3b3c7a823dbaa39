"""Whether a SIGTERM to the launcher pod cancels the run or only moves the launcher.

A training job must go when its KFP run is cancelled (its GPUs would otherwise stay taken), and must
stay when only the launcher pod is stopped: a node drain, an autoscaler scale-down or a preemption of
the CPU node it runs on. The signal is the same in both cases; the run's Argo Workflow tells them apart:

* KFP's TerminateRun merge-patches the Workflow with `spec.activeDeadlineSeconds: 0` (the terminate
  patch of the Argo execution type in the API server) BEFORE Argo stops the run's pods; Argo's own
  stop/terminate, and KFP versions that use it, set `spec.shutdown` (Terminate | Stop) first as well;
  deleting a run deletes the Workflow (`metadata.deletionTimestamp` set, then 404).
* A drain, a scale-down or an eviction stops the pod and changes nothing on the Workflow; the pod
  carries a `DisruptionTarget` condition (EvictionByEvictionAPI, PreemptionByScheduler,
  DeletionByTaintManager, TerminationByKubelet; Kubernetes >= 1.26).

Rule (`decide`): the run is cancelled when its Workflow is being deleted or gone, has
`activeDeadlineSeconds` 0 (or a deadline already past) or a `shutdown` strategy; a Workflow that says
none of these means the launcher alone is stopped: the job is left running, and the step's retry
re-creates the launcher, which re-attaches to the job by its deterministic name
(`launcher.submit_or_attach`). When the Workflow cannot be read (no ownerReference, no RBAC, API error),
a `DisruptionTarget` condition on the launcher's own pod still says "moved"; without either, the job is
deleted, since a job left behind after a cancellation holds GPUs until its deadline.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
from collections.abc import Callable

from chunkgrpo.k8s.jobspec import Kind

log = logging.getLogger(__name__)

WORKFLOW = Kind("argoproj.io", "v1alpha1", "workflows")
# The decision runs inside the SIGTERM handler, within the pod's grace period (30 s by default): a slow
# API server makes the read fail (then the pod's condition decides), never outlast the grace period.
READ_TIMEOUT_S = 10


@dataclasses.dataclass(frozen=True)
class Verdict:
    """`cancel`: delete the job; `why`: one line for the log."""

    cancel: bool
    why: str


def workflow_cancelled(wf: dict, now: datetime.datetime | None = None) -> str:
    """Why the run's Workflow says the run is being cancelled ('' = it does not)."""
    meta, spec = wf.get("metadata") or {}, wf.get("spec") or {}
    if meta.get("deletionTimestamp"):
        return f"the run's Workflow {meta.get('name', '?')} is being deleted"
    if spec.get("shutdown"):
        return f"the run's Workflow has spec.shutdown={spec['shutdown']}"
    deadline = spec.get("activeDeadlineSeconds")
    if deadline is not None and int(deadline) <= 0:
        return "the run was terminated (Workflow spec.activeDeadlineSeconds=0)"
    started = ((wf.get("status") or {}).get("startedAt") or "").replace("Z", "+00:00")
    if deadline is not None and started:
        now = now or datetime.datetime.now(datetime.timezone.utc)
        if (now - datetime.datetime.fromisoformat(started)).total_seconds() >= int(deadline):
            return f"the run's Workflow passed its activeDeadlineSeconds={deadline}"
    return ""


def pod_disrupted(pod: dict) -> str:
    """The reason of a True `DisruptionTarget` condition on a pod ('' = none)."""
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "DisruptionTarget" and str(c.get("status")) == "True":
            return c.get("reason") or "DisruptionTarget"
    return ""


def decide(get_workflow: Callable[[], dict] | None, get_pod: Callable[[], dict] | None) -> Verdict:
    """The rule of this module. `get_workflow()` reads the run's Workflow (raising an error with HTTP
    `.status` 404 when it is gone), `get_pod()` the launcher's own pod; either may be None (unknown)."""
    unread = "no ownerReference to the run's Workflow"
    if get_workflow is not None:
        try:
            why = workflow_cancelled(get_workflow())
            if why:
                return Verdict(True, why)
            return Verdict(False, "the run's Workflow is not cancelled (a drain, scale-down or eviction "
                                  "stopped the launcher pod)")
        except Exception as e:
            if getattr(e, "status", None) == 404:
                return Verdict(True, "the run's Workflow is gone (run deleted)")
            unread = f"cannot read the run's Workflow ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    if get_pod is not None:
        try:
            reason = pod_disrupted(get_pod())
        except Exception as e:
            reason = ""
            unread += f"; cannot read this pod ({type(e).__name__})"
        if reason:
            return Verdict(False, f"{unread}; this pod is a DisruptionTarget ({reason}): the launcher is "
                                  "being moved, not cancelled")
    return Verdict(True, f"{unread}: treated as a cancellation")


def for_launcher(api, owner: dict | None, namespace: str,
                 get_pod: Callable[[], dict] | None) -> Callable[[], Verdict]:
    """`decide` bound to the run's Workflow (`owner`, from `launcher.owner_from_pod`) through a
    CustomObjectsApi, and to the launcher's own pod."""
    get_workflow = None
    if owner and owner.get("kind") == "Workflow":
        def get_workflow() -> dict:
            return api.get_namespaced_custom_object(WORKFLOW.group, WORKFLOW.version, namespace,
                                                    WORKFLOW.plural, owner["name"],
                                                    _request_timeout=READ_TIMEOUT_S)

    return lambda: decide(get_workflow, get_pod)

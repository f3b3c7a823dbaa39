"""chunkgrpo.k8s.cancel: a SIGTERM to the launcher is a run cancellation only when the run's Argo
Workflow says so (KFP's terminate patch `activeDeadlineSeconds: 0`, an Argo shutdown strategy, the
Workflow deleted); a drain leaves the Workflow as it was and marks the pod a DisruptionTarget."""

import copy
import datetime
from pathlib import Path

import pytest
import yaml

from chunkgrpo.k8s import cancel

FIX = yaml.safe_load((Path(__file__).resolve().parents[2] / "fixtures" / "k8s" / "failfast.yaml").read_text())
WF = {"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow",
      "metadata": {"name": "train-and-evaluate-x8k2q", "namespace": "team-a"},
      "spec": {"entrypoint": "entrypoint", "serviceAccountName": "pipeline-runner"},
      "status": {"phase": "Running", "startedAt": "2026-11-25T13:00:00Z"}}


class ApiError(Exception):
    def __init__(self, status):
        super().__init__(f"({status})")
        self.status = status


def wf(**spec):
    out = copy.deepcopy(WF)
    out["spec"].update(spec)
    return out


def raising(status):
    def get():
        raise ApiError(status)
    return get


@pytest.mark.parametrize("workflow,why", [
    (wf(activeDeadlineSeconds=0), "activeDeadlineSeconds=0"),        # KFP TerminateRun
    (wf(shutdown="Terminate"), "shutdown=Terminate"),                  # argo terminate
    (wf(shutdown="Stop"), "shutdown=Stop"),                            # argo stop
    ({**wf(), "metadata": {**WF["metadata"], "deletionTimestamp": "2026-11-25T15:00:00Z"}}, "being deleted"),
])
def test_a_cancelled_run_is_a_cancellation(workflow, why):
    v = cancel.decide(lambda: workflow, lambda: FIX["pods"]["launcher_drained"])
    assert v.cancel and why in v.why


def test_a_workflow_past_its_deadline_is_a_cancellation():
    now = datetime.datetime(2026, 11, 25, 14, 0, tzinfo=datetime.timezone.utc)
    past = cancel.workflow_cancelled(wf(activeDeadlineSeconds=3600), now)
    assert "passed its activeDeadlineSeconds" in past
    assert cancel.workflow_cancelled(wf(activeDeadlineSeconds=7200), now) == ""


def test_a_drain_is_not_a_cancellation():
    """The run's Workflow unchanged: the launcher pod alone is being stopped (drain, scale-down)."""
    v = cancel.decide(lambda: wf(), lambda: FIX["pods"]["running"])
    assert not v.cancel and "not cancelled" in v.why


def test_a_deleted_run_is_a_cancellation():
    gone = cancel.decide(raising(404), None)
    assert gone == cancel.Verdict(True, "the run's Workflow is gone (run deleted)")


def test_an_unreadable_workflow_falls_back_to_the_pods_disruption_condition():
    drained = cancel.decide(raising(403), lambda: FIX["pods"]["launcher_drained"])
    assert not drained.cancel and "EvictionByEvictionAPI" in drained.why
    assert "cannot read the run's Workflow (ApiError: (403))" in drained.why
    plain = cancel.decide(raising(403), lambda: FIX["pods"]["running"])
    assert plain.cancel and "treated as a cancellation" in plain.why  # undecidable: never orphan the job
    assert cancel.decide(None, None).cancel


def test_for_launcher_reads_the_owner_workflow_in_the_namespace():
    calls = []

    class Api:
        def get_namespaced_custom_object(self, group, version, ns, plural, name, _request_timeout=None):
            calls.append((group, version, ns, plural, name, _request_timeout))
            return wf(activeDeadlineSeconds=0)

    owner = {"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow", "name": "train-and-evaluate-x8k2q",
             "uid": "u"}
    assert cancel.for_launcher(Api(), owner, "team-a", None)().cancel
    assert calls == [("argoproj.io", "v1alpha1", "team-a", "workflows", "train-and-evaluate-x8k2q",
                      cancel.READ_TIMEOUT_S)]
    assert cancel.for_launcher(Api(), None, "team-a", None)().cancel and len(calls) == 1

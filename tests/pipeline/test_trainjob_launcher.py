"""chunkgrpo.k8s.launcher against a FAKE Kubernetes API (tests/pipeline/trainjob_fakes.py): submit-or-attach,
strict field validation, status streaming, failure reasons, timeouts, cancellation and drains, templates
and orphan cleanup."""

import os
import signal
from pathlib import Path

import pytest

from chunkgrpo.k8s import jobspec, launcher, pytorchjob
from tests import k8s_schemas
from tests.pipeline.trainjob_fakes import (
    NO_SLEEP,
    RUN_ID,
    RUNNING_V2,
    FakeApi,
    cond,
    job,
    prod_runtime,
    prod_template,
    spec,
)


def test_submit_then_retry_reattaches_instead_of_duplicating():
    api = FakeApi()
    obj = job()
    first, attached = launcher.submit_or_attach(api, obj)
    assert not attached
    again, attached = launcher.submit_or_attach(api, job())  # a retried launcher: same name
    assert attached and again["metadata"]["name"] == obj["metadata"]["name"]
    assert len(api.objects) == 1 and [c[0] for c in api.calls] == ["create", "create", "get"]


def test_attach_refuses_a_job_with_another_spec():
    api = FakeApi()
    launcher.submit_or_attach(api, job())
    with pytest.raises(jobspec.JobFailedError, match="different spec"):
        launcher.submit_or_attach(api, job(train_args=["--config", "dance_grpo_flux"]))


def test_attach_to_a_failed_job_recreates_it():
    api = FakeApi()
    obj = job()
    launcher.submit_or_attach(api, obj)
    api.statuses = [cond("Failed", "BackoffLimitExceeded")]
    cur, attached = launcher.submit_or_attach(api, obj, **NO_SLEEP)
    assert not attached and ("delete", obj["metadata"]["name"], "Background") in api.calls
    assert len(api.objects) == 1 and "status" not in next(iter(api.objects.values()))


def _crd_spec_fields(version: str) -> set[str]:
    """The TrainJob spec fields of a Trainer release (the vendored schema the CRD is generated from)."""
    import json

    schema = json.loads((k8s_schemas.FIXTURES / f"trainer-{version}.schema.json").read_text())
    return set(schema["$defs"]["TrainerV1alpha1TrainJobSpec"]["properties"])


def test_jobs_are_created_with_strict_field_validation():
    api = FakeApi()
    obj = job()
    launcher.submit_or_attach(api, obj)
    api.statuses = [cond("Failed", "BackoffLimitExceeded")]
    launcher.submit_or_attach(api, obj, **NO_SLEEP)  # the re-creation of a failed job too
    assert api.field_validation == ["Strict", "Strict", "Strict"]


def test_trainer_v2_1_is_refused_in_one_line_before_anything_is_created():
    """Trainer v2.1's TrainJob CRD has no spec.runtimePatches (Kubeflow 1.11.0 bundles it). Without Strict
    field validation the API server would prune it and start a job without its labels and tolerations;
    with it the create is refused, and the launcher names the cause and the fix."""
    assert "runtimePatches" not in _crd_spec_fields("v2.1.0")
    api = FakeApi()
    api.spec_fields = _crd_spec_fields("v2.1.0")
    with pytest.raises(jobspec.TemplateError) as e:
        launcher.launch(api, job(), timeout_s=60, **NO_SLEEP)
    line = str(e.value)
    assert "\n" not in line and "spec.runtimePatches" in line and "Trainer v2.1" in line
    assert "v2.2 or v2.3" in line and "trainer=torchrun" in line
    assert api.objects == {} and [c[0] for c in api.calls] == ["create"]


def test_without_strict_validation_the_v2_1_server_would_drop_the_placement():
    """What Strict protects: the same create without it 'succeeds' and the pod patch is gone."""
    api = FakeApi()
    api.spec_fields = _crd_spec_fields("v2.1.0")
    obj = job()
    k = jobspec.KINDS["TrainJob"]
    api.create_namespaced_custom_object(k.group, k.version, obj["metadata"]["namespace"], k.plural, obj)
    (stored,) = api.objects.values()
    assert "runtimePatches" in obj["spec"] and "runtimePatches" not in stored["spec"]


def test_unknown_fields_are_read_from_the_kubernetes_clients_error():
    from kubernetes.client.exceptions import ApiException

    e = ApiException(status=400, reason="Bad Request")
    e.body = ('{"kind":"Status","apiVersion":"v1","status":"Failure","message":"TrainJob in version '
              '\\"v1alpha1\\" cannot be handled as a TrainJob: strict decoding error: unknown field '
              '\\"spec.activeDeadlineSeconds\\", unknown field \\"spec.runtimePatches\\"",'
              '"reason":"BadRequest","code":400}')
    assert launcher._unknown_fields(e) == ["spec.activeDeadlineSeconds", "spec.runtimePatches"]

    class Api:
        def create_namespaced_custom_object(self, *a, **kw):
            raise e

    with pytest.raises(jobspec.TemplateError,
                       match=r"no field spec\.activeDeadlineSeconds, spec\.runtimePatches"):
        launcher.submit_or_attach(Api(), job())


@pytest.mark.parametrize("version", ["v2.2.0", "v2.3.0"])
def test_trainer_v2_2_and_v2_3_accept_the_job_under_strict_validation(version):
    api = FakeApi()
    api.spec_fields = _crd_spec_fields(version)
    cur, attached = launcher.submit_or_attach(api, job(active_deadline_seconds=3600, queue_name="q"))
    assert not attached and "runtimePatches" in cur["spec"]


def test_wait_streams_status_changes_and_returns_on_success():
    api = FakeApi(statuses=[{}, RUNNING_V2, RUNNING_V2, cond("Complete", "JobSetCompleted", "done")],
                  get_errors=[])
    obj = job()
    launcher.submit_or_attach(api, obj)
    seen = []
    final = launcher.wait(api, obj, timeout_s=60, on_status=seen.append, **NO_SLEEP)
    assert launcher.job_state(final)[0] == "Succeeded"
    assert [s.split(": ", 1)[1] for s in seen] == ["Pending", "Running", "Succeeded (JobSetCompleted): done"]


def test_wait_survives_transient_api_errors():
    api = FakeApi(statuses=[RUNNING_V2, cond("Complete")])
    obj = job()
    launcher.submit_or_attach(api, obj)
    api.get_errors = [503, 500]
    assert launcher.job_state(launcher.wait(api, obj, timeout_s=60, **NO_SLEEP))[0] == "Succeeded"


def test_failure_reason_surfaces():
    api = FakeApi(
        statuses=[RUNNING_V2, cond("Failed", "DeadlineExceeded", "TrainJob exceeded activeDeadlineSeconds")]
    )
    obj = job()
    launcher.submit_or_attach(api, obj)
    with pytest.raises(
        jobspec.JobFailedError, match="DeadlineExceeded: TrainJob exceeded activeDeadlineSeconds"
    ):
        launcher.wait(api, obj, timeout_s=60, **NO_SLEEP)


def test_pytorchjob_conditions():
    api = FakeApi(
        statuses=[cond("Created"), cond("Running"), cond("Failed", "PyTorchJobFailed", "pod OOMKilled")]
    )
    obj = pytorchjob.build_pytorchjob(spec(), prod_template())
    launcher.submit_or_attach(api, obj)
    seen = []
    with pytest.raises(jobspec.JobFailedError, match="PyTorchJobFailed: pod OOMKilled"):
        launcher.wait(api, obj, timeout_s=60, on_status=seen.append, **NO_SLEEP)
    assert [s.split(": ")[1].split(" ")[0] for s in seen] == ["Pending", "Running", "Failed"]


def test_timeout():
    clock = iter(range(0, 10_000, 100))
    api = FakeApi(statuses=[RUNNING_V2] * 100)
    obj = job()
    launcher.submit_or_attach(api, obj)
    with pytest.raises(TimeoutError):
        launcher.wait(api, obj, timeout_s=250, clock=lambda: next(clock), **NO_SLEEP)


def test_deleted_outside_fails_the_wait():
    api = FakeApi()
    obj = job()
    launcher.submit_or_attach(api, obj)
    api.objects.clear()
    with pytest.raises(jobspec.JobFailedError, match="disappeared"):
        launcher.wait(api, obj, timeout_s=60, **NO_SLEEP)


def test_cancellation_sigterm_deletes_the_job():
    """What KFP does on run cancellation: SIGTERM to the launcher step while it waits."""
    api = FakeApi(statuses=[RUNNING_V2] * 100)
    obj = job()
    polls = []

    def sleep(_):
        polls.append(1)
        if len(polls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(jobspec.JobCancelledError) as exc:
        launcher.launch(api, obj, timeout_s=3600, sleep=sleep)
    assert exc.value.code == 128 + signal.SIGTERM
    assert ("delete", obj["metadata"]["name"], "Background") in api.calls and not api.objects
    assert signal.getsignal(signal.SIGTERM) is before  # handler restored


def _sigterm_on_poll(n: int):
    polls = []

    def sleep(_):
        polls.append(1)
        if len(polls) == n:
            os.kill(os.getpid(), signal.SIGTERM)

    return sleep


WORKFLOW = ("argoproj.io", "v1alpha1", "kubeflow", "workflows", "train-and-evaluate-x8k2q")


def _with_workflow(api: FakeApi, **spec) -> None:
    api.objects[WORKFLOW] = {"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow",
                             "metadata": {"name": WORKFLOW[-1], "namespace": "kubeflow"}, "spec": spec}


def test_a_drain_of_the_launcher_leaves_the_job_and_the_retry_reattaches():
    """A SIGTERM while the run's Workflow is not cancelled (a node drain or scale-down of the launcher's
    node): the TrainJob keeps running; the step's retry (a new launcher with the same run) attaches to it
    by its deterministic name and watches it to the end."""
    from chunkgrpo.k8s import cancel

    api = FakeApi(statuses=[RUNNING_V2] * 3 + [RUNNING_V2, cond("Complete")])
    _with_workflow(api)
    owner = {"kind": "Workflow", "name": WORKFLOW[-1]}
    obj = job()
    lines = []
    with pytest.raises(jobspec.JobCancelledError) as exc:
        launcher.launch(api, obj, timeout_s=3600, sleep=_sigterm_on_poll(2), on_status=lines.append,
                        is_cancellation=cancel.for_launcher(api, owner, "kubeflow", None))
    assert exc.value.code == 128 + signal.SIGTERM
    assert not any(c[0] == "delete" for c in api.calls) and len(api.objects) == 2  # job + workflow
    assert any("leaving TrainJob" in ln and "not cancelled" in ln for ln in lines), lines
    retry = job()  # built again from the same run: same name, same spec hash
    assert retry["metadata"]["name"] == obj["metadata"]["name"]
    final = launcher.launch(api, retry, timeout_s=3600, on_status=lines.append, **NO_SLEEP)
    assert launcher.job_state(final)[0] == "Succeeded"
    assert f"attached to TrainJob kubeflow/{obj['metadata']['name']}" in lines
    assert sum(c[0] == "create" for c in api.calls) == 2  # the second create was a 409: attached


def test_a_cancelled_run_still_deletes_the_job():
    """KFP's TerminateRun patches the Workflow's activeDeadlineSeconds to 0 before Argo stops the pods."""
    from chunkgrpo.k8s import cancel

    api = FakeApi(statuses=[RUNNING_V2] * 100)
    _with_workflow(api, activeDeadlineSeconds=0)
    obj = job()
    lines = []
    with pytest.raises(jobspec.JobCancelledError):
        launcher.launch(api, obj, timeout_s=3600, sleep=_sigterm_on_poll(2), on_status=lines.append,
                        is_cancellation=cancel.for_launcher(api, {"kind": "Workflow", "name": WORKFLOW[-1]},
                                                            "kubeflow", None))
    assert ("delete", obj["metadata"]["name"], "Background") in api.calls
    assert list(api.objects) == [WORKFLOW]
    assert any("activeDeadlineSeconds=0" in ln and "deleting TrainJob" in ln for ln in lines), lines


def test_launch_success_leaves_the_job_and_restores_handlers():
    api = FakeApi(statuses=[RUNNING_V2, cond("Complete")])
    obj = job()
    before = signal.getsignal(signal.SIGTERM)
    final = launcher.launch(api, obj, timeout_s=60, **NO_SLEEP)
    assert launcher.job_state(final)[0] == "Succeeded" and len(api.objects) == 1
    assert signal.getsignal(signal.SIGTERM) is before


def test_delete_is_idempotent():
    api = FakeApi()
    obj = job()
    launcher.submit_or_attach(api, obj)
    assert launcher.delete(api, obj) is True and launcher.delete(api, obj) is False


def test_library_module_has_no_kfp_and_lazy_kubernetes_imports():
    for path in sorted(Path(launcher.__file__).parent.glob("*.py")):  # every module of chunkgrpo.k8s
        src = path.read_text()
        assert "import kfp" not in src and "from kfp" not in src, path
        top_level = [line for line in src.splitlines() if line.startswith(("import ", "from "))]
        assert not any("kubernetes" in line for line in top_level), path


# ------------------------------------------------------------------------------ templates, orphans


@pytest.mark.parametrize("status,match", [
    (404, "not found in namespace kubeflow: add manifests/components/training"),
    (403, "not allowed to read PyTorchJob template"),
])
def test_unreadable_template_fails_loudly(status, match):
    api = FakeApi(get_errors=[status])
    with pytest.raises(jobspec.TemplateError, match=match):
        launcher.read_template(api, "kubeflow")


def test_read_runtime_cluster_scoped():
    api = FakeApi()
    with pytest.raises(jobspec.TemplateError, match="ClusterTrainingRuntime 'chunkgrpo-torch' not found"):
        launcher.read_runtime(api)
    api.cluster_status = 403
    with pytest.raises(jobspec.TemplateError, match="chunkgrpo-runtime-reader"):
        launcher.read_runtime(api)
    api.objects[("trainer.kubeflow.org", "v1alpha1", None, "clustertrainingruntimes", "chunkgrpo-torch")] = (
        prod_runtime()
    )
    assert launcher.read_runtime(api)["kind"] == "ClusterTrainingRuntime"


def test_owner_reference_is_the_runs_workflow():
    pod = {"metadata": {"name": "wf-abc-launch", "ownerReferences": [
        {"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow", "name": "train-and-evaluate-x7",
         "uid": "9c1d", "controller": True, "blockOwnerDeletion": True}]}}
    ref = launcher.owner_from_pod(lambda: pod)
    assert ref == {"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow", "name": "train-and-evaluate-x7",
                   "uid": "9c1d", "controller": False, "blockOwnerDeletion": False}
    assert launcher.owner_from_pod(lambda: {"metadata": {"name": "p"}}) is None


def test_cleanup_deletes_the_runs_active_jobs_only():
    """The exit handler after an evicted/SIGKILLed launcher: the run's still-running job goes, finished
    jobs and other runs' jobs stay; a kind whose CRD is not installed is skipped."""
    api = FakeApi()
    mine = job()
    launcher.submit_or_attach(api, mine)
    done = job(name=jobspec.job_name(RUN_ID, "train-old"))
    launcher.submit_or_attach(api, done)
    api.objects[next(k for k in api.objects if k[-1] == done["metadata"]["name"])]["status"] = cond(
        "Complete"
    )
    other_run = "0000-other"
    other = job(name=jobspec.job_name(other_run, "train"), run_id=other_run)
    launcher.submit_or_attach(api, other)
    api.missing_plurals = {"pytorchjobs"}
    deleted = launcher.cleanup_run(api, "kubeflow", RUN_ID)
    assert deleted == [f"TrainJob/{mine['metadata']['name']}"]
    names = {k[-1] for k in api.objects}
    assert names == {done["metadata"]["name"], other["metadata"]["name"]}
    assert ("list", "trainjobs", f"{jobspec.LABEL_RUN}={RUN_ID}") in api.calls
    assert launcher.cleanup_run(api, "kubeflow", RUN_ID, only_active=False) == [
        f"TrainJob/{done['metadata']['name']}"
    ]

"""launch_trainjob: python_func against the fake CustomObjectsApi of tests/pipeline/test_trainjob.py."""

import json
import types

import pytest

from chunkgrpo.k8s import jobspec, launcher, pytorchjob, trainjob
from components.launch_trainjob.component import launch_trainjob
from tests.pipeline.trainjob_fakes import (
    FakeApi,
    FakeCore,
    cond,
    effective_trainer_pod,
    event,
    pod,
    prod_runtime,
    prod_template,
)

POD = {"metadata": {"name": "launcher", "ownerReferences": [
    {"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow", "name": "wf", "uid": "u-1"}]}}


class FakeStore:
    def read_manifest(self, uri):
        return types.SimpleNamespace(sha256="e" * 64)

    def get_bytes(self, uri):
        if uri.endswith("train_summary.json"):
            return json.dumps({"chunk_sizes": [2, 3], "optimizer_steps": 2, "config_hash": "c",
                               "history": [{"reward_mean": 0.4}]}).encode()
        return json.dumps({"kind": "lora"}).encode()


def _args(**kw):
    return {
        **dict(
            kind="TrainJob",
            namespace="kubeflow",
            image="img:1",
            num_nodes=2,
            nproc_per_node=8,
            gpus_per_node=0,
            node_selector={},
            tolerations=[],
            shm_size="",
            model="s3://bkt/models/flux",
            prompts="s3://bkt/p.txt",
            preset="chunk_grpo_flux",
            method="chunk",
            chunks="sizes:2,3",
            max_iterations=2,
            overrides=[],
            artifact_root="s3://bkt/runs",
            run_id="run-9",
            experiment="e",
            parent_run_id="",
            timeout_hours=1.0,
            queue_name="team-a",
            image_pull_secrets=["regcred"],
            reward_weights={"hpsv3": "s3://bkt/models/MizzenAI/HPSv3"},
        ),
        **kw,
    }


@pytest.fixture
def fake_cluster(monkeypatch):
    import chunkgrpo.store.client as store

    api = FakeApi(statuses=[cond("Complete")] * 5)
    api.core = FakeCore(pods=[pod("running")])
    monkeypatch.setattr(launcher, "load_api", lambda: api)
    monkeypatch.setattr(launcher, "load_core_api", lambda: api.core)
    oom = ["torch.OutOfMemoryError: CUDA out of memory"]
    monkeypatch.setattr(trainjob, "trainjob_log_tail", lambda obj, lines=40: oom)
    monkeypatch.setattr(launcher, "this_pod_getter", lambda ns: (lambda: POD))
    monkeypatch.setattr(store, "ArtifactStore", FakeStore)
    return api


def test_trainjob_keeps_runtime_resources_and_is_owned_by_the_run(fake_cluster, artifact):
    model, metrics = artifact("model.json"), artifact("metrics")
    launch_trainjob.python_func(trained_model=model, metrics=metrics, **_args())
    (obj,) = fake_cluster.objects.values()
    assert obj["kind"] == "TrainJob" and "resourcesPerNode" not in obj["spec"]["trainer"]
    assert obj["metadata"]["ownerReferences"][0]["name"] == "wf"
    assert obj["metadata"]["labels"][jobspec.LABEL_QUEUE] == "team-a" and obj["spec"]["suspend"] is True
    assert "rewards.0.options.weights=s3://bkt/models/MizzenAI/HPSv3" in obj["spec"]["trainer"]["args"]
    from tests import k8s_schemas

    k8s_schemas.check(
        {k: v for k, v in obj.items() if k != "status"}
    )  # status: written by the fake "controller"
    assert json.loads(open(model.path).read())["uri"] == "s3://bkt/runs/run-9/train/final"


def test_pytorchjob_needs_the_template(fake_cluster, artifact):
    with pytest.raises(jobspec.TemplateError, match="training-operator-v1"):
        launch_trainjob.python_func(
            trained_model=artifact("m.json"), metrics=artifact("x"), **_args(kind="PyTorchJob")
        )
    fake_cluster.objects[
        ("kubeflow.org", "v1", "kubeflow", "pytorchjobs", pytorchjob.PYTORCHJOB_TEMPLATE)
    ] = prod_template()
    fake_cluster.statuses = [cond("Succeeded")] * 5  # Training Operator v1 condition names
    launch_trainjob.python_func(
        trained_model=artifact("m.json"), metrics=artifact("x"), **_args(kind="PyTorchJob")
    )
    job = next(o for k, o in fake_cluster.objects.items() if k[-1] != pytorchjob.PYTORCHJOB_TEMPLATE)
    master = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert master["resources"]["limits"]["rdma/rdma_shared_device_a"] == 1


def test_a_podsecurity_rejection_ends_the_step_in_one_line_and_deletes_the_job(fake_cluster, artifact):
    """The RDMA runtime in a `restricted` profile namespace: the Job controller's FailedCreate event
    ends the step at the first poll (not the 48 h deadline) and the job is deleted."""
    fake_cluster.statuses = [{}] * 5  # TrainJob conditions say nothing: no pods exist
    fake_cluster.core = FakeCore(events=[{**event("podsecurity"), "involvedObject": {
        **event("podsecurity")["involvedObject"], "name": jobspec.job_name("run-9", "train") + "-node-0"}}])
    blocked = r"PodSecurity \"restricted\".*IPC_LOCK.*fix:.*\(job deleted\)"
    with pytest.raises(jobspec.JobBlockedError, match=blocked):
        launch_trainjob.python_func(trained_model=artifact("m.json"), metrics=artifact("x"),
                                    **_args(queue_name="", timeout_hours=48.0))
    assert not fake_cluster.objects and any(c[0] == "delete" for c in fake_cluster.calls)
    assert sum(c[0] == "get" for c in fake_cluster.calls) == 1


def test_keep_failed(fake_cluster, artifact, capsys):
    fake_cluster.statuses = [{}] * 5
    fake_cluster.core = FakeCore(pods=[pod("oom")])
    with pytest.raises(jobspec.JobBlockedError, match="OOMKilled.*job kept"):
        launch_trainjob.python_func(trained_model=artifact("m.json"), metrics=artifact("x"),
                                    **_args(queue_name="", keep_failed=True))
    assert len(fake_cluster.objects) == 1
    assert "  | torch.OutOfMemoryError: CUDA out of memory" in capsys.readouterr().out  # node 0's log tail


def test_extra_tolerations_keep_the_runtimes(fake_cluster, artifact):
    runtime = prod_runtime()
    key = ("trainer.kubeflow.org", "v1alpha1", None, "clustertrainingruntimes", "chunkgrpo-torch")
    fake_cluster.objects[key] = runtime
    extra = {"key": "team", "operator": "Equal", "value": "vision", "effect": "NoSchedule"}
    launch_trainjob.python_func(trained_model=artifact("m.json"), metrics=artifact("x"),
                                **_args(tolerations=[extra]))
    assert ("get-cluster", "chunkgrpo-torch") in fake_cluster.calls
    job = next(o for o in fake_cluster.objects.values() if o["kind"] == "TrainJob")
    tols = effective_trainer_pod(runtime, job)["spec"]["tolerations"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tols
    assert tols[-1] == extra


@pytest.mark.parametrize("workflow_spec,kept", [({}, True), ({"activeDeadlineSeconds": 0}, False)])
def test_sigterm_keeps_the_job_on_a_drain_and_deletes_it_on_a_cancelled_run(fake_cluster, artifact,
                                                                             workflow_spec, kept):
    """The step's SIGTERM: with the run's Workflow (this pod's owner) not cancelled, a drain, the TrainJob
    is left for the retry; with KFP's terminate patch on it, the TrainJob is deleted."""
    import os
    import signal
    import threading

    from tests.pipeline.trainjob_fakes import RUNNING_V2

    fake_cluster.statuses = [RUNNING_V2] * 50
    fake_cluster.objects[("argoproj.io", "v1alpha1", "kubeflow", "workflows", "wf")] = {
        "kind": "Workflow", "metadata": {"name": "wf"}, "spec": workflow_spec}
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        with pytest.raises(jobspec.JobCancelledError) as exc:
            launch_trainjob.python_func(trained_model=artifact("m.json"), metrics=artifact("x"), **_args())
    finally:
        timer.cancel()
    assert exc.value.code == 128 + signal.SIGTERM
    name = jobspec.job_name("run-9", "train")
    assert any(k[-1] == name for k in fake_cluster.objects) is kept
    assert any(c[:2] == ("delete", name) for c in fake_cluster.calls) is not kept

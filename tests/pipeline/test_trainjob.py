"""chunkgrpo.k8s.trainjob: TrainJob / PyTorchJob objects validated against manifests/crds schemas,
deterministic names, submit-or-attach, status streaming, failure reasons, cancellation.

No cluster exists here: the Kubernetes API is a FAKE (`FakeApi`, the CustomObjectsApi methods the
launcher uses, with 404/409 errors carrying `.status` like kubernetes.client.ApiException). These
tests prove the launcher's logic against that boundary, not the behaviour of a real Trainer.
"""

import copy
import json
import os
import signal
from pathlib import Path

import jsonschema
import pytest
import yaml

from chunkgrpo.k8s import trainjob as tj

REPO = Path(__file__).resolve().parents[2]
CRDS = REPO / "manifests" / "crds"
SCHEMAS = {"TrainJob": "trainer.kubeflow.org_v1alpha1_trainjob.schema.json",
           "PyTorchJob": "kubeflow.org_v1_pytorchjob.schema.json"}
RUN_ID = "3f9c2a7e-1b2c-4d5e-8f90-a1b2c3d4e5f6"


def validate(obj: dict) -> None:
    schema = json.loads((CRDS / SCHEMAS[obj["kind"]]).read_text())
    jsonschema.Draft202012Validator(schema).validate(obj)


def spec(**kw) -> tj.JobSpec:
    base = dict(name=tj.job_name(RUN_ID, "train"), namespace="kubeflow", image="ghcr.io/chunkgrpo/chunkgrpo-runtime:0.1.0",
                num_nodes=2, nproc_per_node=8, gpus_per_node=8, cpu="96", memory="960Gi",
                node_selector={"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
                tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                shm_size="128Gi", run_id=RUN_ID, env={"CHUNKGRPO_MLFLOW_PARENT_RUN_ID": "abc"},
                secret_env={"AWS_ACCESS_KEY_ID": ("chunkgrpo-s3", "AWS_ACCESS_KEY_ID"),
                            "AWS_SECRET_ACCESS_KEY": ("chunkgrpo-s3", "AWS_SECRET_ACCESS_KEY")},
                train_args=["--config", "chunk_grpo_flux", "max_steps=151", "chunks=sizes:2,3,4,7"],
                upload_final_to="s3://chunkgrpo-checkpoints/pipeline-runs/r/train/final",
                fetch={"/tmp/inputs/prompts.txt": "s3://chunkgrpo-data/prompts/train.txt"},
                active_deadline_seconds=172800)
    base.update(kw)
    return tj.JobSpec(**base)


# ------------------------------------------------------------------------------------------ names


def test_job_name_is_deterministic_dns1123_and_short():
    a, b = tj.job_name(RUN_ID, "train"), tj.job_name(RUN_ID, "train")
    assert a == b and a.startswith("cg-") and a.endswith("-train") and len(a) <= 40
    assert tj._DNS1123_LABEL.match(a)
    assert tj.job_name(RUN_ID, "train") != tj.job_name(RUN_ID + "x", "train") != tj.job_name(RUN_ID, "train-2")
    weird = tj.job_name("Run ID/with spaces" * 10, "Train Step #1 (8xH100) and a very long suffix")
    assert tj._DNS1123_LABEL.match(weird) and len(weird) <= 40
    with pytest.raises(ValueError):
        tj.job_name("", "train")


# --------------------------------------------------------------------------------------- builders


def test_trainjob_validates_and_carries_placement_shm_secrets_and_command():
    obj = tj.build_trainjob(spec())
    validate(obj)
    s = obj["spec"]
    assert s["runtimeRef"] == {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime",
                               "name": "chunkgrpo-torch"}
    tr = s["trainer"]
    assert tr["numNodes"] == 2 and tr["numProcPerNode"] == 8
    assert tr["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == 8
    assert {"name": "AWS_SECRET_ACCESS_KEY",
            "valueFrom": {"secretKeyRef": {"name": "chunkgrpo-s3", "key": "AWS_SECRET_ACCESS_KEY"}}} in tr["env"]
    script = tr["command"][2]
    assert tr["command"][:2] == ["/bin/sh", "-c"] and "torchrun -m chunkgrpo.train \"$@\"" in script
    assert "fetch s3://chunkgrpo-data/prompts/train.txt /tmp/inputs/prompts.txt" in script
    assert "upload-final /tmp/train/final s3://chunkgrpo-checkpoints" in script and "PET_NODE_RANK" in script
    assert tr["args"][:2] == ["--config", "chunk_grpo_flux"] and tr["args"][-1] == "output_dir=/tmp/train"
    (patch,) = s["runtimePatches"]
    assert patch["manager"] == tj.MANAGER
    (rj,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert rj["name"] == "node"
    pod = rj["template"]["spec"]["template"]
    assert pod["metadata"]["labels"][tj.LABEL_RUN] == RUN_ID
    assert pod["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert pod["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert pod["spec"]["volumes"] == [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "128Gi"}}]
    assert pod["spec"]["containers"] == [{"name": "node", "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}]}]
    assert s["activeDeadlineSeconds"] == 172800
    assert obj["metadata"]["annotations"][tj.SPEC_HASH]


def test_minimal_trainjob_is_plain_torchrun_and_matches_example_shape():
    obj = tj.build_trainjob(tj.JobSpec(name="cg-0123456789-train", image="img:1", shm_size=""))
    validate(obj)
    assert obj["spec"]["trainer"]["command"] == ["torchrun", "-m", "chunkgrpo.train"]
    example = yaml.safe_load((REPO / "manifests" / "examples" / "trainjob-h100.yaml").read_text())
    assert example["spec"]["runtimeRef"] == obj["spec"]["runtimeRef"]
    assert obj["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]["name"] \
        == example["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]["name"]


@pytest.mark.parametrize("nodes", [1, 3])
def test_pytorchjob_validates(nodes):
    obj = tj.build_pytorchjob(spec(num_nodes=nodes))
    validate(obj)
    reps = obj["spec"]["pytorchReplicaSpecs"]
    assert reps["Master"]["replicas"] == 1
    assert ("Worker" in reps) == (nodes > 1) and (nodes == 1 or reps["Worker"]["replicas"] == nodes - 1)
    assert obj["spec"]["nprocPerNode"] == "8" and obj["spec"]["runPolicy"]["suspend"] is False
    pod = reps["Master"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["name"] == "pytorch" and c["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "128Gi"}} in pod["volumes"]
    assert pod["nodeSelector"] and pod["tolerations"]


def test_pytorchjob_from_the_cluster_template_keeps_its_pod_spec():
    template = yaml.safe_load((REPO / "manifests/components/training-operator-v1/pytorchjob-template.yaml").read_text())
    obj = tj.build_pytorchjob(spec(num_nodes=4), template=template)
    validate(obj)
    reps = obj["spec"]["pytorchReplicaSpecs"]
    assert reps["Worker"]["replicas"] == 3 and obj["spec"]["runPolicy"]["suspend"] is False
    c = reps["Worker"]["template"]["spec"]["containers"][0]
    assert c["image"] == spec().image and c["args"][-1] == "output_dir=/tmp/train"
    names = [e["name"] for e in c["env"]]
    assert "HF_HOME" in names and names.count("AWS_ACCESS_KEY_ID") == 1  # template env kept, ours replaces dupes
    assert template["spec"]["runPolicy"]["suspend"] is True  # input not mutated


@pytest.mark.parametrize("kw", [dict(name="Bad_Name"), dict(nproc_per_node=16), dict(upload_final_to="/local"),
                                dict(num_nodes=0)])
def test_invalid_specs_are_rejected(kw):
    with pytest.raises(ValueError):
        spec(**kw)


def test_schema_would_reject_a_stale_trainer_field():
    obj = tj.build_trainjob(spec())
    obj["spec"]["podSpecOverrides"] = []  # Trainer 2.0 field: gone since 2.2
    with pytest.raises(jsonschema.ValidationError):
        validate(obj)


# ---------------------------------------------------------------------------------- fake API


class ApiError(Exception):
    def __init__(self, status: int, reason: str = ""):
        super().__init__(f"({status}) {reason}")
        self.status = status


class FakeApi:
    """CustomObjectsApi stand-in: an in-memory object store plus a script of status updates."""

    def __init__(self, statuses: list[dict] | None = None, get_errors: list[int] | None = None):
        self.objects: dict[tuple, dict] = {}
        self.calls: list[tuple] = []
        self.statuses = list(statuses or [])
        self.get_errors = list(get_errors or [])

    def _key(self, group, version, ns, plural, name):
        return (group, version, ns, plural, name)

    def create_namespaced_custom_object(self, group, version, namespace, plural, body):
        self.calls.append(("create", body["metadata"]["name"]))
        key = self._key(group, version, namespace, plural, body["metadata"]["name"])
        if key in self.objects:
            raise ApiError(409, "AlreadyExists")
        self.objects[key] = copy.deepcopy(body)
        return copy.deepcopy(body)

    def get_namespaced_custom_object(self, group, version, namespace, plural, name):
        self.calls.append(("get", name))
        if self.get_errors:
            raise ApiError(self.get_errors.pop(0), "flaky")
        key = self._key(group, version, namespace, plural, name)
        if key not in self.objects:
            raise ApiError(404, "NotFound")
        if self.statuses:
            self.objects[key]["status"] = self.statuses.pop(0)
        return copy.deepcopy(self.objects[key])

    def delete_namespaced_custom_object(self, group, version, namespace, plural, name, **kwargs):
        self.calls.append(("delete", name, kwargs.get("propagation_policy")))
        key = self._key(group, version, namespace, plural, name)
        if key not in self.objects:
            raise ApiError(404, "NotFound")
        del self.objects[key]


def cond(t, reason="", message=""):
    return {"conditions": [{"type": t, "status": "True", "reason": reason, "message": message}]}


RUNNING_V2 = {"jobsStatus": [{"name": "node", "active": 2}]}
NO_SLEEP = dict(sleep=lambda s: None)


def test_submit_then_retry_reattaches_instead_of_duplicating():
    api = FakeApi()
    obj = tj.build_trainjob(spec())
    first, attached = tj.submit_or_attach(api, obj)
    assert not attached
    again, attached = tj.submit_or_attach(api, tj.build_trainjob(spec()))  # a retried launcher: same name
    assert attached and again["metadata"]["name"] == obj["metadata"]["name"]
    assert len(api.objects) == 1 and [c[0] for c in api.calls] == ["create", "create", "get"]


def test_attach_refuses_a_job_with_another_spec():
    api = FakeApi()
    tj.submit_or_attach(api, tj.build_trainjob(spec()))
    with pytest.raises(tj.JobFailedError, match="different spec"):
        tj.submit_or_attach(api, tj.build_trainjob(spec(train_args=["--config", "dance_grpo_flux"])))


def test_attach_to_a_failed_job_recreates_it():
    api = FakeApi()
    obj = tj.build_trainjob(spec())
    tj.submit_or_attach(api, obj)
    api.statuses = [cond("Failed", "BackoffLimitExceeded")]
    cur, attached = tj.submit_or_attach(api, obj, **NO_SLEEP)
    assert not attached and ("delete", obj["metadata"]["name"], "Background") in api.calls
    assert len(api.objects) == 1 and "status" not in next(iter(api.objects.values()))


def test_wait_streams_status_changes_and_returns_on_success():
    api = FakeApi(statuses=[{}, RUNNING_V2, RUNNING_V2, cond("Complete", "JobSetCompleted", "done")],
                  get_errors=[])
    obj = tj.build_trainjob(spec())
    tj.submit_or_attach(api, obj)
    seen = []
    final = tj.wait(api, obj, timeout_s=60, on_status=seen.append, **NO_SLEEP)
    assert tj.job_state(final)[0] == "Succeeded"
    assert [s.split(": ", 1)[1] for s in seen] == ["Pending", "Running", "Succeeded (JobSetCompleted): done"]


def test_wait_survives_transient_api_errors():
    api = FakeApi(statuses=[RUNNING_V2, cond("Complete")])
    obj = tj.build_trainjob(spec())
    tj.submit_or_attach(api, obj)
    api.get_errors = [503, 500]
    assert tj.job_state(tj.wait(api, obj, timeout_s=60, **NO_SLEEP))[0] == "Succeeded"


def test_failure_reason_surfaces():
    api = FakeApi(statuses=[RUNNING_V2, cond("Failed", "DeadlineExceeded", "TrainJob exceeded activeDeadlineSeconds")])
    obj = tj.build_trainjob(spec())
    tj.submit_or_attach(api, obj)
    with pytest.raises(tj.JobFailedError, match="DeadlineExceeded: TrainJob exceeded activeDeadlineSeconds"):
        tj.wait(api, obj, timeout_s=60, **NO_SLEEP)


def test_pytorchjob_conditions():
    api = FakeApi(statuses=[cond("Created"), cond("Running"), cond("Failed", "PyTorchJobFailed", "pod OOMKilled")])
    obj = tj.build_pytorchjob(spec())
    tj.submit_or_attach(api, obj)
    seen = []
    with pytest.raises(tj.JobFailedError, match="PyTorchJobFailed: pod OOMKilled"):
        tj.wait(api, obj, timeout_s=60, on_status=seen.append, **NO_SLEEP)
    assert [s.split(": ")[1].split(" ")[0] for s in seen] == ["Pending", "Running", "Failed"]


def test_timeout():
    clock = iter(range(0, 10_000, 100))
    api = FakeApi(statuses=[RUNNING_V2] * 100)
    obj = tj.build_trainjob(spec())
    tj.submit_or_attach(api, obj)
    with pytest.raises(TimeoutError):
        tj.wait(api, obj, timeout_s=250, clock=lambda: next(clock), **NO_SLEEP)


def test_deleted_outside_fails_the_wait():
    api = FakeApi()
    obj = tj.build_trainjob(spec())
    tj.submit_or_attach(api, obj)
    api.objects.clear()
    with pytest.raises(tj.JobFailedError, match="disappeared"):
        tj.wait(api, obj, timeout_s=60, **NO_SLEEP)


def test_cancellation_sigterm_deletes_the_job():
    """What KFP does on run cancellation: SIGTERM to the launcher step while it waits."""
    api = FakeApi(statuses=[RUNNING_V2] * 100)
    obj = tj.build_trainjob(spec())
    polls = []

    def sleep(_):
        polls.append(1)
        if len(polls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(tj.JobCancelledError) as exc:
        tj.launch(api, obj, timeout_s=3600, sleep=sleep)
    assert exc.value.code == 128 + signal.SIGTERM
    assert ("delete", obj["metadata"]["name"], "Background") in api.calls and not api.objects
    assert signal.getsignal(signal.SIGTERM) is before  # handler restored


def test_launch_success_leaves_the_job_and_restores_handlers():
    api = FakeApi(statuses=[RUNNING_V2, cond("Complete")])
    obj = tj.build_trainjob(spec())
    before = signal.getsignal(signal.SIGTERM)
    final = tj.launch(api, obj, timeout_s=60, **NO_SLEEP)
    assert tj.job_state(final)[0] == "Succeeded" and len(api.objects) == 1
    assert signal.getsignal(signal.SIGTERM) is before


def test_delete_is_idempotent():
    api = FakeApi()
    obj = tj.build_trainjob(spec())
    tj.submit_or_attach(api, obj)
    assert tj.delete(api, obj) is True and tj.delete(api, obj) is False


def test_library_module_has_no_kfp_and_lazy_kubernetes_imports():
    src = Path(tj.__file__).read_text()
    assert "import kfp" not in src and "from kfp" not in src
    top_level = [line for line in src.splitlines() if line.startswith(("import ", "from "))]
    assert not any("kubernetes" in line for line in top_level)

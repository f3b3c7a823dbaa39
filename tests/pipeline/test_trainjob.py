"""chunkgrpo.k8s (jobspec, trainjob, pytorchjob, launcher): TrainJob / PyTorchJob objects validated
against the vendored upstream API schemas + CEL rules (tests/k8s_schemas.py: Trainer v2.2/v2.3,
Training Operator v1.9.4), resources merged with the runtime's (RDMA, memory, /dev/shm survive),
deterministic names, submit-or-attach, status streaming, failure reasons, cancellation, orphan cleanup.

No cluster exists here: the Kubernetes API is a FAKE (`FakeApi`, the CustomObjectsApi methods the
launcher uses, with 404/409 errors carrying `.status` like kubernetes.client.ApiException). These
tests prove the launcher's logic against that boundary, not the behaviour of a real Trainer.
"""

import copy
import os
import signal
from pathlib import Path

import pytest
import yaml

from chunkgrpo.k8s import jobspec, launcher, pytorchjob, trainjob
from tests import k8s_schemas

REPO = Path(__file__).resolve().parents[2]
RUN_ID = "3f9c2a7e-1b2c-4d5e-8f90-a1b2c3d4e5f6"


def validate(obj: dict) -> None:
    """Admitted by every supported upstream release (Trainer v2.2 + v2.3, Training Operator v1.9.4)."""
    k8s_schemas.check(obj)


def rendered(variant: str, kind: str, name: str) -> dict:
    from tests.manifests.test_manifests import find, render

    return find(render(variant), kind, name)


def prod_runtime() -> dict:
    return rendered("prod-h100", "ClusterTrainingRuntime", "chunkgrpo-torch")


def prod_template() -> dict:
    from tests.manifests.test_manifests import COMPOSED

    return rendered(COMPOSED, "PyTorchJob", "chunkgrpo-torch-template")


def spec(**kw) -> jobspec.JobSpec:
    base = dict(
        name=jobspec.job_name(RUN_ID, "train"),
        namespace="kubeflow",
        image="ghcr.io/chunkgrpo/chunkgrpo-runtime:0.1.0",
        num_nodes=2,
        nproc_per_node=8,
        gpus_per_node=8,
        cpu="96",
        memory="960Gi",
        node_selector={"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        tolerations=[],  # the runtime's GPU toleration stays; extra ones need the runtime (merged)
        shm_size="",
        run_id=RUN_ID,
        env={"CHUNKGRPO_MLFLOW_PARENT_RUN_ID": "abc"},
        secret_env={
            "AWS_ACCESS_KEY_ID": ("chunkgrpo-s3", "AWS_ACCESS_KEY_ID"),
            "AWS_SECRET_ACCESS_KEY": ("chunkgrpo-s3", "AWS_SECRET_ACCESS_KEY"),
        },
        train_args=["--config", "chunk_grpo_flux", "max_iterations=151", "chunks=sizes:2,3,4,7"],
        upload_final_to="s3://chunkgrpo-checkpoints/pipeline-runs/r/train/final",
        fetch={"/tmp/inputs/prompts.txt": "s3://chunkgrpo-data/prompts/train.txt"},
        active_deadline_seconds=172800,
    )
    base.update(kw)
    return jobspec.JobSpec(**base)


# ------------------------------------------------------------------------------------------ names


def test_job_name_is_deterministic_dns1123_and_short():
    a, b = jobspec.job_name(RUN_ID, "train"), jobspec.job_name(RUN_ID, "train")
    assert a == b and a.startswith("cg-") and a.endswith("-train") and len(a) <= 40
    assert jobspec._DNS1123_LABEL.match(a)
    assert (
        jobspec.job_name(RUN_ID, "train")
        != jobspec.job_name(RUN_ID + "x", "train")
        != jobspec.job_name(RUN_ID, "train-2")
    )
    weird = jobspec.job_name("Run ID/with spaces" * 10, "Train Step #1 (8xH100) and a very long suffix")
    assert jobspec._DNS1123_LABEL.match(weird) and len(weird) <= 40
    with pytest.raises(ValueError):
        jobspec.job_name("", "train")


# --------------------------------------------------------------------------------------- builders


def strategic_merge(base, patch, list_keys):
    """Kubernetes strategic merge patch for the fields of a pod template this project patches -- the
    semantics Trainer v2.2/v2.3 apply to runtimePatches (`strategicpatch.StrategicMergePatch` over the
    replicated job's template, pkg/runtime/core/trainingruntime.go `mergeRuntimePatches`): maps merge
    recursively; lists with a patch merge key (k8s.io/api core/v1 `patchMergeKey`) merge item by item;
    every other list -- `tolerations` is `+listType=atomic` with no patch strategy -- is REPLACED."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            if isinstance(v, list) and k in list_keys and isinstance(base.get(k), list):
                key = list_keys[k]
                merged = {item[key]: item for item in base[k]}
                order = [item[key] for item in base[k]]
                for item in v:
                    merged[item[key]] = strategic_merge(merged.get(item[key], {}), item, list_keys)
                    if item[key] not in order:
                        order.append(item[key])
                out[k] = [merged[n] for n in order]
            else:
                out[k] = strategic_merge(base.get(k), v, list_keys) if k in base else v
        return out
    return patch


# core/v1 PodSpec/Container lists with a patch merge key; everything else (tolerations) is atomic
MERGE_KEYS = {"containers": "name", "initContainers": "name", "volumes": "name", "imagePullSecrets": "name",
              "env": "name", "volumeMounts": "mountPath"}


def effective_trainer_pod(runtime: dict, job: dict) -> dict:
    """What Trainer v2.2/v2.3 make of runtime + TrainJob for the `node` pods: container resources
    REPLACED by trainer.resourcesPerNode when set, then each runtimePatch strategic-merged in."""
    pod = copy.deepcopy(next(rj for rj in runtime["spec"]["template"]["spec"]["replicatedJobs"]
                             if rj["name"] == "node")["template"]["spec"]["template"])
    c = next(c for c in pod["spec"]["containers"] if c["name"] == "node")
    if "resourcesPerNode" in job["spec"]["trainer"]:
        c["resources"] = job["spec"]["trainer"]["resourcesPerNode"]
    for patch in job["spec"].get("runtimePatches", []):
        for rj in patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]:
            pod = strategic_merge(pod, rj["template"]["spec"]["template"], MERGE_KEYS)
    return pod


def _vol(pod: dict, name: str) -> dict:
    return next(v for v in pod["spec"]["volumes"] if v["name"] == name)


def test_trainjob_validates_and_carries_placement_secrets_and_command():
    obj = trainjob.build_trainjob(spec(gpus_per_node=0, cpu="", memory=""))
    validate(obj)
    assert k8s_schemas.validate(obj, "2.1.0"), (
        "runtimePatches/activeDeadlineSeconds do not exist in Trainer v2.1"
    )
    s = obj["spec"]
    assert s["runtimeRef"] == {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime",
                               "name": "chunkgrpo-torch"}
    tr = s["trainer"]
    assert tr["numNodes"] == 2 and tr["numProcPerNode"] == 8
    assert "resourcesPerNode" not in tr  # the runtime's resources (GPUs, RDMA, memory) stay untouched
    assert {
        "name": "AWS_SECRET_ACCESS_KEY",
        "valueFrom": {"secretKeyRef": {"name": "chunkgrpo-s3", "key": "AWS_SECRET_ACCESS_KEY"}},
    } in tr["env"]
    script = tr["command"][2]
    assert tr["command"][:2] == ["/bin/sh", "-c"] and "torchrun -m chunkgrpo.train \"$@\"" in script
    assert "fetch s3://chunkgrpo-data/prompts/train.txt /tmp/inputs/prompts.txt" in script
    assert (
        "upload-final /cache/train/final s3://chunkgrpo-checkpoints" in script and "PET_NODE_RANK" in script
    )
    assert tr["args"][:2] == ["--config", "chunk_grpo_flux"] and tr["args"][-1] == "output_dir=/cache/train"
    (patch,) = s["runtimePatches"]
    assert patch["manager"] == trainjob.MANAGER
    (rj,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert rj["name"] == "node"
    pod = rj["template"]["spec"]["template"]
    assert pod["metadata"]["labels"][jobspec.LABEL_RUN] == RUN_ID
    assert pod["metadata"]["annotations"]["sidecar.istio.io/inject"] == "false"
    assert pod["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert "tolerations" not in pod["spec"], "the runtime's stay (a patch's list would replace them)"
    assert "volumes" not in pod["spec"], "no shm override by default: the runtime's /dev/shm stays"
    assert s["activeDeadlineSeconds"] == 172800
    assert obj["metadata"]["annotations"][jobspec.SPEC_HASH]


def test_default_trainjob_keeps_the_prod_runtimes_rdma_memory_and_shm():
    runtime = prod_runtime()
    job = trainjob.build_trainjob(spec(gpus_per_node=0, cpu="", memory=""))
    pod = effective_trainer_pod(runtime, job)
    res = pod["spec"]["containers"][0]["resources"]
    assert res["limits"]["nvidia.com/gpu"] == 8 and res["limits"]["rdma/rdma_shared_device_a"] == 1
    assert jobspec.quantity(res["requests"]["memory"]) == jobspec.quantity("960Gi")
    assert _vol(pod, "dshm")["emptyDir"] == {"medium": "Memory", "sizeLimit": "128Gi"}
    assert pod["metadata"]["annotations"]["sidecar.istio.io/inject"] == "false"


def test_resource_overrides_are_merged_into_the_runtimes():
    """Trainer v2.2 replaces container resources wholesale from resourcesPerNode: the job must carry
    the runtime's RDMA device, memory and ephemeral storage along with its override."""
    runtime = prod_runtime()
    job = trainjob.build_trainjob(spec(gpus_per_node=4, cpu="", memory="", nproc_per_node=4), runtime)
    validate(job)
    res = job["spec"]["trainer"]["resourcesPerNode"]
    for bound in ("requests", "limits"):
        assert res[bound]["nvidia.com/gpu"] == 4
        assert res[bound]["rdma/rdma_shared_device_a"] == 1
        assert res[bound]["ephemeral-storage"]
    assert jobspec.quantity(res["limits"]["memory"]) == jobspec.quantity("1200Gi")
    pod = effective_trainer_pod(runtime, job)
    assert pod["spec"]["containers"][0]["resources"]["limits"]["rdma/rdma_shared_device_a"] == 1
    with pytest.raises(ValueError, match="runtime"):
        trainjob.build_trainjob(spec(gpus_per_node=8))  # an override without the runtime would drop RDMA


def test_merge_resources_keeps_unnamed_keys_and_raises_limits_to_requests():
    base = {
        "requests": {"cpu": "96", "memory": "960Gi", "rdma/x": 1},
        "limits": {"cpu": "160", "memory": "1200Gi", "rdma/x": 1},
    }
    out = jobspec.merge_resources(
        base, {"requests": {"cpu": "200", "nvidia.com/gpu": 2}, "limits": {"nvidia.com/gpu": 2}}
    )
    assert out["requests"] == {"cpu": "200", "memory": "960Gi", "rdma/x": 1, "nvidia.com/gpu": 2}
    assert out["limits"]["cpu"] == "200" and out["limits"]["rdma/x"] == 1  # limit raised to the new request
    assert base["requests"]["cpu"] == "96"  # input untouched
    with pytest.raises(ValueError):
        jobspec.quantity("lots")


def test_explicit_shm_is_a_runtime_patch():
    job = trainjob.build_trainjob(spec(gpus_per_node=0, cpu="", memory="", shm_size="256Gi"))
    validate(job)
    pod = effective_trainer_pod(prod_runtime(), job)
    assert _vol(pod, "dshm")["emptyDir"]["sizeLimit"] == "256Gi"


def test_kueue_queue_pull_secrets_and_owner():
    owner = {"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow", "name": "wf", "uid": "u-1",
             "controller": False, "blockOwnerDeletion": False}
    job = trainjob.build_trainjob(spec(gpus_per_node=0, cpu="", memory="", queue_name="gpu-team-a",
                                 image_pull_secrets=["regcred"], owner=owner))
    validate(job)
    assert job["metadata"]["labels"][jobspec.LABEL_QUEUE] == "gpu-team-a" and job["spec"]["suspend"] is True
    assert job["metadata"]["ownerReferences"] == [owner]
    pod = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    assert pod["template"]["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    pj = pytorchjob.build_pytorchjob(
        spec(queue_name="gpu-team-a", image_pull_secrets=["regcred"], owner=owner), prod_template()
    )
    validate(pj)
    assert (
        pj["spec"]["runPolicy"]["suspend"] is True
        and pj["metadata"]["labels"][jobspec.LABEL_QUEUE] == "gpu-team-a"
    )
    assert {"name": "regcred"} in pj["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"][
        "imagePullSecrets"
    ]


def test_minimal_trainjob_is_plain_torchrun_and_matches_example_shape():
    obj = trainjob.build_trainjob(jobspec.JobSpec(name="cg-0123456789-train", image="img:1"))
    validate(obj)
    assert obj["spec"]["trainer"]["command"] == ["torchrun", "-m", "chunkgrpo.train"]
    example = yaml.safe_load((REPO / "manifests" / "examples" / "trainjob-h100.yaml").read_text())
    validate(example)
    assert example["spec"]["runtimeRef"] == obj["spec"]["runtimeRef"]
    assert (
        obj["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0][
            "name"
        ]
        == example["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][
            0
        ]["name"]
    )


@pytest.mark.parametrize("nodes", [1, 3])
def test_pytorchjob_from_the_template_merges_resources(nodes):
    template = prod_template()
    obj = pytorchjob.build_pytorchjob(spec(num_nodes=nodes, gpus_per_node=8, cpu="", memory=""), template)
    validate(obj)
    reps = obj["spec"]["pytorchReplicaSpecs"]
    assert reps["Master"]["replicas"] == 1
    assert ("Worker" in reps) == (nodes > 1) and (nodes == 1 or reps["Worker"]["replicas"] == nodes - 1)
    assert obj["spec"]["nprocPerNode"] == "8" and obj["spec"]["runPolicy"]["suspend"] is False
    for rs in reps.values():
        pod = rs["template"]["spec"]
        (c,) = pod["containers"]
        assert (
            c["name"] == "pytorch"
            and c["image"] == spec().image
            and c["args"][-1] == "output_dir=/cache/train"
        )
        lim = c["resources"]["limits"]
        assert lim["nvidia.com/gpu"] == 8 and lim["rdma/rdma_shared_device_a"] == 1  # RDMA survives
        assert jobspec.quantity(lim["memory"]) == jobspec.quantity("1200Gi")
        assert c["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        assert _vol(rs["template"], "dshm")["emptyDir"]["sizeLimit"] == "128Gi"  # the overlay's, not 64Gi
        assert rs["template"]["metadata"]["annotations"]["sidecar.istio.io/inject"] == "false"
        names = [e["name"] for e in c["env"]]
        assert (
            "HF_HOME" in names and names.count("AWS_ACCESS_KEY_ID") == 1
        )  # template env kept, ours replaces dupes
    assert template["spec"]["runPolicy"]["suspend"] is True  # input not mutated


def test_pytorchjob_needs_its_template():
    with pytest.raises(jobspec.TemplateError, match="training-operator-v1"):
        pytorchjob.build_pytorchjob(spec(), None)


@pytest.mark.parametrize("kw", [dict(name="Bad_Name"), dict(nproc_per_node=16),
                                dict(upload_final_to="/local"), dict(num_nodes=0)])
def test_invalid_specs_are_rejected(kw):
    with pytest.raises(ValueError):
        spec(**kw)


def test_schemas_reject_stale_and_unknown_fields():
    obj = trainjob.build_trainjob(spec(gpus_per_node=0, cpu="", memory=""))
    for field in ("podSpecOverrides", "podTemplateOverrides"):  # Trainer 2.0 / 2.1 fields, gone since 2.2
        bad = copy.deepcopy(obj)
        bad["spec"][field] = []
        assert all(k8s_schemas.validate(bad, v) for v in k8s_schemas.SUPPORTED_TRAINER), field
    bad = copy.deepcopy(obj)
    bad["spec"]["trainer"]["numProcPerNode"] = "auto"  # int only since 2.2
    assert k8s_schemas.validate(bad, "2.3.0")
    bad = copy.deepcopy(obj)
    bad["metadata"]["name"] = "x" * 64  # CEL: RFC 1035 label <= 63
    assert any("63" in e for e in k8s_schemas.validate(bad, "2.3.0"))


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
        self.missing_plurals: set[str] = set()
        self.cluster_status = 404
        self.spec_fields: set[str] | None = None  # the CRD's TrainJob spec fields (None = any)
        self.field_validation: list[str | None] = []

    def _key(self, group, version, ns, plural, name):
        return (group, version, ns, plural, name)

    def create_namespaced_custom_object(self, group, version, namespace, plural, body, field_validation=None):
        self.calls.append(("create", body["metadata"]["name"]))
        self.field_validation.append(field_validation)
        unknown = sorted(set(body.get("spec", {})) - self.spec_fields) if self.spec_fields is not None else []
        if unknown and field_validation == "Strict":  # the API server's strict decoding error (HTTP 400)
            err = ApiError(400, "BadRequest")
            err.body = ('{"kind":"Status","status":"Failure","message":"TrainJob in version \\"v1alpha1\\" '
                        'cannot be handled as a TrainJob: strict decoding error: '
                        + ", ".join(f'unknown field \\"spec.{f}\\"' for f in unknown) + '","code":400}')
            raise err
        for f in unknown:  # without Strict the field is pruned silently
            body = {**body, "spec": {k: v for k, v in body["spec"].items() if k != f}}
        key = self._key(group, version, namespace, plural, body["metadata"]["name"])
        if key in self.objects:
            raise ApiError(409, "AlreadyExists")
        self.objects[key] = copy.deepcopy(body)
        return copy.deepcopy(body)

    def get_namespaced_custom_object(self, group, version, namespace, plural, name, _request_timeout=None):
        self.calls.append(("get", name))
        if self.get_errors:
            raise ApiError(self.get_errors.pop(0), "flaky")
        key = self._key(group, version, namespace, plural, name)
        if key not in self.objects:
            raise ApiError(404, "NotFound")
        if self.statuses:
            self.objects[key]["status"] = self.statuses.pop(0)
        return copy.deepcopy(self.objects[key])

    def list_namespaced_custom_object(self, group, version, namespace, plural, label_selector=""):
        self.calls.append(("list", plural, label_selector))
        if plural in self.missing_plurals:
            raise ApiError(404, "the server could not find the requested resource")
        key, _, value = label_selector.partition("=")
        items = [copy.deepcopy(o) for (g, v, ns, p, _), o in self.objects.items()
                 if (g, v, ns, p) == (group, version, namespace, plural)
                 and o["metadata"].get("labels", {}).get(key) == value]
        return {"items": items}

    def get_cluster_custom_object(self, group, version, plural, name):
        self.calls.append(("get-cluster", name))
        key = self._key(group, version, None, plural, name)
        if key not in self.objects:
            raise ApiError(self.cluster_status, "NotFound")
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


def job(**kw) -> dict:
    """A TrainJob that keeps the runtime's resources (what the pipeline's launcher builds)."""
    return trainjob.build_trainjob(spec(**{"gpus_per_node": 0, "cpu": "", "memory": "", **kw}))


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

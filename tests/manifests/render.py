"""The manifests as the tests see them: every overlay rendered with the venv's `kubectl kustomize`, the
helpers that find objects and pod templates in the rendered documents, the policy checker that runs over
everything that creates pods (images by digest, no literal secrets, GPU pods pinned to their pool) and the
restricted Pod Security Standard's checks."""

from __future__ import annotations

import atexit
import copy
import functools
import re
import shutil
import subprocess
import sys
from pathlib import Path

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


def need_tool(tool: Path) -> Path:
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
        [str(need_tool(KUBECTL)), "kustomize", str(variant_dir(variant))],
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


def mlflow_container(docs):
    return find(docs, "Deployment", "mlflow")["spec"]["template"]["spec"]["containers"][0]


def trainer_spec(docs):
    rt = find(docs, "ClusterTrainingRuntime", "chunkgrpo-torch")
    return rt["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
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

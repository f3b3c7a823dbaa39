"""The opt-in reward server (manifests/components/reward-server) in a production overlay with the pipeline
namespace moved: valid Kubernetes objects, the platform's pod policy, restricted Pod Security, probes on
the server's /readyz and /healthz, its token from a Secret, and ingress only from the pipeline namespace."""

from __future__ import annotations

import atexit
import shutil
import subprocess
import tempfile
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.manifests.render import (
    K8S_VERSION,
    KUBECTL,
    MANIFESTS,
    SERVICES_NS,
    find,
    need_tool,
    pod_templates,
    policy_violations,
    restricted_violations,
)

NAME = "chunkgrpo-reward-server"
OVERLAY = """\
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - ../../base
  - ../../base/pipeline
  - platform.yaml
components:
  - ../../components/gpu-h800
  - ../../components/production
  - ../../components/reward-server
  - ../../components/pinned-images
  - ../../components/pipeline-namespace
"""


@pytest.fixture(scope="module")
def docs() -> list[dict]:
    root = Path(tempfile.mkdtemp(prefix="chunkgrpo-reward-manifests-"))
    atexit.register(shutil.rmtree, root, True)
    shutil.copytree(MANIFESTS, root / "manifests")
    overlay = root / "manifests" / "overlays" / "reward-server"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(OVERLAY)
    platform = (MANIFESTS / "overlays" / "dev" / "platform.yaml").read_text()
    (overlay / "platform.yaml").write_text(platform.replace("pipelineNamespace: kubeflow",
                                                            "pipelineNamespace: team-a"))
    out = subprocess.run([str(need_tool(KUBECTL)), "kustomize", str(overlay)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _container(docs) -> tuple[dict, dict]:
    dep = find(docs, "Deployment", NAME)
    (_, template), = pod_templates(dep)
    return template["spec"], template["spec"]["containers"][0]


def test_objects_validate_and_pass_the_platform_policy(docs):
    ours = [d for d in docs if d["metadata"]["name"] == NAME]
    assert sorted(d["kind"] for d in ours) == ["Deployment", "NetworkPolicy", "Service", "ServiceAccount"]
    for d in ours:
        assert d["metadata"]["namespace"] == SERVICES_NS
        assert d["metadata"]["labels"]["app.kubernetes.io/part-of"] == "chunkgrpo"
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)
    assert policy_violations(ours) == []
    spec, _ = _container(docs)
    assert restricted_violations(spec) == []  # the services namespace enforces `restricted`


def test_one_gpu_on_the_pool_non_root_read_only(docs):
    spec, c = _container(docs)
    assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H800"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 == c["resources"]["requests"]["nvidia.com/gpu"]
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] != 0
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"]
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    env = {e["name"]: e for e in c["env"]}
    for path in ("/tmp", env["CHUNKGRPO_CACHE"]["value"]):  # the only writable places: emptyDirs
        assert "emptyDir" in volumes[mounts[path]] and volumes[mounts[path]]["emptyDir"]["sizeLimit"], path
    assert c["image"].startswith("ghcr.io/chunkgrpo/chunkgrpo-runtime:")


def test_probes_port_and_command_match_the_server(docs):
    _, c = _container(docs)
    assert c["command"] == ["python", "-m", "chunkgrpo", "reward-server"]
    assert "--host=0.0.0.0" in c["args"] and "--port=8000" in c["args"] and "--scorer=hpsv3" in c["args"]
    assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    svc = find(docs, "Service", NAME)
    assert svc["spec"]["ports"][0]["port"] == 8000 and svc["spec"]["ports"][0]["targetPort"] == "http"
    assert svc["spec"]["selector"] == find(docs, "Deployment", NAME)["spec"]["selector"]["matchLabels"]


def test_the_token_comes_from_a_secret(docs):
    _, c = _container(docs)
    env = {e["name"]: e for e in c["env"]}
    assert env["CHUNKGRPO_REWARD_TOKEN"] == {
        "name": "CHUNKGRPO_REWARD_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "chunkgrpo-reward", "key": "CHUNKGRPO_REWARD_TOKEN"}}}
    assert "value" not in env["AWS_SECRET_ACCESS_KEY"]  # without a token the server would refuse 0.0.0.0


def test_ingress_only_from_the_pipeline_namespace(docs):
    np_ = find(docs, "NetworkPolicy", NAME)
    dep = find(docs, "Deployment", NAME)
    assert np_["spec"]["podSelector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    assert np_["spec"]["ingress"] == [{
        "from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "team-a"}}}],
        "ports": [{"protocol": "TCP", "port": 8000}]}]
    # MinIO admits the server (its weights), by its pod labels in the services namespace only
    minio = find(docs, "NetworkPolicy", "minio")
    assert {"from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": NAME}}}],
            "ports": [{"protocol": "TCP", "port": 9000}]} in minio["spec"]["ingress"]

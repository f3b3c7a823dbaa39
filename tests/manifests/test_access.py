"""Who may do what in the rendered manifests: the pipeline runner's RBAC covers every verb a run needs,
network policies, restricted pod security for multi-profile training pods, and the promoter's own Secret."""

from __future__ import annotations

import copy
import json

import pytest
import yaml

from tests import k8s_schemas
from tests.manifests.render import (
    COMPOSED,
    DEFAULT_PIPELINE_NS,
    MULTI,
    PROFILES,
    RDMA_RESOURCE,
    REPO,
    SERVICES_NS,
    VARIANTS,
    all_pods,
    find,
    pipeline_namespaces,
    pod_templates,
    render,
    restricted_violations,
)


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

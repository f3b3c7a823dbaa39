"""What the TrainJob tests share: objects rendered from the manifests and validated against the vendored
upstream API schemas (tests/k8s_schemas.py), a JobSpec with test defaults, the strategic merge a Trainer
applies to its runtime's pod, and a FAKE Kubernetes API (`FakeApi`: the CustomObjectsApi methods the
launcher uses, with 404/409 errors carrying `.status` like kubernetes.client.ApiException), the pods and
events of tests/fixtures/k8s/failfast.yaml and a fake CoreV1Api (`FakeCore`) whose event stream the real
`kubernetes.watch.Watch` reads (`FakeWatchResponse`). No cluster
exists here: tests on the fake prove the launcher's logic against that boundary, not a real Trainer's
behaviour."""

import copy
import json
from pathlib import Path

import yaml

from chunkgrpo.k8s import jobspec, trainjob
from tests import k8s_schemas

REPO = Path(__file__).resolve().parents[2]
RUN_ID = "3f9c2a7e-1b2c-4d5e-8f90-a1b2c3d4e5f6"


def validate(obj: dict) -> None:
    """Admitted by every supported upstream release (Trainer v2.2 + v2.3, Training Operator v1.9.4)."""
    k8s_schemas.check(obj)


def rendered(variant: str, kind: str, name: str) -> dict:
    from tests.manifests.render import find, render

    return find(render(variant), kind, name)


def prod_runtime() -> dict:
    return rendered("prod-h100", "ClusterTrainingRuntime", "chunkgrpo-torch")


def prod_template() -> dict:
    from tests.manifests.render import COMPOSED

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


def volume_named(pod: dict, name: str) -> dict:
    return next(v for v in pod["spec"]["volumes"] if v["name"] == name)

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


# ----------------------------------------------------------------------------- pods and events

FIX = yaml.safe_load((Path(__file__).resolve().parents[1] / "fixtures" / "k8s" / "failfast.yaml").read_text())


def pod(name):
    return copy.deepcopy(FIX["pods"][name])


def event(name):
    return copy.deepcopy(FIX["events"][name])


class FakeWatchResponse:
    """What `CoreV1Api.list_namespaced_event(..., watch=True, _preload_content=False)` returns."""

    def __init__(self, events):
        self.lines = [json.dumps({"type": "ADDED", "object": e}).encode() + b"\n" for e in events]
        self.closed = False

    def stream(self, amt=None, decode_content=False):
        yield from self.lines

    def close(self):
        self.closed = True

    def release_conn(self):
        pass


class FakeCore:
    """The CoreV1Api methods the probe uses; pods are returned as client model objects."""

    def __init__(self, pods=(), events=()):
        from kubernetes.client import ApiClient

        self.api_client = ApiClient()
        self.pods, self.events, self.calls = list(pods), list(events), []

    def list_namespaced_pod(self, namespace, label_selector=""):
        self.calls.append(("pods", namespace, label_selector))

        class Resp:
            data = json.dumps({"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": self.pods})

        return self.api_client.deserialize(Resp(), "V1PodList")

    def list_namespaced_event(self, namespace, **kwargs):
        """:return: CoreV1EventList"""  # kubernetes.watch reads the model name from here
        self.calls.append(("events", namespace, kwargs.get("watch"), kwargs.get("resource_version")))
        if kwargs.get("watch"):
            return FakeWatchResponse(self.events)

        class Resp:
            data = json.dumps({"apiVersion": "v1", "kind": "EventList",
                               "metadata": {"resourceVersion": "918400"}, "items": self.events})

        return self.api_client.deserialize(Resp(), "CoreV1EventList")

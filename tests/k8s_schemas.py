"""Validate Kubeflow objects against the vendored upstream API schemas (tests/fixtures/crds/).

    errors = k8s_schemas.validate(obj, "2.3.0")       # [] = the API server of Trainer v2.3.0 would admit it
    k8s_schemas.check(obj, *k8s_schemas.SUPPORTED_TRAINER)   # AssertionError listing every problem

Two layers, like the API server:
1. structure: the JSON Schema generated from the release's own API package (unknown fields are
   errors, as under `kubectl apply`'s default strict field validation; required fields; enums;
   int-or-string and quantities), see tests/fixtures/crds/README.md;
2. rules: the CRDs' CEL validations (`x-kubernetes-validations`) plus the OpenAPI bounds that the
   generated packages drop (minimum, maxItems, list-map keys), evaluated with cel-python on create
   (transition rules that compare with `oldSelf` only apply to updates and are skipped).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import jsonschema

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "crds"
TRAINER_VERSIONS = ("2.1.0", "2.2.0", "2.3.0")
SUPPORTED_TRAINER = ("2.2.0", "2.3.0")      # what chunkgrpo's TrainJobs and runtime are valid for
TRAINING_OPERATOR_VERSIONS = ("1.9.4",)
TRAINER_KINDS = ("TrainJob", "TrainingRuntime", "ClusterTrainingRuntime")

# Sources of the rules below (read in the upstream Go API types; Apache-2.0):
#   kubeflow/trainer pkg/apis/trainer/v1alpha1/trainjob_types.go @ 0015772c282d9e127c9a08330485ef84b4fb3840
#   kubeflow/trainer pkg/apis/trainer/v1alpha1/trainingruntime_types.go
#     @ 022656ac197e150e44e0f980301c627f04dbc410
TRAINJOB_SRC = "trainjob_types.go@0015772c"
RUNTIME_SRC = "trainingruntime_types.go@022656ac"


@dataclasses.dataclass(frozen=True)
class Rule:
    kinds: tuple[str, ...]
    path: str              # dotted path of `self`; '' = the object; a trailing [] = every list item
    rule: str              # CEL
    message: str
    source: str


_RUNTIMES = ("TrainingRuntime", "ClusterTrainingRuntime")
RULES = (
    Rule(
        ("TrainJob",),
        "",
        "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')",
        "metadata.name must match RFC 1035 DNS label format",
        TRAINJOB_SRC,
    ),
    Rule(
        ("TrainJob",),
        "",
        "size(self.metadata.name) <= 63",
        "metadata.name must be no more than 63 characters",
        TRAINJOB_SRC,
    ),
    Rule(
        ("TrainJob",),
        "spec.managedBy",
        "self in ['trainer.kubeflow.org/trainjob-controller', 'kueue.x-k8s.io/multikueue']",
        "ManagedBy must be trainer.kubeflow.org/trainjob-controller or kueue.x-k8s.io/multikueue if set",
        TRAINJOB_SRC,
    ),
    Rule(
        ("TrainJob",),
        "spec.activeDeadlineSeconds",
        "self >= 1",
        "activeDeadlineSeconds: Minimum=1",
        TRAINJOB_SRC,
    ),
    Rule(
        ("TrainJob",), "spec.runtimePatches", "size(self) <= 16", "runtimePatches: MaxItems=16", TRAINJOB_SRC
    ),
    Rule(
        ("TrainJob",),
        "spec.runtimePatches",
        "self.all(p, self.exists_one(q, q.manager == p.manager))",
        "runtimePatches is a list map keyed by manager (duplicate manager)",
        TRAINJOB_SRC,
    ),
    Rule(
        ("TrainJob",),
        "spec.runtimePatches[]",
        "size(self.manager) >= 1 && size(self.manager) <= 253",
        "manager: MinLength=1, MaxLength=253",
        TRAINJOB_SRC,
    ),
    Rule(
        ("TrainJob",),
        "spec.runtimePatches[].trainingRuntimeSpec.template.spec.replicatedJobs[]",
        "self.name.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?$')",
        "replicatedJobs[].name: Pattern",
        TRAINJOB_SRC,
    ),
    Rule(
        ("TrainJob",),
        "spec.runtimePatches[].trainingRuntimeSpec.template.spec.replicatedJobs[].template.spec.template.spec.containers[]",
        "!(self.name in ['node', 'dataset-initializer', 'model-initializer']) || !has(self.env)",
        "env of the node/initializer containers can only be set via the Trainer/Initializer APIs",
        TRAINJOB_SRC,
    ),
    Rule(
        ("TrainJob",),
        "spec.trainer.command",
        "size(self) <= 128",
        "trainer.command: MaxItems=128",
        TRAINJOB_SRC,
    ),
    Rule(("TrainJob",), "spec.trainer.args", "size(self) <= 128", "trainer.args: MaxItems=128", TRAINJOB_SRC),
    Rule(
        ("TrainJob",),
        "spec.trainer.env",
        "self.all(e, self.exists_one(f, f.name == e.name))",
        "trainer.env is a list map keyed by name (duplicate name)",
        TRAINJOB_SRC,
    ),
    Rule(
        ("TrainJob",), "spec.trainer.image", "size(self) <= 500", "trainer.image: MaxLength=500", TRAINJOB_SRC
    ),
    Rule(
        ("TrainJob",),
        "spec.runtimeRef.name",
        "size(self) >= 1 && size(self) <= 253",
        "runtimeRef.name: MinLength=1, MaxLength=253",
        TRAINJOB_SRC,
    ),
    Rule(
        _RUNTIMES,
        "spec.mlPolicy",
        "!(has(self.numNodes) && (has(self.torch) && has(self.torch.elasticPolicy)))",
        "numNodes should not be set if torch.elasticPolicy is configured",
        RUNTIME_SRC,
    ),
    Rule(
        _RUNTIMES,
        "spec.mlPolicy",
        "!(has(self.torch) && has(self.mpi))",
        "Only one of the policy can be configured",
        RUNTIME_SRC,
    ),
    Rule(
        _RUNTIMES,
        "spec.mlPolicy.torch.numProcPerNode",
        "self > 0 || self in ['auto', 'cpu', 'gpu']",
        "NumProcPerNode must be equal to auto, cpu, gpu, or int value",
        RUNTIME_SRC,
    ),
    Rule(_RUNTIMES, "spec", "size(self) >= 1", "spec: MinProperties=1", RUNTIME_SRC),
)


@functools.cache
def _schema_doc(family: str, version: str) -> dict:
    path = FIXTURES / f"{family}-v{version}.schema.json"
    return json.loads(path.read_text())


def schema(kind: str, version: str) -> dict:
    family = "training-operator" if kind == "PyTorchJob" else "trainer"
    doc = _schema_doc(family, version)
    return {"$schema": doc["$schema"], "$ref": doc["x-roots"][kind], "$defs": doc["$defs"]}


@functools.cache
def _validator(kind: str, version: str):
    return jsonschema.Draft202012Validator(schema(kind, version))


def _select(obj, path: str) -> list:
    """Values at a dotted path; `name[]` fans out over a list. Missing fields select nothing."""
    nodes = [obj]
    for part in [p for p in path.split(".") if p]:
        many = part.endswith("[]")
        key = part[:-2] if many else part
        nxt = []
        for n in nodes:
            if isinstance(n, dict) and key in n:
                v = n[key]
                nxt.extend(v if many and isinstance(v, list) else [v])
        nodes = nxt
    return nodes


@functools.cache
def _program(rule: str):
    import celpy

    env = celpy.Environment()
    return env.program(env.compile(rule))


def cel_errors(obj: dict) -> list[str]:
    import celpy

    out = []
    for r in RULES:
        if obj.get("kind") not in r.kinds:
            continue
        for value in _select(obj, r.path):
            try:
                ok = bool(_program(r.rule).evaluate({"self": celpy.json_to_cel(value)}))
            except Exception:
                ok = False
            if not ok:
                out.append(f"{r.path or '<root>'}: {r.message} (rule {r.rule!r}, {r.source})")
    return out


def validate(obj: dict, version: str) -> list[str]:
    """Every reason the API server of that release would reject `obj` on create ([] = admitted)."""
    errs = [f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}"
            for e in _validator(obj["kind"], version).iter_errors(obj)]
    return errs + cel_errors(obj)


def check(obj: dict, *versions: str) -> None:
    versions = versions or (TRAINING_OPERATOR_VERSIONS if obj["kind"] == "PyTorchJob" else SUPPORTED_TRAINER)
    problems = {v: validate(obj, v) for v in versions}
    bad = {v: p for v, p in problems.items() if p}
    assert not bad, f"{obj['kind']}/{obj['metadata']['name']} rejected: " + json.dumps(bad, indent=1)[:4000]

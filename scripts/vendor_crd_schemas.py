"""Regenerate the vendored CRD schemas in tests/fixtures/crds/ from the upstream API packages on PyPI.

    pip download --no-deps kubeflow-trainer-api==2.1.0 kubeflow-trainer-api==2.2.0 \
        kubeflow-trainer-api==2.3.0 kubeflow-training==1.9.4 -d /tmp/wheels
    python scripts/vendor_crd_schemas.py /tmp/wheels/*.whl

Why these packages: `kubeflow-trainer-api` X.Y.Z is generated (openapi-generator, pydantic) by the
Kubeflow Trainer project from the Go API types of its release vX.Y.Z, and `kubeflow-training`
1.9.4 (swagger-codegen) from Training Operator v1.9.4; both are Apache-2.0. Every model becomes a
JSON Schema definition with `additionalProperties: false` (the API server rejects unknown fields
under `kubectl apply`'s default strict field validation), its required fields, enums (from the
generated enum validators), int-or-string and quantity types. The PyTorchJob package refers to
core types of the `kubernetes` client, which are converted from the installed client.

The schemas hold the structure only. The CRDs' CEL rules (`x-kubernetes-validations`) are not in
these packages; the rules tests/k8s_schemas.py evaluates are listed there with their source.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import importlib
import inspect
import json
import re
import sys
import tempfile
import typing
import zipfile
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "crds"

TRAINER_ROOTS = {"TrainJob": "TrainerV1alpha1TrainJob", "TrainingRuntime": "TrainerV1alpha1TrainingRuntime",
                 "ClusterTrainingRuntime": "TrainerV1alpha1ClusterTrainingRuntime"}
TRAINING_ROOTS = {"PyTorchJob": "KubeflowOrgV1PyTorchJob"}

INT_OR_STRING = {"type": ["integer", "string"]}
QUANTITY = {"type": ["integer", "number", "string"]}
FREE = {}


# ----------------------------------------------------------------------------- pydantic (trainer)


def _enum_values(cls) -> dict[str, list]:
    """{field alias: allowed values} from openapi-generator's `<field>_validate_enum` validators."""
    try:
        src = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    out = {}
    for m in re.finditer(
        r"@field_validator\('(\w+)'\)\s+def \w+_validate_enum\(cls, value\):(.*?)return value", src, re.S
    ):
        values = re.search(r"set\(\[(.*?)\]\)", m.group(2), re.S)
        if values:
            out[m.group(1)] = [v.strip().strip("'\"") for v in values.group(1).split(",") if v.strip()]
    return out


def _pyd_type(tp, defs: dict, mod) -> dict:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Annotated:
        return _pyd_type(args[0], defs, mod)
    if origin is typing.Union:
        non_null = [a for a in args if a is not type(None)]
        if len(non_null) == 1:
            return _pyd_type(non_null[0], defs, mod)
        kinds = {_pyd_type(a, defs, mod).get("type") for a in non_null}
        if kinds <= {"integer", "number"}:
            return {"type": "number"}
        return {"anyOf": [_pyd_type(a, defs, mod) for a in non_null]}
    if origin in (list, typing.List):
        return {"type": "array", "items": _pyd_type(args[0], defs, mod)}
    if origin in (dict, typing.Dict):
        return {"type": "object", "additionalProperties": _pyd_type(args[1], defs, mod)}
    if tp is str:
        return {"type": "string"}
    if tp is bool:
        return {"type": "boolean"}
    if tp is int:
        return {"type": "integer"}
    if tp is float:
        return {"type": "number"}
    if tp is typing.Any or tp is object:
        return dict(FREE)
    if isinstance(tp, str):  # forward reference
        tp = getattr(mod, tp)
    if inspect.isclass(tp):
        _pyd_model(tp, defs, mod)
        return {"$ref": f"#/$defs/{tp.__name__}"}
    raise TypeError(f"unhandled annotation {tp!r}")


def _pyd_model(cls, defs: dict, mod) -> None:
    name = cls.__name__
    if name in defs:
        return
    if name == "IoK8sApimachineryPkgUtilIntstrIntOrString":
        defs[name] = dict(INT_OR_STRING)
        return
    if name == "IoK8sApimachineryPkgApiResourceQuantity":
        defs[name] = dict(QUANTITY)
        return
    fields = getattr(cls, "model_fields", {})
    if "actual_instance" in fields:  # oneOf wrapper
        kinds = {"int": "integer", "str": "string", "float": "number", "bool": "boolean"}
        defs[name] = {"type": sorted(kinds[k] for k in cls.model_fields["one_of_schemas"].default)}
        return
    if name.endswith(("V1Time", "V1MicroTime")):
        defs[name] = {"type": "string"}
        return
    defs[name] = {}  # placeholder against recursion
    enums = _enum_values(cls)
    props, required = {}, []
    for fname, f in fields.items():
        alias = f.alias or fname
        schema = _pyd_type(f.annotation, defs, mod)
        if alias in enums:
            schema = {"enum": enums[alias]}
        if name.startswith("TrainerV1alpha1") and schema == {"type": "object", "additionalProperties": {}}:
            # openapi-generator renders an empty Go struct (e.g. the 2.2 `torch: {}` policy) as a free
            # map; the CRD has `type: object` with no properties, so any key in it is unknown.
            schema = {"type": "object", "properties": {}, "additionalProperties": False}
        props[alias] = schema
        if f.is_required():
            required.append(alias)
    if not props:  # free-form objects (RawExtension, FieldsV1, JSON)
        defs[name] = {"type": "object"}
        return
    out = {"type": "object", "properties": props, "additionalProperties": False}
    if required:
        out["required"] = sorted(required)
    defs[name] = out


# -------------------------------------------------------------------------- swagger-codegen (v1)


def _sw_type(t: str, defs: dict, lookup) -> dict:
    t = t.strip()
    if t.startswith("list["):
        return {"type": "array", "items": _sw_type(t[5:-1], defs, lookup)}
    if t.startswith("dict("):
        return {"type": "object", "additionalProperties": _sw_type(t[5:-1].split(",", 1)[1], defs, lookup)}
    simple = {"str": {"type": "string"}, "int": {"type": "integer"}, "bool": {"type": "boolean"},
              "float": {"type": "number"}, "datetime": {"type": "string"}, "date": {"type": "string"},
              "object": dict(FREE), "Quantity": dict(QUANTITY), "IntOrString": dict(INT_OR_STRING)}
    if t in simple:
        return dict(simple[t])
    _sw_model(t, defs, lookup)
    return {"$ref": f"#/$defs/{t}"}


def _sw_model(name: str, defs: dict, lookup) -> None:
    if name in defs:
        return
    cls = lookup(name)
    defs[name] = {}
    src = inspect.getsource(cls)
    props, required = {}, []
    for attr, t in cls.openapi_types.items():
        alias = cls.attribute_map[attr]
        schema = _sw_type(t, defs, lookup)
        if name == "V1ResourceRequirements" and alias in ("limits", "requests"):
            schema = {"type": "object", "additionalProperties": dict(QUANTITY)}
        props[alias] = schema
        if f"Invalid value for `{attr}`, must not be `None`" in src:
            required.append(alias)
    out = {"type": "object", "properties": props, "additionalProperties": False}
    if required:
        out["required"] = sorted(required)
    defs[name] = out


# ------------------------------------------------------------------------------------------ main


def _strip_descriptions(obj):
    if isinstance(obj, dict):
        return {k: _strip_descriptions(v) for k, v in obj.items() if k != "description"}
    if isinstance(obj, list):
        return [_strip_descriptions(v) for v in obj]
    return obj


def _write(path: Path, roots: dict, defs: dict, provenance: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"$schema": "https://json-schema.org/draft/2020-12/schema", "x-provenance": provenance,
           "x-roots": {kind: f"#/$defs/{model}" for kind, model in roots.items()},
           "$defs": dict(sorted(_strip_descriptions(defs).items()))}
    path.write_text(json.dumps(doc, indent=None, sort_keys=False, separators=(",", ":")) + "\n")
    print(f"{path}: {len(defs)} definitions, {path.stat().st_size / 1e3:.0f} kB")


def vendor(wheel: Path) -> None:
    sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
    name, version = wheel.name.split("-")[:2]
    tmp = Path(tempfile.mkdtemp(prefix="crd-vendor-"))
    with zipfile.ZipFile(wheel) as z:
        z.extractall(tmp)
    sys.path.insert(0, str(tmp))
    for mod_name in list(sys.modules):
        if mod_name.startswith(("kubeflow_trainer_api", "kubeflow.training")):
            del sys.modules[mod_name]
    prov = {"package": name.replace("_", "-"), "version": version, "wheel": wheel.name, "wheel_sha256": sha,
            "license": "Apache-2.0", "generated_by": "scripts/vendor_crd_schemas.py",
            "generated_at": _dt.date.today().isoformat()}
    try:
        if name == "kubeflow_trainer_api":
            mod = importlib.import_module("kubeflow_trainer_api.models")
            defs: dict = {}
            for model in TRAINER_ROOTS.values():
                _pyd_model(getattr(mod, model), defs, mod)
            prov["upstream"] = f"kubeflow/trainer v{version} (pkg/apis/trainer/v1alpha1, api/openapi-spec)"
            _write(OUT / f"trainer-v{version}.schema.json", TRAINER_ROOTS, defs, prov)
        elif name == "kubeflow_training":
            mod = importlib.import_module("kubeflow.training.models")
            import kubernetes.client as k8s

            def lookup(n):
                # K8sIoApiAutoscalingV2MetricSpec (the operator's name) is the client's V2MetricSpec
                return getattr(mod, n, None) or getattr(k8s, re.sub(r"^K8sIoApi[A-Z][a-z]+", "", n))

            defs = {}
            for model in TRAINING_ROOTS.values():
                _sw_model(model, defs, lookup)
            import kubernetes

            prov["upstream"] = f"kubeflow/training-operator v{version} (pkg/apis/kubeflow.org/v1)"
            prov["core_types_from"] = f"kubernetes (python client) {kubernetes.__version__}"
            _write(OUT / f"training-operator-v{version}.schema.json", TRAINING_ROOTS, defs, prov)
        else:
            raise SystemExit(f"{wheel.name}: not a kubeflow-trainer-api / kubeflow-training wheel")
    finally:
        sys.path.remove(str(tmp))


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    for w in sys.argv[1:]:
        vendor(Path(w))

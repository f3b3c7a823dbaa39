"""register: python_func with the store and registry stubbed: what is registered, with which protocol."""

import json
import types

import pytest

from chunkgrpo.registry import registration
from components.register.component import register

EVAL = {
    "format": "chunkgrpo.eval-metrics/v1",
    "metrics": {"hpdv2.hpsv3.trained": 0.31, "hpdv2.hpsv3.base": 0.29},
    "config": {"scorers": ["hpsv3"]},
    "seed": 42,
    "sampling": {"num_steps": 50, "trained_steps": 30},
    "benchmarks": {"hpdv2": {"n_prompts": 400}},
}


def test_register_maps_metrics_protocol_and_gate(monkeypatch, artifact):
    import chunkgrpo.store.client as store
    from chunkgrpo.store.manifest import make_pointer

    pointer = make_pointer("s3://bkt/run/train/final", "a" * 64, "lora", base_model="s3://bkt/models/flux",
                                 method="chunk")
    calls = {}

    class FakeStore:
        def get_folder(self, uri, dst):
            return types.SimpleNamespace(sha256="a" * 64)

    def fake_register(req, **kw):
        calls.update(vars(req), **kw)
        return registration.RegisteredVersion(req.name, "7", "mlflow-artifacts:/x", "run", {})

    monkeypatch.setattr(store, "ArtifactStore", FakeStore)
    monkeypatch.setattr(registration, "register_model", fake_register)
    out = artifact("registered.json")
    v = register.python_func(model_name="m", experiment="e", run_id="kfp-1", parent_run_id="", model=artifact(
        "pointer.json", json.dumps(pointer)), eval_results=artifact("metrics.json", json.dumps(EVAL)),
        plan_json=artifact("plan.json", json.dumps({"sizes": [2, 3]})), registered=out,
        gate_metric="eval.hpdv2.hpsv3", gate_direction="max", eval_preset="eval_hpdv2")
    assert v == "7" and json.loads(open(out.path).read())["version"] == "7"
    assert calls["metrics"] == {"eval": {"hpdv2.hpsv3": 0.31, "hpdv2.hpsv3.base": 0.29}}
    assert calls["eval_protocol"]["preset"] == "eval_hpdv2" and calls["eval_protocol"]["seed"] == 42
    assert calls["sampling"] == {"num_steps": 50, "trained_steps": 30}
    assert (calls["gate_metric"], calls["gate_direction"]) == ("eval.hpdv2.hpsv3", "max")
    assert calls["checkpoint_uri"] == "s3://bkt/run/train/final" and calls["tags"]["kfp.run_id"] == "kfp-1"


def test_register_refuses_a_changed_checkpoint(monkeypatch, artifact):
    import chunkgrpo.store.client as store
    from chunkgrpo.store.manifest import make_pointer

    pointer = make_pointer("s3://bkt/f", "a" * 64, "lora", base_model="x")
    monkeypatch.setattr(store, "ArtifactStore", lambda: types.SimpleNamespace(
        get_folder=lambda uri, dst: types.SimpleNamespace(sha256="b" * 64)))
    with pytest.raises(RuntimeError, match="changed after training"):
        register.python_func(
            model_name="m",
            experiment="e",
            run_id="r",
            parent_run_id="",
            model=artifact("p.json", json.dumps(pointer)),
            eval_results=artifact("m.json", json.dumps(EVAL)),
            plan_json=artifact("plan.json", "{}"),
            registered=artifact("o.json"),
        )

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
        def read_manifest(self, uri):
            return types.SimpleNamespace(sha256="a" * 64, total_bytes=1024)

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
    monkeypatch.setattr(store, "ArtifactStore", lambda: types.SimpleNamespace(  # checked before any download
        read_manifest=lambda uri: types.SimpleNamespace(sha256="b" * 64, total_bytes=10),
        get_folder=lambda uri, dst: pytest.fail("downloaded a changed checkpoint")))
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


@pytest.mark.parametrize("kind,size", [("full", 47_600_000_000), ("lora", 2 * 2**30), ("lora", 300 * 2**20)])
def test_register_copies_only_a_small_adapter(monkeypatch, artifact, kind, size):
    """A full fine-tune (47.6 GB for FLUX.1-dev) and a LoRA above the inline bound are registered by
    reference to their verified checkpoint: nothing is downloaded into the register pod. A small LoRA is
    copied into the version."""
    import chunkgrpo.store.client as store
    from chunkgrpo.stages.register import INLINE_MAX_BYTES
    from chunkgrpo.store.manifest import make_pointer

    pointer = make_pointer("s3://bkt/run/train/final", "b" * 64, kind, base_model="s3://bkt/models/flux")
    calls, fetched = {}, []

    class FakeStore:
        def read_manifest(self, uri):
            return types.SimpleNamespace(sha256="b" * 64, total_bytes=size)

        def get_folder(self, uri, dst):
            fetched.append(uri)
            return types.SimpleNamespace(sha256="b" * 64)

    def fake_register(req, **kw):
        calls.update(vars(req))
        return registration.RegisteredVersion(req.name, "3", "mlflow-artifacts:/x", "run", {})

    monkeypatch.setattr(store, "ArtifactStore", FakeStore)
    monkeypatch.setattr(registration, "register_model", fake_register)
    out = artifact("registered.json")
    register.python_func(model_name="m", experiment="e", run_id="kfp-1", parent_run_id="",
                         model=artifact("pointer.json", json.dumps(pointer)),
                         eval_results=artifact("metrics.json", json.dumps(EVAL)),
                         plan_json=artifact("plan.json", "{}"), registered=out)
    inline = kind == "lora" and size <= INLINE_MAX_BYTES
    assert json.loads(open(out.path).read())["weights"] == ("inline" if inline else "external")
    assert calls["include_weights"] is inline and calls["checkpoint_uri"] == "s3://bkt/run/train/final"
    assert fetched == (["s3://bkt/run/train/final"] if inline else [])
    assert (calls["model_dir"] is None) is not inline


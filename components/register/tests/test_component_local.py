"""register under kfp.local against the local S3 + MLflow: an MLflow pyfunc version with metrics,
eval protocol and the registered model's gate."""

import json
import os
import uuid

import pytest
from kfp import dsl

from chunkgrpo.registry.client import version_details
from components.register.component import register

pytestmark = pytest.mark.integration


def test_register_locally(local_runner, text_artifact, tmp_path):
    from mlflow import MlflowClient

    from chunkgrpo.store.client import ArtifactStore
    from chunkgrpo.store.manifest import make_pointer
    from tests.registry_helpers import eval_run

    lora = tmp_path / "final"
    lora.mkdir()
    (lora / "pytorch_lora_weights.safetensors").write_bytes(b"\x02" * 1024)
    (lora / "chunkgrpo_model.json").write_text(json.dumps({"kind": "lora", "base_model": "tiny"}))
    store = ArtifactStore()
    uri = store.uri(f"comp-register/{uuid.uuid4().hex[:6]}/final")
    manifest = store.put_folder(lora, uri)
    pointer = make_pointer(uri, manifest.sha256, "lora", base_model="tiny", method="chunk")
    evaluation = {
        "format": "chunkgrpo.eval-metrics/v1",
        "metrics": {"hpdv2.brightness.trained": 0.6},
        "seed": 42,
        "config": {"scorers": ["brightness"]},
        "sampling": {"num_steps": 4, "trained_steps": 2},
        "benchmarks": {"hpdv2": {"n_prompts": 8}},
        "mlflow_run_id": eval_run({"hpdv2.brightness.trained": 0.6}, weights=lora),
    }  # the evaluate stage's run
    name = f"comp-register-{uuid.uuid4().hex[:6]}"

    @dsl.pipeline(name="register-local")
    def p(pointer: str, evaluation: str) -> str:
        m, e, pl = text_artifact(text=pointer), text_artifact(text=evaluation), text_artifact(text="{}")
        return register(
            model_name=name,
            experiment="comp",
            run_id="kfp-x",
            parent_run_id="",
            model=m.outputs["out"],
            eval_results=e.outputs["out"],
            plan_json=pl.outputs["out"],
            gate_metric="eval.hpdv2.brightness",
            gate_direction="max",
            eval_preset="eval_tiny",
        ).outputs["Output"]

    version = p(pointer=json.dumps(pointer), evaluation=json.dumps(evaluation)).output
    c = MlflowClient()
    mv = c.get_model_version(name, version)
    assert float(mv.tags["metric.eval.hpdv2.brightness"]) == 0.6 and mv.tags["eval.protocol.sha256"]
    assert mv.tags["eval.run_id"] == evaluation["mlflow_run_id"]  # promotion reads the metrics from that run
    assert version_details(c, mv)["eval_protocol"]["preset"] == "eval_tiny"
    assert c.get_registered_model(name).tags["gate.direction"] == "max"
    assert [
        a.path for a in c.list_artifacts(mv.run_id, "model") if a.path.endswith("MLmodel")
    ]  # an MLflow Model


def test_register_of_a_full_model_fits_the_register_pod(local_runner, text_artifact, tmp_path):
    """register as its pod runs (pod-faithful: the compiled env, no volume, /tmp and $HOME capped and
    measured, also just before a temporary folder is deleted) registers a full model 10x larger than the
    cap: by reference to the verified checkpoint, nothing downloaded. The version then loads, the weights
    fetched from S3 and checked against the registered manifest digest."""
    from mlflow import MlflowClient

    from chunkgrpo.registry.load import load_registered_model
    from chunkgrpo.store.client import ArtifactStore
    from chunkgrpo.store.manifest import build_manifest, make_pointer
    from pipeline.compile import pipeline_func
    from pipeline.pod_faithful import TMP, Layout, pod_specs, tasks_as_pods
    from tests.registry_helpers import eval_run

    spec = pod_specs(pipeline_func("train_and_evaluate", pool="cpu")[0])["register"]
    assert spec.volumes == {}  # the register pod has no volume: /tmp (the container layer) is all it has
    cap = 16 * 2**20           # above the served code the version carries (~5 MB), far below the model
    full = tmp_path / "final"
    (full / "transformer").mkdir(parents=True)
    (full / "transformer" / "config.json").write_text(json.dumps({"_class_name": "FluxTransformer2DModel"}))
    (full / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(os.urandom(10 * cap + 4096))
    (full / "chunkgrpo_model.json").write_text(json.dumps({"kind": "full", "base_model": "tiny"}))
    store = ArtifactStore()
    uri = store.uri(f"comp-register/{uuid.uuid4().hex[:6]}/final")
    manifest = store.put_folder(full, uri)
    pointer = make_pointer(uri, manifest.sha256, "full", base_model="tiny", method="chunk")
    evaluation = {"format": "chunkgrpo.eval-metrics/v1", "metrics": {"hpdv2.brightness.trained": 0.6},
                  "seed": 42, "config": {"scorers": ["brightness"]}, "sampling": {"num_steps": 4},
                  "benchmarks": {"hpdv2": {"n_prompts": 8}},
                  "mlflow_run_id": eval_run({"hpdv2.brightness.trained": 0.6}, weights=full)}
    name = f"comp-register-full-{uuid.uuid4().hex[:6]}"

    @dsl.pipeline(name="register-pod")
    def p(pointer: str, evaluation: str) -> str:
        m, e, pl = text_artifact(text=pointer), text_artifact(text=evaluation), text_artifact(text="{}")
        return register(model_name=name, experiment="comp", run_id="kfp-x", parent_run_id="",
                        model=m.outputs["out"], eval_results=e.outputs["out"], plan_json=pl.outputs["out"],
                        gate_metric="eval.hpdv2.brightness", gate_direction="max").outputs["Output"]

    layout = Layout(tmp_path / "pods", {"register": spec}, faithful=True, limits={"register": {TMP: cap}},
                    allow=(str(tmp_path / "kfp"),))
    with tasks_as_pods(layout):
        version = p(pointer=json.dumps(pointer), evaluation=json.dumps(evaluation)).output
    assert layout.failures == []
    (task,) = [t for t in layout.report if t["task"] == "register"]
    assert 0 < task["peak"][TMP] <= cap and manifest.total_bytes >= 10 * cap, task
    client = MlflowClient()
    mv = client.get_model_version(name, version)
    details = version_details(client, mv)
    assert details["weights"] == "external" and details["checkpoint_uri"] == uri  # registered by reference
    loaded = load_registered_model(f"models:/{name}/{version}", tmp_path / "loaded")
    assert loaded.kind == "full" and build_manifest(loaded.weights_dir).content_sha256 == \
        manifest.content_sha256

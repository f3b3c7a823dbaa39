"""register under kfp.local against the local S3 + MLflow: an MLflow pyfunc version with metrics,
eval protocol and the registered model's gate."""

import json
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

"""check_gate + promote under kfp.local against the local MLflow registry."""

import uuid

import pytest

from components.promote.component import check_gate, promote

pytestmark = pytest.mark.integration
PROTOCOL = {"preset": "eval_tiny", "seed": 42}


def _version(name, tmp_path, seed, score):
    from chunkgrpo.registry.registration import Registration, register_model

    d = tmp_path / f"lora-{seed}"
    d.mkdir()
    (d / "pytorch_lora_weights.safetensors").write_bytes(bytes([seed]) * 512)
    from tests.registry_helpers import eval_run

    run = eval_run({"hpdv2.hpsv3.trained": score}, weights=d)
    return register_model(Registration(name, "tiny", d, kind="lora", metrics={"eval.hpdv2.hpsv3": score},
                                       eval_protocol=PROTOCOL, eval_run_id=run)).version


def test_gate_then_promote_locally(local_runner, tmp_path):
    from mlflow import MlflowClient

    name = f"comp-promote-{uuid.uuid4().hex[:6]}"
    v1 = _version(name, tmp_path, 1, 0.3)
    assert check_gate(model_name=name, version=v1, metric="", margin=0.0).output is True
    assert (
        promote(model_name=name, version=v1, metric="", margin=0.0, who="kfp", why="t").outputs["Output"]
        == "promoted"
    )
    v2 = _version(name, tmp_path, 2, 0.2)  # worse
    assert check_gate(model_name=name, version=v2, metric="", margin=0.0).output is False
    assert MlflowClient().get_registered_model(name).aliases["champion"] == v1

"""An evaluation is bound to the weights it scored, end to end on the tiny FLUX with the real local MLflow
and S3: `run_evaluation` records the weights' digest (and the local base model's) on its run, the same
checkpoint registers and is promoted on that run's numbers, other weights are refused with it."""

from __future__ import annotations

import uuid

import pytest

from chunkgrpo.errors import UserError

pytestmark = pytest.mark.integration


def test_the_evaluation_run_names_the_weights_it_scored(services_env, tiny_model_dir, trained_dir, tmp_path):
    from mlflow import MlflowClient

    from chunkgrpo.eval.config import EvalConfig
    from chunkgrpo.eval.runner import run_evaluation
    from chunkgrpo.registry.gate import metrics_from_eval
    from chunkgrpo.registry.promotion import promote
    from chunkgrpo.registry.registration import Registration, register_model
    from chunkgrpo.store.client import ArtifactStore
    from chunkgrpo.store.manifest import BASE_WEIGHTS_TAG, WEIGHTS_TAG, weights_sha256

    store = ArtifactStore(services_env.store_config)
    store.ensure_bucket()
    ckpt = store.uri(f"tests/binding/{uuid.uuid4().hex[:6]}/final")
    store.put_folder(trained_dir, ckpt)
    cfg = EvalConfig.load("eval_tiny", [f"model={ckpt}", f"base_model={tiny_model_dir}", "num_prompts=2",
                                        f"output_dir={tmp_path / 'eval'}", f"cache_dir={tmp_path / 'cache'}",
                                        "experiment=binding-test"])
    result = run_evaluation(cfg)
    tags = MlflowClient().get_run(result["mlflow_run_id"]).data.tags
    assert tags[WEIGHTS_TAG] == weights_sha256(trained_dir)  # the cached download names the same weights
    assert tags[BASE_WEIGHTS_TAG] == weights_sha256(tiny_model_dir)

    metrics, protocol, sampling = metrics_from_eval(result, "eval_tiny")
    name = f"binding-{uuid.uuid4().hex[:6]}"
    local = tmp_path / "registered"
    store.get_folder(ckpt, local)  # what the register stage registers: the checkpoint, downloaded
    rv = register_model(Registration(name, str(tiny_model_dir), local, kind="lora", checkpoint_uri=ckpt,
                                     metrics=metrics, eval_protocol=protocol, sampling=sampling,
                                     gate_metric="eval.hpdv2.brightness",  # eval_tiny's scorer
                                     eval_run_id=result["mlflow_run_id"]))
    mv = MlflowClient().get_model_version(name, rv.version)
    assert mv.tags["weights.sha256"] == tags[WEIGHTS_TAG]
    assert mv.tags["eval.run_id"] == result["mlflow_run_id"]
    assert promote(name, rv.version).action == "promoted"

    other = tmp_path / "other"
    other.mkdir()
    (other / "pytorch_lora_weights.safetensors").write_bytes(b"\x07" * 1024)
    with pytest.raises(UserError, match="scored other weights"):
        register_model(Registration(name, str(tiny_model_dir), other, kind="lora", eval_protocol=protocol,
                                    eval_run_id=result["mlflow_run_id"]))

"""A registered version carries the tags a reader needs (each metric's mean, base, delta and the delta's
lower bound); the other paired statistics and the whole request go into registration/details.json of the
version's run."""

from __future__ import annotations

import json
import uuid

import pytest

from chunkgrpo.registry.registration import DETAILS_ARTIFACT, Registration, register_model
from tests.registry_helpers import eval_run

pytestmark = pytest.mark.integration

STATS = {"hpdv2.hpsv3.trained": 0.31, "hpdv2.hpsv3.base": 0.30, "hpdv2.hpsv3.delta": 0.01,
         "hpdv2.hpsv3.delta_ci_low": 0.005, "hpdv2.hpsv3.delta_ci_high": 0.02, "hpdv2.hpsv3.win_rate": 0.6,
         "hpdv2.hpsv3.win_rate_ci_low": 0.55, "hpdv2.hpsv3.win_rate_ci_high": 0.65,
         "hpdv2.hpsv3.n_pairs": 400.0}


def test_version_tags_keep_the_headline_and_details_hold_the_rest(services_env, tmp_path):
    from mlflow import MlflowClient

    client = MlflowClient()
    weights = tmp_path / "lora"
    weights.mkdir()
    (weights / "pytorch_lora_weights.safetensors").write_bytes(bytes([7]) * 4096)
    (weights / "adapter_config.json").write_text(json.dumps({"r": 4}))
    run = eval_run(STATS, weights=weights)
    name = f"tags-{uuid.uuid4().hex[:6]}"
    v = register_model(Registration(name, "tiny-flux", weights, kind="lora", git="abc123", cfg_hash="cfg1",
                                    plan={"boundaries": [0, 4, 8, 16]}, eval_run_id=run))
    tags = client.get_model_version(name, v.version).tags
    metrics = {k for k in tags if k.startswith("metric.")}
    assert metrics == {"metric.eval.hpdv2.hpsv3", "metric.eval.hpdv2.hpsv3.base",
                       "metric.eval.hpdv2.hpsv3.delta", "metric.eval.hpdv2.hpsv3.delta_ci_low"}
    assert float(tags["metric.eval.hpdv2.hpsv3.delta_ci_low"]) == 0.005
    assert len(tags) <= 25, sorted(tags)
    path = client.download_artifacts(v.run_id, DETAILS_ARTIFACT, str(tmp_path / "dl"))
    details = json.loads(open(path).read())
    assert details["metrics"]["eval.hpdv2.hpsv3.n_pairs"] == 400.0
    assert details["metrics"]["eval.hpdv2.hpsv3.win_rate_ci_high"] == 0.65
    assert details["chunk_plan"] == {"boundaries": [0, 4, 8, 16]} and details["name"] == name

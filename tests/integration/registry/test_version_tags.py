"""A registered version carries the short set of tags a reader needs (base model, kind, the gate metric's
value, the evaluation run, the gate at registration, the digests; after promotion the decision, its reason,
the status and one record); every other metric, statistic and field of the request is in
registration/details.json of the version's run, and each reader finds what it needs there or in the
evaluation run."""

from __future__ import annotations

import json
import uuid

import pytest

from chunkgrpo.registry.client import registered_metric, version_details
from chunkgrpo.registry.promotion import promote
from chunkgrpo.registry.registration import DETAILS_ARTIFACT, Registration, find_version, register_model
from chunkgrpo.store.manifest import weights_sha256
from tests.registry_helpers import eval_run

pytestmark = pytest.mark.integration

STATS = {"hpdv2.hpsv3.trained": 0.31, "hpdv2.hpsv3.base": 0.30, "hpdv2.hpsv3.delta": 0.01,
         "hpdv2.hpsv3.delta_ci_low": 0.005, "hpdv2.hpsv3.delta_ci_high": 0.02, "hpdv2.hpsv3.win_rate": 0.6,
         "hpdv2.hpsv3.win_rate_ci_low": 0.55, "hpdv2.hpsv3.win_rate_ci_high": 0.65,
         "hpdv2.hpsv3.n_pairs": 400.0, "geneval.overall.trained": 0.5}
SHORT = {"kind", "base_model", "eval.protocol.sha256", "eval.run_id", "weights.sha256", "model.tree_sha256",
         "gate.at_registration", "metric.eval.hpdv2.hpsv3"}
PROMOTED = {"gate.decision", "gate.reason", "promotion.status", "promotion.record"}


def test_version_tags_are_the_short_set_and_details_hold_the_rest(services_env, tmp_path):
    from mlflow import MlflowClient

    client = MlflowClient()
    weights = tmp_path / "lora"
    weights.mkdir()
    (weights / "pytorch_lora_weights.safetensors").write_bytes(bytes([7]) * 4096)
    (weights / "adapter_config.json").write_text(json.dumps({"r": 4}))
    run = eval_run(STATS, weights=weights)
    name = f"tags-{uuid.uuid4().hex[:6]}"
    req = Registration(name, "tiny-flux", weights, kind="lora", git="abc123", cfg_hash="cfg1",
                       plan={"boundaries": [0, 4, 8, 16]}, eval_run_id=run,
                       eval_protocol={"preset": "eval_tiny"}, tags={"kfp.run_id": "kfp-7"})
    v = register_model(req)
    mv = client.get_model_version(name, v.version)
    assert set(mv.tags) == SHORT, sorted(mv.tags)
    assert float(mv.tags["metric.eval.hpdv2.hpsv3"]) == 0.31 and mv.tags["eval.run_id"] == run

    # the details: every metric with its paired statistics, the plan, the request's tags
    path = client.download_artifacts(v.run_id, DETAILS_ARTIFACT, str(tmp_path / "dl"))
    details = json.loads(open(path).read())
    assert details == version_details(client, mv)
    assert details["metrics"]["eval.hpdv2.hpsv3.n_pairs"] == 400.0
    assert details["metrics"]["eval.hpdv2.hpsv3.win_rate_ci_high"] == 0.65
    assert details["chunk_plan"] == {"boundaries": [0, 4, 8, 16]} and details["name"] == name
    assert (details["git_sha"], details["config_hash"], details["tags"]) == ("abc123", "cfg1",
                                                                           {"kfp.run_id": "kfp-7"})
    assert details["eval_protocol"] == {"preset": "eval_tiny"}

    # readers: the nightly reference (evaluation run), dedupe (weights digest), promotion (record)
    assert registered_metric(client, mv, "eval.hpdv2.hpsv3.delta_ci_low") == 0.005
    assert registered_metric(client, mv, "eval.geneval.overall") == 0.5
    assert registered_metric(client, mv, "eval.nothing") is None
    assert find_version(client, name, weights_sha256(weights), "lora", "tiny-flux").version == v.version
    assert register_model(req).reused is True
    assert promote(name, v.version, who="tester", why="first").action == "promoted"
    tags = client.get_model_version(name, v.version).tags
    assert set(tags) == SHORT | PROMOTED and len(tags) <= 12, sorted(tags)
    record = json.loads(tags["promotion.record"])
    assert record["by"] == "tester" and record["why"] == "first" and record["gate"]["candidate"] == 0.31
    assert tags["gate.decision"] == "promoted" and tags["gate.reason"] == record["reason"]


def test_details_of_a_version_registered_without_an_evaluation_run(services_env, tmp_path):
    """The nightly reference of a version with no evaluation run comes from its details."""
    from mlflow import MlflowClient

    client = MlflowClient()
    weights = tmp_path / "lora"
    weights.mkdir()
    (weights / "pytorch_lora_weights.safetensors").write_bytes(bytes([9]) * 2048)
    name = f"tags-{uuid.uuid4().hex[:6]}"
    v = register_model(Registration(name, "tiny-flux", weights, metrics={"eval": {"clip": 0.25}}))
    mv = client.get_model_version(name, v.version)
    assert not any(k.startswith("metric.") for k in mv.tags) and "eval.run_id" not in mv.tags
    assert registered_metric(client, mv, "eval.clip") == 0.25

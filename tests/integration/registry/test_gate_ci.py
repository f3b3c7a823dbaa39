"""The CI bounds the evaluate stage exposes, used by promotion and by the nightly regression check, against
the real local MLflow server."""

from __future__ import annotations

import json
import uuid
from types import SimpleNamespace

import pytest

from chunkgrpo.registry.gate import GateConfig
from chunkgrpo.registry.promotion import promote
from chunkgrpo.registry.registration import Registration, register_model
from tests.registry_helpers import eval_run_for

pytestmark = pytest.mark.integration
CI = "hpdv2.hpsv3.delta_ci_low"


def _register(name, tmp_path, seed, mean, lo):
    root = tmp_path / f"lora-{seed}"
    root.mkdir()
    (root / "pytorch_lora_weights.safetensors").write_bytes(bytes([seed]) * 1024)
    # what components/register maps from metrics.json: `<k>.trained` -> eval.<k>, other keys kept
    metrics = {"eval": {"hpdv2.hpsv3": mean, CI: lo, "hpdv2.hpsv3.delta_ci_high": lo + 0.1}}
    # one eval protocol for all versions: the registry never compares metrics measured differently
    run = eval_run_for({f"eval.{k}": v for k, v in metrics["eval"].items()}, root)  # the gate's only source
    protocol = {"preset": "eval_hpdv2", "benchmarks": {"hpdv2": 400}}
    return register_model(Registration(name, "tiny-flux", root, kind="lora", metrics=metrics, git="abc",
                                       cfg_hash="cfg", eval_protocol=protocol, eval_run_id=run))


def test_promotion_and_nightly_check_on_the_ci_lower_bound(services_env, tmp_path):
    from mlflow import MlflowClient

    from components.evaluate.component import check_regression

    name = f"flux-ci-{uuid.uuid4().hex[:6]}"
    gate = GateConfig(metric=f"eval.{CI}", margin=0.0)
    v1 = _register(name, tmp_path, 1, 0.30, -0.01)  # higher mean than nothing, but not significant vs base
    r = promote(name, v1.version, gate, who="t")
    assert r.action == "rejected" and "must be above margin +0" in r.reason
    v2 = _register(name, tmp_path, 2, 0.31, 0.02)
    assert promote(name, v2.version, gate, who="t").action == "promoted"
    v3 = _register(name, tmp_path, 3, 0.40, 0.015)  # better mean, weaker evidence than the champion
    assert promote(name, v3.version, gate, who="t").action == "rejected"
    assert promote(name, v3.version, GateConfig(metric="eval.hpdv2.hpsv3"), who="t").action == "promoted"

    # nightly: tonight's bound vs the bound registered with the champion (v3: 0.015)
    def nightly(bound):
        results = tmp_path / f"results-{bound}.json"
        results.write_text(json.dumps({"metrics": {CI: bound, "hpdv2.hpsv3.trained": 0.4}}))
        summary = tmp_path / f"summary-{bound}.md"
        regressed = check_regression.python_func(
            results=SimpleNamespace(path=str(results)), model_name=name, alias="champion", metric=CI,
            direction="max", tolerance=0.005, fail_on_regression=False, parent_run_id="",
            summary=SimpleNamespace(path=str(summary)))
        return regressed, summary.read_text()

    ok, text = nightly(0.014)
    assert ok is False and "no regression" in text
    bad, text = nightly(-0.002)
    assert bad is True and "REGRESSION" in text and "not significantly better than the base model" in text
    # the bound the nightly check compares with is the one of the version's evaluation run
    from chunkgrpo.registry.client import registered_metric

    client = MlflowClient()
    assert registered_metric(client, client.get_model_version(name, v3.version), f"eval.{CI}") == 0.015

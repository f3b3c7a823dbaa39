"""The registry's pure rules (`chunkgrpo.registry.gate`): no MLflow server or client."""

from __future__ import annotations

import pytest

from chunkgrpo.errors import UserError
from chunkgrpo.registry.gate import (
    GateConfig,
    RegistryConfig,
    config_hash,
    eval_protocol,
    gate_decision,
    known_direction,
    protocol_hash,
)


def test_gate_decision_max_and_min():
    assert GateConfig().metric == "" and GateConfig().direction == ""  # both come from the registered model
    with pytest.raises(UserError, match="resolved"):
        gate_decision(0.3, 0.2, GateConfig())
    # no direction given: the metric's known one (never a default that could flip it)
    assert not gate_decision(0.30, 0.31, GateConfig(metric="eval.hpdv2.hpsv3")).passed
    with pytest.raises(UserError, match="direction of 'eval.fid' is unknown"):
        gate_decision(10.0, 12.0, GateConfig(metric="eval.fid"))
    g = GateConfig(metric="eval.hpdv2.hpsv3", direction="max")
    assert gate_decision(0.31, None, g).passed
    assert gate_decision(0.32, 0.31, g).passed
    assert not gate_decision(0.31, 0.31, g).passed  # a tie does not beat the champion
    assert not gate_decision(0.30, 0.31, g).passed
    m = GateConfig(metric="eval.hpdv2.hpsv3", direction="max", margin=0.05)
    assert not gate_decision(0.35, 0.31, m).passed and gate_decision(0.37, 0.31, m).passed
    low = GateConfig(metric="eval.fid", direction="min", margin=1.0)
    assert gate_decision(10.0, 12.0, low).passed and not gate_decision(11.5, 12.0, low).passed
    with pytest.raises(UserError, match="--force"):
        gate_decision(None, 0.3, g)


@pytest.mark.parametrize("kv", [{"direction": "up"}, {"margin": -1}])
def test_gate_config_validation(kv):
    with pytest.raises(UserError):
        GateConfig.from_dict(kv)


def test_registry_config():
    cfg = RegistryConfig.load(overrides=["gate.margin=0.01", "gate.direction=min"])
    assert cfg.gate.margin == 0.01 and cfg.gate.direction == "min"
    with pytest.raises(UserError):
        RegistryConfig(previous_alias="champion")
    assert config_hash({"a": 1, "b": [1, 2]}) == config_hash({"b": [1, 2], "a": 1})


def test_known_directions_and_protocol_hash():
    assert (
        known_direction("eval.hpdv2.hpsv3") == "max"
        and known_direction("eval.hpdv2.hpsv3.delta_ci_low") == "max"
    )
    assert known_direction("eval.geneval.overall") == "max" and known_direction("eval.fid") is None
    result = {"config": {"scorers": ["imagereward", "hpsv3"], "seed": 42}, "seed": 42,
              "sampling": {"num_steps": 50, "trained_steps": 30},
              "benchmarks": {"hpdv2": {"n_prompts": 400, "official_prompts": True, "results": {"x": 1}}}}
    p = eval_protocol(result, "eval_hpdv2")
    assert p == {
        "preset": "eval_hpdv2",
        "benchmarks": {"hpdv2": {"n_prompts": 400, "official_prompts": True}},
        "seed": 42,
        "sampling": {"num_steps": 50, "trained_steps": 30},
        "scorers": ["hpsv3", "imagereward"],
    }
    fewer = {**result, "benchmarks": {"hpdv2": {"n_prompts": 100, "official_prompts": True}}}
    other_seed = {**result, "seed": 7}
    assert len({protocol_hash(p), protocol_hash(eval_protocol(fewer, "eval_hpdv2")),
                protocol_hash(eval_protocol(other_seed, "eval_hpdv2"))}) == 3

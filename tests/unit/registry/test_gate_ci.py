"""Promotion gate on a confidence bound of the evaluation's paired trained − base delta
(`eval.<bench>.<metric>.delta_ci_low`): `margin` is an absolute threshold on the bound."""

from __future__ import annotations

import pytest

from chunkgrpo.errors import UserError
from chunkgrpo.registry.gate import GateConfig, gate_decision

CI = "eval.hpdv2.hpsv3.delta_ci_low"


def test_ci_lower_bound_must_clear_the_margin_even_without_a_champion():
    g = GateConfig(metric=CI)
    assert gate_decision(0.02, None, g).passed  # significantly better than the base model
    assert not gate_decision(-0.01, None, g).passed  # CI contains 0: not promoted, although no champion
    assert not gate_decision(0.0, None, g).passed  # a bound of exactly the margin does not pass
    assert not gate_decision(0.05, None, GateConfig(metric=CI, margin=0.06)).passed
    assert gate_decision(0.07, None, GateConfig(metric=CI, margin=0.06)).passed


def test_ci_lower_bound_must_also_beat_the_champions_bound():
    g = GateConfig(metric=CI)
    r = gate_decision(0.02, 0.03, g)
    assert not r.passed and "champion's bound +0.03" in r.reason
    assert gate_decision(0.04, 0.03, g).passed
    # margin above the champion's bound: the margin decides
    assert not gate_decision(0.035, 0.03, GateConfig(metric=CI, margin=0.04)).passed
    # a champion whose own bound was below 0 does not lower the bar under the margin
    assert not gate_decision(-0.001, -0.02, g).passed


def test_upper_bound_for_lower_is_better_metrics_and_direction_checks():
    up = "eval.some.loss.delta_ci_high"
    assert gate_decision(-0.02, None, GateConfig(metric=up, direction="min")).passed
    assert not gate_decision(0.01, None, GateConfig(metric=up, direction="min")).passed
    assert not gate_decision(-0.02, -0.03, GateConfig(metric=up, direction="min")).passed
    with pytest.raises(UserError, match="direction=max"):
        gate_decision(0.1, None, GateConfig(metric=CI, direction="min"))
    with pytest.raises(UserError, match="no value"):
        gate_decision(None, 0.1, GateConfig(metric=CI))


def test_plain_metrics_keep_their_semantics():
    g = GateConfig(metric="eval.hpdv2.hpsv3", margin=0.01)
    assert gate_decision(0.5, None, g).passed  # no champion -> pass
    assert gate_decision(0.52, 0.5, g).passed and not gate_decision(0.505, 0.5, g).passed

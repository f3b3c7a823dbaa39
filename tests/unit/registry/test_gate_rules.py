"""Rules of `chunkgrpo.registry.gate` that no MLflow-backed test reaches: evaluation-run checks, run metric
names, the initial gate, the recorded-gate snapshot, the audit log's bounds and the lock-suffix name rule."""

from __future__ import annotations

import json

import pytest

from chunkgrpo.errors import UserError
from chunkgrpo.registry import gate


def test_only_a_finished_evaluation_run_is_trusted():
    gate.check_eval_run("r1", "evaluate", "FINISHED")
    with pytest.raises(UserError, match="not an evaluation run"):
        gate.check_eval_run("r1", "train", "FINISHED")
    with pytest.raises(UserError, match="is RUNNING, not FINISHED"):
        gate.check_eval_run("r1", "evaluate", "RUNNING")


def test_run_metric_names():
    assert gate.registry_metrics({"hpdv2.hpsv3.trained": 0.3, "hpdv2.hpsv3.base": 0.2}) == {
        "eval.hpdv2.hpsv3": 0.3, "eval.hpdv2.hpsv3.base": 0.2}
    keys = {"hpdv2.hpsv3.trained", "hpdv2.hpsv3.delta_ci_low"}
    assert gate.run_metric_key("eval.hpdv2.hpsv3", keys) == "hpdv2.hpsv3.trained"
    assert gate.run_metric_key("eval.hpdv2.hpsv3.delta_ci_low", keys) == "hpdv2.hpsv3.delta_ci_low"
    assert gate.run_metric_key("eval.geneval.overall", keys) is None


def test_trusted_value_is_logged_once_and_finite():
    assert gate.trusted_value("r", "3", "k", [0.25]) == 0.25
    with pytest.raises(UserError, match="logged k 0 times"):
        gate.trusted_value("r", "3", "k", [])
    with pytest.raises(UserError, match="is not finite"):
        gate.trusted_value("r", "3", "k", [1.7976931348623157e308])  # MLflow's stand-in for +inf


def test_initial_gate_needs_a_direction():
    assert gate.initial_gate(None, None) == (gate.DEFAULT_GATE_METRIC, "max")
    assert gate.initial_gate("eval.fid", "min") == ("eval.fid", "min")
    with pytest.raises(UserError, match="no known direction"):
        gate.initial_gate("eval.fid", None)


def test_snapshot_gate_falls_back_on_anything_unusable():
    snap = json.dumps({"metric": "eval.hpdv2.hpsv3", "direction": "max", "margin": 0.01})
    want = gate.GateConfig(metric="eval.hpdv2.hpsv3", direction="max", margin=0.01)
    assert gate.snapshot_gate(snap) == want
    for text in (None, "", "{not json", json.dumps({"metric": "m", "direction": "up"}), json.dumps([1])):
        assert gate.snapshot_gate(text) is None


def test_the_audit_log_is_one_tag_per_entry_and_keeps_every_entry():
    """Each entry has a key of its own (time-ordered); nothing is dropped however many there are, an
    older registry's `promotion.log` list comes first, a long reason is cut so the entry fits one tag."""
    tags = {gate.LOG_TAG: json.dumps([{"version": "old"}])}
    for i in range(50):
        key, value = gate.log_entry({"version": str(i)}, 1_000 + i, f"t{i:02d}")
        assert key not in tags and len(value) <= gate.MAX_TAG
        tags[key] = value
    entries = gate.log_entries(tags)
    assert [e["version"] for e in entries] == ["old", *map(str, range(50))]
    key, value = gate.log_entry({"why": "x" * 60_000}, 5_000, "big")
    assert len(value) <= gate.MAX_TAG and json.loads(value)["why"] == "x" * gate.MAX_WHY


def test_only_the_gate_moves_protected_aliases():
    gate.check_alias("challenger")
    gate.check_alias("canary-2")
    for alias in ("champion", "Champion", "previous", "latest", "v3", "a/b", "", "x" * 65, None, 7):
        with pytest.raises(UserError):
            gate.check_alias(alias)


def test_an_evaluation_counts_only_for_the_weights_it_scored():
    gate.check_weights_bound("r1", "a" * 64, "a" * 64, "3")
    with pytest.raises(UserError, match="records no weights digest"):
        gate.check_weights_bound("r1", None, "a" * 64, "3")
    with pytest.raises(UserError, match="scored other weights"):
        gate.check_weights_bound("r1", "b" * 64, "a" * 64, "3")
    with pytest.raises(UserError, match="re-register"):
        gate.check_weights_bound("r1", "b" * 64, "", "3")


def test_lock_suffix_is_reserved():
    gate.check_name("chunkgrpo-flux")
    with pytest.raises(UserError, match="reserved for promotion locks"):
        gate.check_name("chunkgrpo-flux" + gate.LOCK_SUFFIX)
    with pytest.raises(UserError, match="at most"):
        gate.check_name("m" * (gate.MAX_NAME_LEN + 1))

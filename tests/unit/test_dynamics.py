"""Dynamics profiling records both trajectory kinds; planning reads the chosen one and says which."""

import json

import pytest

from chunkgrpo.chunks import plan_from_profile
from chunkgrpo.dynamics import ProfileConfig, profile_model, write_profile
from chunkgrpo.errors import UserError


def test_profile_has_sde_and_ode_curves_and_the_plan_records_which(tiny_model, tmp_path):
    cfg = ProfileConfig.from_dict({"model": "tiny", "seeds": 1, "sampling": {
        "num_steps": 8, "height": 64, "width": 64, "max_sequence_length": 16, "eta": 0.7, "rule": "flow"}})
    assert cfg.trajectories == "sde" and cfg.sampling.stochastic == "all"  # training SDE by default
    prof = profile_model(tiny_model, ["a cat", "a red car"], cfg, progress=False)
    sde, ode = prof["l1rel_sde"], prof["l1rel_ode"]
    assert len(sde) == len(ode) == 8 and prof["l1rel"] == sde and prof["trajectories"] == "sde"
    assert sde[0] > 2 * ode[0]  # the injected noise dominates the first (high-σ) step
    assert sde[-1] == pytest.approx(ode[-1], rel=0.5)  # the last transition is deterministic in both
    path = write_profile(prof, tmp_path / "profile.json")
    assert path.with_suffix(".png").stat().st_size > 1000
    plan, out = plan_from_profile(path, "dynamics", tmp_path / "plan.json")
    assert json.loads(out.read_text())["trajectories"] == "sde"
    ode_plan, _ = plan_from_profile(path, "dynamics", tmp_path / "plan_ode.json", trajectories="ode")
    assert ode_plan["trajectories"] == "ode"
    assert ode_plan["chunks"][0]["mean_l1rel"] == pytest.approx(
        sum(ode[: ode_plan["sizes"][0]]) / ode_plan["sizes"][0]
    )


def test_old_profiles_are_ode_and_missing_curves_are_a_clear_error(tmp_path):
    p = tmp_path / "old.json"
    p.write_text(json.dumps({"sigmas": [1, 0.7, 0.4, 0.2, 0], "l1rel": [0.3, 0.2, 0.15, 0.1]}))
    plan, _ = plan_from_profile(p, "uniform:1", tmp_path / "plan.json")
    assert plan["trajectories"] == "ode"
    with pytest.raises(UserError, match="no SDE curve"):
        plan_from_profile(p, "uniform:1", tmp_path / "plan2.json", trajectories="sde")

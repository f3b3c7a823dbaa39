"""The toy-world ablation harness: the SDE dynamics plan, equal budgets by construction (transitions per
sample for step/chunk arms, cumulative transformer samples for branching arms), the pre-registered primary
endpoint with learning curves, and resuming from the per-run cache."""

import json
import math

import pytest
import torch

from chunkgrpo.chunks import plan_chunks, training_plan
from chunkgrpo.errors import UserError
from chunkgrpo.objectives import select_units
from chunkgrpo.toy.ablation import AblationConfig, dynamics_plan, run_ablation
from chunkgrpo.toy.ablation_design import PRIMARY, design, expected_transitions
from chunkgrpo.toy.ablation_runs import _train_overrides
from chunkgrpo.toy.model import ToyModelConfig, build_toy_model
from chunkgrpo.toy.power import mean_ci
from chunkgrpo.train.config import TrainConfig
from tests.unit.test_chunks import _gaussian_profile


@pytest.fixture(scope="module")
def tiny_toy(tmp_path_factory):
    root = tmp_path_factory.mktemp("toy")
    return build_toy_model(
        root / "model",
        ToyModelConfig(steps=20, batch_size=8, pool=256, eval_per_category=0, sample_steps=4),
        cache_dir=root / "cache",
        progress=False,
    )


def test_mean_ci_is_the_student_t_interval():
    c = mean_ci([1.0, 2.0, 3.0])
    assert c["mean"] == pytest.approx(2.0) and c["sd"] == pytest.approx(1.0)
    assert c["ci95"] == pytest.approx(4.3027 / math.sqrt(3), abs=1e-4)  # t(0.975, df=2) · sd / √n
    assert math.isnan(mean_ci([0.5])["ci95"]) and mean_ci([])["n"] == 0


def test_config_is_validated():
    with pytest.raises(UserError, match="nope"):
        AblationConfig(methods=["step_flow", "nope"])
    with pytest.raises(UserError, match="seeds=-1"):
        AblationConfig(seeds=-1)
    with pytest.raises(UserError, match="primary comparison"):
        AblationConfig(methods=["step_flow", "tempflow"])
    with pytest.raises(UserError, match="multiple of eval_points"):
        AblationConfig(steps=10, eval_points=4)
    assert AblationConfig().primary_seeds() == 27  # Δ 0.03 at the v1 paired sd 0.053, 80 % power


def test_sde_profile_gives_the_plan_and_differs_from_the_ode(tiny_toy, tmp_path):
    """The dynamics arm is planned on the training SDE: profile.json's SDE curve differs from its ODE curve on
    a stochastic sampler, and plan.json is what the planner gives on the SDE curve (v1 passed an ODE sampler,
    so both curves were the ODE's, value for value)."""
    cfg = AblationConfig(model=str(tiny_toy), profile_prompts=2, profile_seeds=1)
    train_cfg = TrainConfig.load("toy_cpu", [f"model={tiny_toy}"])
    assert train_cfg.sampling.eta > 0 and train_cfg.sampling.num_steps == 10
    prompts = (tiny_toy / "toy" / "train_prompts.txt").read_text().splitlines()
    plan = dynamics_plan(cfg, str(tiny_toy), prompts, tmp_path, train_cfg)
    prof = json.loads((tmp_path / "profile.json").read_text())
    sde, ode = prof["l1rel_sde"], prof["l1rel_ode"]
    assert prof["sampling"]["stochastic"] != "none" and prof["trajectories"] == "sde"
    assert max(abs(a - b) / max(abs(b), 1e-9) for a, b in zip(sde[:-1], ode[:-1])) > 0.05
    assert plan["trajectories"] == "sde" and plan["sizes"] == plan_chunks("dynamics", 9, sde).sizes
    # on a profile of the SDE's shape at N = 10 (exact Gaussian flow, η 0.7) the planner gives [2, 3, 4]
    assert plan_chunks("dynamics", 9, _gaussian_profile(10, stochastic=True)).sizes == [2, 3, 4]
    # the design check alone (report-only, nothing trained): an interim report with the power calculation
    res = run_ablation(
        AblationConfig(
            model=str(tiny_toy),
            out=str(tmp_path),
            profile_prompts=2,
            profile_seeds=1,
            plan="sizes:2,3,4",
            compute=False,
        )
    )
    assert res["computed_runs"] == 0 and res["primary"]["status"] == "interim" and res["methods"] == {}
    assert res["power"]["planned_seeds"] == 27 and res["design"]["transitions_per_sample"] == 6
    assert "INTERIM" in (tmp_path / "ablation.md").read_text()


def _engine_transitions(cfg: TrainConfig, draws: int = 4000) -> float:
    """Mean trained transitions per sample under the engine's own unit selection for this config."""
    sizes = torch.tensor(training_plan(cfg.method, cfg.chunks, cfg.trainable_steps).sizes,
                         dtype=torch.float64)
    mask = select_units(draws, len(sizes), cfg.timestep_fraction, generator=torch.Generator().manual_seed(0))
    return float((mask.double() * sizes).sum(1).mean())


@pytest.mark.parametrize("num_steps,fraction,plan,uniform,T", [
    (10, 0.6667, [2, 3, 4], "uniform:3", 6),      # N = 10: 2 of 3 chunks = 6 of 9 steps
    (17, 0.5, [2, 3, 4, 7], "uniform:4", 8),      # the paper: 2 of 4 chunks = 8 of 16 steps
])
def test_step_and_chunk_arms_train_equal_transitions(tmp_path, num_steps, fraction, plan, uniform, T):
    """Computed from the arms' training configs (as the runs get them) by the engine's chunk sizes and its
    unit selection: every step and unweighted chunk arm trains T transitions per sample in expectation."""
    (tmp_path / "plan.json").write_text(json.dumps({"sizes": plan}))
    cfg = AblationConfig(timestep_fraction=fraction, uniform=uniform, steps=72)
    base = TrainConfig.load("toy_cpu", [f"sampling.num_steps={num_steps}"])
    des = design(cfg, base, plan)
    assert des["transitions_per_sample"] == T and des["sample_budget"] == 72 * 16 * (num_steps + T)
    for m in ("step_flow", "step_dance", "chunk_uniform", "chunk_dynamics"):
        spec = {
            "method": m,
            "arm": des["arms"][m],
            "plan_path": str(tmp_path / "plan.json"),
            "uniform": uniform,
            "overrides": [f"sampling.num_steps={num_steps}"],
            "model": "m",
            "prompts": "p",
            "seed": 0,
            "steps": 72,
        }
        tc = TrainConfig.load("toy_cpu", _train_overrides(spec))
        sizes = training_plan(tc.method, tc.chunks, tc.trainable_steps).sizes
        exact = expected_transitions(sizes, tc.timestep_fraction)
        assert exact == T, (m, sizes, tc.timestep_fraction)
        assert _engine_transitions(tc) == pytest.approx(T, abs=0.15), m
        assert des["arms"][m]["transitions_per_sample"] == T


def test_a_design_with_unequal_budgets_is_refused():
    base = TrainConfig.load("toy_cpu", [])
    with pytest.raises(UserError, match=r"4\.5 transitions per sample"):  # v1's [5, 4] plan at fraction 0.5
        design(AblationConfig(timestep_fraction=0.5), base, [5, 4])
    with pytest.raises(UserError, match="unequal budgets"):  # uniform:2 = [2, 2, 2, 2, 1]: 3 of 5 = 5.4 ≠ 6
        design(AblationConfig(uniform="uniform:2"), base, [2, 3, 4])


def test_two_seed_two_checkpoint_ablation_writes_curves_endpoint_and_resumes(tiny_toy, tmp_path):
    out = tmp_path / "ablation"
    cfg = AblationConfig(
        model=str(tiny_toy),
        out=str(out),
        methods=["step_flow", "chunk_dynamics", "tempflow", "granular"],
        seeds=2,
        secondary_seeds=1,
        steps=2,
        eval_points=2,
        eval_per_category=1,
        eval_samples=1,
        plan="sizes:1,2,3",
        uniform="uniform:2",
        progress=False,
        overrides=["sampling.num_steps=7", "group_size=4", "grad_accum=8"],
    )
    result = run_ablation(cfg)
    assert (
        result["computed_runs"] == 2 * 3 + 2
    )  # (base + primary pair) × 2 seeds, then 1 seed of each branch arm
    methods = result["methods"]
    des = result["design"]
    assert des["transitions_per_sample"] == 4 and des["sample_budget"] == 2 * 8 * (7 + 4)
    for m in PRIMARY:
        e = methods[m]
        assert e["seeds"] == [0, 1] and e["optimizer_steps"] == [2]  # equal optimizer steps
        assert [c["point"] for c in e["curve"]] == [0, 1, 2]  # base + 2 checkpoints
        assert [c["optimizer_step"] for c in e["curve"]] == [0, 1, 2]
        assert math.isfinite(e["overall"]["ci95"]) and 0 <= e["overall"]["mean"] <= 1
    assert methods["step_flow"]["transitions_per_sample"]["mean"] == 4  # measured by the engine: 4 of 6 steps
    assert methods["chunk_dynamics"]["chunk_sizes"] == [1, 2, 3] == result["plan"]["sizes"]
    # branching arms stop at equal cumulative transformer samples: at the budget, within one iteration
    budget = des["sample_budget"]
    for m in ("tempflow", "granular"):
        run = json.loads((out / "runs" / m / "seed-0.json").read_text())
        samples = [x for _, _, x in run["reward_curve"]]
        last_iteration = samples[-1] - (samples[-2] if len(samples) > 1 else 0)
        assert budget <= run["transformer_samples"] < budget + last_iteration, m
        assert samples[-2] < budget if len(samples) > 1 else True
        assert [c["transformer_samples"] >= budget * c["point"] / 2 for c in run["curve"]] == [True, True]
        assert run["rewards"] > 0 and methods[m]["rewards"]["mean"] == run["rewards"]
    # the pre-registered primary endpoint, in the results file with its paired curve
    saved = json.loads((out / "ablation.json").read_text())
    pr = saved["primary"]
    assert (pr["a"], pr["b"], pr["seeds"]) == ("chunk_dynamics", "step_flow", [0, 1])
    assert "final evaluation point" in pr["metric"] and pr["powered_for"]["delta"] == 0.03
    d = [methods["chunk_dynamics"]["overall"]["values"][i] - methods["step_flow"]["overall"]["values"][i]
         for i in (0, 1)]
    assert pr["diff"]["mean"] == pytest.approx(sum(d) / 2) and pr["status"] == "final"
    prim = next(p for p in saved["paired"] if p["role"] == "primary")
    assert [c["point"] for c in prim["curve"]] == [0, 1, 2] and prim["curve"][0]["diff"][
        "mean"
    ] == 0  # same base
    assert {p["role"] for p in saved["paired"]} == {"primary", "secondary"}
    assert all("p_holm" in p for p in saved["paired"] if p["role"] == "secondary")
    assert saved["power"]["planned_seeds"] == 2 and saved["power"]["seeds_for"]["0.03"] == 27
    md = (out / "ablation.md").read_text()
    assert "Pre-registered primary endpoint" in md and "Budgets" in md and "Power calculation" in md
    assert (out / "curves.png").stat().st_size > 0 and (out / "reward_curves.png").stat().st_size > 0
    # a second call resumes: nothing recomputed, the same numbers
    again = run_ablation(cfg)
    assert again["computed_runs"] == 0
    assert again["methods"]["chunk_dynamics"]["overall"] == methods["chunk_dynamics"]["overall"]


def test_series_key_changes_with_engine_or_configuration_not_with_seeds(monkeypatch):
    """The nightly series: more seeds extend the same series; a changed engine, budget or override starts a
    new one (cached runs keyed by it are never mixed across)."""
    import dataclasses

    import chunkgrpo.toy.ablation as ablation

    cfg = AblationConfig()
    prep = {"meta": {"key": "toy-1"}, "plan": {"sizes": [2, 3, 4]},
            "design": design(cfg, TrainConfig.load("toy_cpu", []), [2, 3, 4])}
    key = ablation.series_key(cfg, prep)
    assert ablation.series_key(dataclasses.replace(cfg, seeds=40, first_seed=3), prep) == key
    assert ablation.series_key(dataclasses.replace(cfg, steps=144), prep) != key
    assert ablation.series_key(dataclasses.replace(cfg, overrides=["lr=0.002"]), prep) != key
    assert ablation.series_key(cfg, {**prep, "meta": {"key": "toy-2"}}) != key  # another base model
    monkeypatch.setattr(ablation, "engine_fingerprint", lambda: "changed-engine")
    assert ablation.series_key(cfg, prep) != key


def test_the_committed_n10_plan_is_the_planners_on_the_committed_sde_profile():
    """benchmarks/results/ablation-toy-v2/n10: the toy model's SDE profile at N = 10 (η 0.7, rule flow) is
    not its ODE profile, and the planner on the SDE curve gives the committed plan, [2, 3, 4]."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[3] / "benchmarks" / "results" / "ablation-toy-v2" / "n10"
    prof = json.loads((root / "profile.json").read_text())
    plan = json.loads((root / "plan.json").read_text())
    assert (
        prof["sampling"]["stochastic"] == "all" and prof["sampling"]["eta"] == 0.7 and prof["num_steps"] == 10
    )
    assert (
        prof["l1rel_sde"][0] > 10 * prof["l1rel_ode"][0]
    )  # early SDE steps are noise-dominated, ODE ones are not
    assert plan["trajectories"] == "sde" and plan["sizes"] == [2, 3, 4]
    assert plan_chunks("dynamics", 9, prof["l1rel_sde"]).sizes == [2, 3, 4]
    assert plan_chunks("dynamics", 9, prof["l1rel_ode"]).sizes != [2, 3, 4]  # v1's plan came from this curve


def test_the_engine_fingerprint_covers_training_and_evaluation_not_the_report():
    """What makes cached runs stale: the training/evaluation code and presets (the runs' own harness
    included), never the report (aggregation, Markdown, plots)."""
    from pathlib import Path

    import chunkgrpo
    from chunkgrpo.toy.ablation_runs import engine_files

    root = Path(chunkgrpo.__file__).resolve().parent
    names = {f.relative_to(root).as_posix() for f in engine_files()}
    assert {"config.py", "train/trainer.py", "toy/model.py", "toy/ablation_runs.py", "toy/ablation_design.py",
            "presets/toy_cpu.yaml"} <= names
    assert "toy/ablation_report.py" not in names


def test_engine_pin_is_for_reports_only():
    with pytest.raises(UserError, match="only a report-only run"):
        AblationConfig(engine_pin="0123456789abcdef")
    assert AblationConfig(engine_pin="0123456789abcdef", compute=False).engine_pin == "0123456789abcdef"


def test_a_fixed_smaller_seed_count_is_not_called_powered():
    from chunkgrpo.toy.ablation_report import _powered_line

    pf = {"delta": 0.03, "sd": 0.053, "power": 0.8, "seeds": 8}
    power = {"seeds_for": {"0.03": 27}, "power_at_planned": 0.2834}
    line = _powered_line(pf, power)
    assert "Powered for" not in line and "Seeds fixed at 8" in line and "power 0.28" in line
    assert _powered_line({**pf, "seeds": 27}, power).startswith("- Powered for Δ = 0.03")

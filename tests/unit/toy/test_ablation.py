"""The toy-world ablation harness: a two-seed, few-step run of step-level vs dynamics-chunk GRPO from the
same base writes its JSON/Markdown/PNG, pairs seeds, and resumes from its per-run cache."""

import json
import math

import pytest

from chunkgrpo.errors import UserError
from chunkgrpo.toy.ablation import AblationConfig, mean_ci, run_ablation
from chunkgrpo.toy.model import ToyModelConfig, build_toy_model


def test_mean_ci_is_the_student_t_interval():
    c = mean_ci([1.0, 2.0, 3.0])
    assert c["mean"] == pytest.approx(2.0) and c["sd"] == pytest.approx(1.0)
    assert c["ci95"] == pytest.approx(4.303 / math.sqrt(3))  # t(0.975, df=2) · sd / √n
    assert math.isnan(mean_ci([0.5])["ci95"]) and mean_ci([])["n"] == 0


def test_config_is_validated():
    with pytest.raises(UserError, match="nope"):
        AblationConfig(methods=["step_flow", "nope"])
    with pytest.raises(UserError, match="seeds=0"):
        AblationConfig(seeds=0)


def test_two_seed_ablation_writes_its_table_and_resumes(tmp_path):
    model = build_toy_model(tmp_path / "model", ToyModelConfig(steps=20, batch_size=8, pool=256, eval_per_category=0,
                                                               sample_steps=4), cache_dir=tmp_path / "cache",
                            progress=False)
    out = tmp_path / "ablation"
    cfg = AblationConfig(model=str(model), out=str(out), methods=["step_flow", "chunk_dynamics"], seeds=2, steps=2,
                         eval_per_category=1, eval_samples=1, profile_prompts=2, profile_seeds=1, progress=False,
                         overrides=["sampling.num_steps=6", "group_size=4", "grad_accum=8"])
    result = run_ablation(cfg)
    assert result["computed_runs"] == 6  # base + 2 methods, 2 seeds each
    methods = result["methods"]
    assert set(methods) == {"base", "step_flow", "chunk_dynamics"}
    for m in ("step_flow", "chunk_dynamics"):
        e = methods[m]
        assert e["seeds"] == [0, 1] and e["optimizer_steps"] == [2]  # equal optimizer steps
        assert len(e["reward_curve"]) == 2 and e["transformer_samples"]["mean"] > 0
        assert math.isfinite(e["overall"]["ci95"]) and 0 <= e["overall"]["mean"] <= 1
        assert set(e["tasks"]) == {"single_object", "two_object", "counting", "colors", "position", "color_attr"}
    assert methods["chunk_dynamics"]["chunk_sizes"] == result["plan"]["sizes"] and sum(result["plan"]["sizes"]) == 5
    assert methods["step_flow"]["chunk_sizes"] == [1] * 5
    pair = result["paired"][0]
    assert (pair["a"], pair["b"], pair["seeds"]) == ("chunk_dynamics", "step_flow", [0, 1])
    d = [methods["chunk_dynamics"]["overall"]["values"][i] - methods["step_flow"]["overall"]["values"][i] for i in (0, 1)]
    assert pair["diff"]["mean"] == pytest.approx(sum(d) / 2)
    md = (out / "ablation.md").read_text()
    assert "| comparison |" in md and "Chunk-GRPO, dynamics plan" in md and "step-level GRPO (flow)" in md
    assert (out / "reward_curves.png").stat().st_size > 0 and (out / "plan.json").exists()
    assert json.loads((out / "ablation.json").read_text())["methods"]["base"]["seeds"] == [0, 1]
    # a second call resumes: nothing recomputed, the same numbers
    again = run_ablation(cfg)
    assert again["computed_runs"] == 0
    assert again["methods"]["chunk_dynamics"]["overall"] == methods["chunk_dynamics"]["overall"]

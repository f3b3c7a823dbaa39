"""The training presets against the scripts they reproduce, and the training-length unit."""

import pytest
import torch

from chunkgrpo.errors import UserError
from chunkgrpo.train import branching as br
from chunkgrpo.train.config import TrainConfig
from chunkgrpo.train.methods import get_method
from chunkgrpo.train.trainer import Trainer, run_training

FLUX_PRESETS = [
    "chunk_grpo_flux",
    "chunk_grpo_ws_flux",
    "step_grpo_flux",
    "dance_grpo_flux",
    "tempflow_grpo_flux",
    "granular_grpo_flux",
]


def optimizer_steps(cfg: TrainConfig) -> int:
    per = get_method(cfg.method).steps_per_iteration(cfg)
    return cfg.max_iterations * per if cfg.max_iterations else cfg.max_steps


def test_chunk_recipe_trains_151_rollouts_that_are_302_optimizer_steps():
    for name in ("chunk_grpo_flux", "chunk_grpo_ws_flux", "step_grpo_flux"):
        c = TrainConfig.load(name)
        assert (c.max_iterations, c.max_steps) == (151, 0), name  # GCPO: max_train_steps 151 rollouts
        assert c.samples_per_rank // c.grad_accum == 2  # 2 prompts × 12 generations, accumulation 12
        assert optimizer_steps(c) == 302, name
    assert optimizer_steps(TrainConfig.load("dance_grpo_flux")) == 600  # DanceGRPO: 300 rollouts
    assert optimizer_steps(TrainConfig.load("granular_grpo_flux")) == 301 * 8  # one step per k = 0..7
    assert optimizer_steps(TrainConfig.load("tempflow_grpo_flux")) == 500  # 250 epochs × 2


def test_chunk_preset_is_the_authors_script():
    c = TrainConfig.load("chunk_grpo_flux")
    s = c.sampling
    assert (s.num_steps, s.schedule, s.shift, s.quantize_timesteps, s.eta, s.rule, s.height, s.width) == \
        (17, "shift", 3.0, True, 0.7, "flow", 720, 720)
    assert (c.method, c.chunks, c.group_size, c.prompts_per_rank, c.grad_accum, c.timestep_fraction) == \
        ("chunk", "sizes:2,3,4,7", 12, 2, 12, 0.5)
    assert (c.clip_low, c.clip_high, c.adv_clip, c.lr, c.weight_decay, c.max_grad_norm, c.warmup_steps) == \
        (5e-5, 5e-5, 5.0, 1e-5, 1e-4, 0.01, 0)
    assert (c.adv_std, c.adv_eps, c.lora.enabled, c.seed, c.rewards[0].name) == (
        "unbiased",
        1e-8,
        False,
        42,
        "hpsv3",
    )
    assert TrainConfig.load("chunk_grpo_ws_flux").method == "chunk+ws"


def test_step_baseline_preset_is_the_chunk_recipe_with_every_chunk_one_step():
    """The paper's step-level row (GCPO finetune_hpsv3.sh): identical to the chunk recipe except the unit."""
    chunk, step = TrainConfig.load("chunk_grpo_flux").to_dict(), TrainConfig.load("step_grpo_flux").to_dict()
    differ = {k for k in chunk if chunk[k] != step[k]}
    assert differ == {"method"}, differ  # (`chunks` is ignored at step level)
    assert step["method"] == "dance"  # step level: every trainable step its own unit
    s = TrainConfig.load("step_grpo_flux")
    assert (s.sampling.num_steps, s.sampling.rule, s.sampling.eta, s.timestep_fraction, s.clip_low) == \
        (17, "flow", 0.7, 0.5, 5e-5)
    assert int(s.trainable_steps * s.timestep_fraction) == 8  # 8 of the 16 trainable steps per sample


def test_dance_preset_is_dancegrpos_own_script():
    d = TrainConfig.load("dance_grpo_flux")
    s = d.sampling
    assert (d.method, s.num_steps, s.rule, s.eta, s.shift, s.height) == ("dance", 16, "dance", 0.3, 3.0, 720)
    assert (d.timestep_fraction, d.clip_low, d.clip_high, d.lr, d.max_grad_norm, d.grad_accum) == \
        (0.6, 1e-4, 1e-4, 1e-5, 0.01, 12)
    assert int(d.trainable_steps * d.timestep_fraction) == 9  # "ignore_last": 9 of 15 steps
    assert (d.max_iterations, d.rewards[0].name) == (300, "hpsv2.1")
    assert (d.ema.decay, d.ema.every, d.ema.warmup) == (0.995, 1, False)  # --use_ema --ema_decay 0.995
    assert TrainConfig.load("chunk_grpo_flux").ema.decay == 0 == TrainConfig.load("step_grpo_flux").ema.decay


def test_branching_presets_follow_the_released_code():
    t = TrainConfig.load("tempflow_grpo_flux")
    assert (
        t.method,
        t.sampling.num_steps,
        t.sampling.schedule,
        t.sampling.quantize_timesteps,
        t.sampling.eta,
    ) == ("tempflow", 10, "dynamic", False, 0.7)
    assert (t.group_size, br.branch_steps(t), br.update_mode(t)) == (6, list(range(9)), "per_iteration")
    assert (t.kl_ref_coef, t.adv_std, t.adv_eps, t.noise_weight_c, t.clip_low) == (
        0.004,
        "population",
        1e-4,
        1.73,
        1e-4,
    )
    assert (t.lora.enabled, t.lora.rank, t.lora.alpha, t.sampling.height, t.sampling.max_sequence_length) == \
        (True, 32, 64.0, 1024, 128)
    assert (t.ema.decay, t.ema.every, t.ema.warmup) == (0.9, 8, True)
    g = TrainConfig.load("granular_grpo_flux")
    assert (g.method, g.sampling.num_steps, g.sampling.eta, g.sampling.rule, g.group_size) == (
        "granular",
        16,
        0.7,
        "flow",
        12,
    )
    assert (br.branch_steps(g), br.granularities(g), br.update_mode(g)) == (
        list(range(8)),
        [1, 2],
        "per_step",
    )
    assert (g.lr, g.clip_low, g.clip_high, g.max_grad_norm, g.adv_clip) == (2e-6, 1e-4, 1e-4, 1.0, 5.0)
    assert [r.name for r in g.rewards] == ["hpsv2.1", "clip"] and g.reward_weighting == "given"
    paper = TrainConfig.load("granular_grpo_flux", ["granularities=[1,2,3]"])
    assert br.granularities(paper) == [1, 2, 3]


@pytest.mark.parametrize("name",
                         FLUX_PRESETS + ["tiny_cpu", "tempflow_grpo_tiny_cpu", "granular_grpo_tiny_cpu"])
def test_every_preset_loads_with_exactly_one_training_length(name):
    c = TrainConfig.load(name)
    assert (c.max_iterations > 0) != (c.max_steps > 0)


def test_training_length_unit_is_explicit():
    base = ["model=m", "prompts=p"]
    with pytest.raises(UserError, match="set exactly one of max_iterations"):
        TrainConfig.load("tiny_cpu", [*base, "max_steps=0"])  # neither
    with pytest.raises(UserError, match="set exactly one of max_iterations"):
        TrainConfig.load(
            "chunk_grpo_flux", [*base, "max_steps=10", "max_iterations=5"]
        )  # both on the command line
    # an override of one unit replaces the preset's other one
    c = TrainConfig.load("chunk_grpo_flux", [*base, "max_steps=10"])
    assert (c.max_steps, c.max_iterations) == (10, 0)
    c = TrainConfig.load("tiny_cpu", [*base, "max_iterations=3"])
    assert (c.max_steps, c.max_iterations) == (0, 3)


def test_max_iterations_counts_rollouts_and_max_steps_counts_optimizer_steps(tiny_model_dir, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\na dog\n")
    common = [
        f"model={tiny_model_dir}",
        f"prompts={prompts}",
        "progress=false",
        "grad_accum=4",  # 2 steps/rollout
        "checkpoint.every=0",
        "tracking.image_every=0",
        "sampling.num_steps=4",
        "chunks=sizes:1,2",
    ]
    s = run_training(
        TrainConfig.load("tiny_cpu", [*common, f"output_dir={tmp_path / 'it'}", "max_iterations=2"])
    )
    assert (s["iterations"], s["optimizer_steps"]) == (2, 4)
    s = run_training(TrainConfig.load("tiny_cpu", [*common, f"output_dir={tmp_path / 'st'}", "max_steps=2"]))
    assert (s["iterations"], s["optimizer_steps"]) == (1, 2)


def test_whole_plan_with_half_fraction_is_rejected_not_raised_to_one(tiny_model_dir, tmp_path):
    over = [f"model={tiny_model_dir}", f"prompts={tmp_path}", f"output_dir={tmp_path / 'o'}"]
    (tmp_path / "p.txt").write_text("a cat\n")
    over[1] = f"prompts={tmp_path / 'p.txt'}"
    with pytest.raises(UserError, match=r"trains int\(1×0.5\) = 0 units"):
        Trainer(TrainConfig.load("tiny_cpu", [*over, "chunks=whole", "timestep_fraction=0.5"]))
    Trainer(TrainConfig.load("tiny_cpu", [*over, "chunks=whole", "timestep_fraction=1.0"]))  # fine


def test_reward_weights_as_given_or_normalised(tiny_model_dir, tmp_path):
    (tmp_path / "p.txt").write_text("a cat\n")
    over = [f"model={tiny_model_dir}", f"prompts={tmp_path / 'p.txt'}", f"output_dir={tmp_path / 'o'}",
            "rewards=[{name: brightness, weight: 0.7}, {name: contrast, weight: 1.4}]"]
    assert Trainer(TrainConfig.load("tiny_cpu", over)).reward_weights == {"brightness": 0.7, "contrast": 1.4}
    w = Trainer(TrainConfig.load("tiny_cpu", [*over, "reward_weighting=normalized"])).reward_weights
    assert w == pytest.approx({"brightness": 1 / 3, "contrast": 2 / 3})
    from chunkgrpo.advantages import aggregate_advantages, normalize_group

    r = {"a": torch.tensor([1.0, 2.0, 4.0]), "b": torch.tensor([3.0, 1.0, 2.0])}
    got = aggregate_advantages(r, {"a": 1.0, "b": 3.0}, 3, normalize_weights=True)
    assert torch.allclose(
        got, (0.25 * normalize_group(r["a"], 3) + 0.75 * normalize_group(r["b"], 3)).float()
    )

import json
import math

import pytest
import torch

from chunkgrpo.chunks import ChunkSpec, load_plan, parse_chunks, plan_chunks, plan_from_profile, training_plan
from chunkgrpo.errors import UserError


def _piecewise(knees, slopes, n=17, start=1.0):
    """A profile whose slope changes exactly at the given steps (known knees)."""
    out, v = [], start
    for t in range(n):
        seg = sum(t >= k for k in knees)
        out.append(v)
        v += slopes[seg]
    return out


def test_exact_sizes_for_sizes_and_uniform():
    assert plan_chunks("sizes:2,3,4,7", 16).sizes == [2, 3, 4, 7]
    assert plan_chunks("uniform:4", 16).sizes == [4, 4, 4, 4]
    assert plan_chunks("uniform:2", 16).sizes == [2] * 8
    assert plan_chunks("uniform:5", 16).sizes == [5, 5, 5, 1]
    assert plan_chunks("step", 16).sizes == [1] * 16
    assert plan_chunks("whole", 16).sizes == [16]


def test_dynamics_finds_known_knees():
    p = _piecewise([2, 5], [-0.1, -0.04, -0.01])
    plan = plan_chunks("dynamics", 16, p)
    assert plan.sizes == [2, 3, 4, 7]  # the paper's plan from a profile with knees at 2 and 5
    assert "step 2" in plan.rationale and "step 5" in plan.rationale
    assert plan.details["cuts"] == [2, 5] and plan.details["late_start"] == 9
    # the last chunk is the second half of the N = 17 sampling steps: 9–15 (the final transition is not
    # trained)
    assert plan_chunks("dynamics:last=0.4", 16, p).sizes[-1] == 5  # steps 11–15 (⌈17·0.6⌉ = 11)


def test_dynamics_other_knees_and_max_chunk():
    p = _piecewise([3, 6], [-0.2, -0.05, -0.02])
    assert plan_chunks("dynamics", 16, p).sizes == [3, 3, 3, 7]
    # a smooth decaying profile without interior peaks: early region split, chunks <= max
    q = [0.2 * math.exp(-0.3 * t) + 0.01 for t in range(17)]
    sizes = plan_chunks("dynamics:max=3", 16, q).sizes
    assert sum(sizes) == 16 and all(s <= 3 for s in sizes[:-1]) and sizes[-1] == 7


def _gaussian_profile(num_steps: int, stochastic: bool, eta: float = 0.7, seed: int = 0) -> list[float]:
    """L1rel (Eq. 15) of trajectories of the exact flow of Gaussian data N(0, I):
    v*(x, σ) = (2σ − 1)/var·x with var = (1 − σ)² + σ², sampled with the training SDE (rule "flow") or the
    ODE, shift-3 schedule."""
    from chunkgrpo import schedules, sde
    from chunkgrpo.objectives import l1rel

    sig = schedules.shift_sigmas(num_steps, 3.0)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 4096, generator=g)
    lat = [x]
    for i in range(num_steps):
        a, b = float(sig[i]), float(sig[i + 1])
        v = (2 * a - 1) / ((1 - a) ** 2 + a * a) * x
        if stochastic and i < num_steps - 1:
            x, _ = sde.sde_step(x, v, a, b, eta=eta, rule="flow", noise=torch.randn(x.shape, generator=g))
        else:
            x = sde.ode_step(x, v, a, b)
        lat.append(x)
    return l1rel(torch.stack(lat, 1)).mean(0).tolist()


def test_planner_reproduces_the_papers_chunks_on_a_paper_shaped_profile():
    """Chunk-GRPO App. B.1 at N = 17: [2, 3, 4, 7]. The paper's dynamics are high for the first steps and
    fall afterwards — the shape of the training (SDE) profile; both a hand-written profile of that shape
    and the SDE profile of an exact Gaussian flow give the paper's plan (the ODE profile, which rises
    with the step, does not)."""
    paper_shaped = [0.74, 0.76, 0.55, 0.46, 0.41, 0.38, 0.36, 0.35, 0.34, 0.33, 0.32, 0.31, 0.29, 0.27, 0.24,
                    0.21, 0.14]
    assert plan_chunks("dynamics", 16, paper_shaped).sizes == [2, 3, 4, 7]
    sde_profile = _gaussian_profile(17, stochastic=True)
    ode_profile = _gaussian_profile(17, stochastic=False)
    assert sde_profile[0] > 3 * sde_profile[-1] and ode_profile[0] < ode_profile[-1]  # falls vs rises
    plan = plan_chunks("dynamics", 16, sde_profile)
    assert plan.sizes == [2, 3, 4, 7]
    assert plan.details["cuts"][0] == 2  # the first chunk is the initial high plateau {0, 1}
    assert plan_chunks("dynamics", 16, ode_profile).sizes != [2, 3, 4, 7]


@pytest.mark.parametrize("strategy,match", [
    ("sizes:2,3,4", "sum to 9"), ("sizes:2,0,14", "empty chunk"), ("magic", "unknown chunk strategy"),
    ("uniform:0", ">= 1"), ("uniform:20", "exceeds"), ("dynamics:foo=1", "unknown dynamics option"),
])
def test_bad_plans_are_clear_errors(strategy, match):
    with pytest.raises(UserError, match=match):
        plan_chunks(strategy, 16, [1.0] * 17)


def test_dynamics_needs_profile():
    with pytest.raises(UserError, match="needs a profile"):
        plan_chunks("dynamics", 16)


def test_plan_from_profile_writes_json_and_png(tmp_path):
    prof = {
        "sigmas": [1 - i / 16 for i in range(17)],
        "l1rel": _piecewise([2, 5], [-0.1, -0.04, -0.01], n=16),
        "samples": 4,
    }
    pp = tmp_path / "profile.json"
    pp.write_text(json.dumps(prof))
    plan, out = plan_from_profile(pp, "sizes:2,3,4,6", tmp_path / "plan.json")
    d = json.loads(out.read_text())
    assert d["sizes"] == [2, 3, 4, 6] and d["trainable_steps"] == 15 and len(d["chunks"]) == 4
    assert d["chunks"][1]["steps"] == [2, 4] and d["chunks"][1]["sigma_start"] == prof["sigmas"][2]
    assert (tmp_path / "plan.png").stat().st_size > 1000
    assert load_plan(out, 15) == [2, 3, 4, 6]
    with pytest.raises(UserError, match="num_steps"):
        load_plan(out, 16)


def test_parse_chunks_is_the_one_parser():
    assert parse_chunks(" uniform:3 ") == ChunkSpec("uniform:3", "uniform", size=3)
    assert (
        parse_chunks("sizes:2,3").sizes == (2, 3) and parse_chunks("runs/plan.json").path == "runs/plan.json"
    )
    assert parse_chunks("dynamics:max=4,rel=0.2").options == {"max": 4, "rel": 0.2}
    spec = parse_chunks("sizes:2,3,4,7")
    assert parse_chunks(spec) is spec and plan_chunks(spec, 16).sizes == [2, 3, 4, 7]
    with pytest.raises(UserError, match="bad dynamics option"):
        parse_chunks("dynamics:max=abc")


def test_training_plan_by_method(tmp_path):
    assert training_plan("chunk", "uniform:4", 16).ranges == [(0, 4), (4, 8), (8, 12), (12, 16)]
    assert training_plan("dance", "sizes:2,3,4,7", 16).sizes == [1] * 16  # step-level
    assert training_plan("tempflow", "whatever", 4).sizes == [1] * 4  # branching methods ignore `chunks`
    (tmp_path / "plan.json").write_text(json.dumps({"sizes": [7, 9]}))
    assert training_plan("chunk+ws", str(tmp_path / "plan.json"), 16).sizes == [7, 9]
    assert training_plan("chunk", "/absent/plan.json", 16, read_plan_file=False).sizes == [1] * 16
    with pytest.raises(UserError, match="needs a profile"):
        training_plan("chunk", "dynamics", 16)

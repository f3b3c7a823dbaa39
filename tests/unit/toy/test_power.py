"""The ablation's statistics: paired-t power against scipy and a published value, sample size, minimum
detectable effect, Holm, the evaluation's binomial sd and the sequential stop rule."""

import math
import random

import pytest
from scipy import stats

from chunkgrpo.errors import UserError
from chunkgrpo.toy.power import (
    eval_sd,
    holm,
    mean_ci,
    min_detectable_effect,
    paired_power,
    seeds_needed,
    sequential_decision,
)


def test_paired_power_matches_a_known_case_and_scipy():
    # G*Power, "difference between two dependent means", dz = 0.5, α 0.05 two-sided: n = 34, power 0.8078
    assert paired_power(34, 0.5, 1.0) == pytest.approx(0.8078, abs=5e-4)
    assert seeds_needed(0.5, 1.0) == 34
    # the same with scipy's noncentral t written out, at the ablation's numbers
    n, d, sd = 27, 0.03, 0.053
    crit = stats.t.ppf(0.975, n - 1)
    nc = d / sd * math.sqrt(n)
    assert paired_power(n, d, sd) == pytest.approx(
        stats.nct.sf(crit, n - 1, nc) + stats.nct.cdf(-crit, n - 1, nc)
    )
    # the pre-registered power calculation: seeds for Δ 0.03 / 0.05 / 0.02 at sd 0.053; ≈ 0.09
    # detectable with 5 seeds
    assert [seeds_needed(x, 0.053) for x in (0.03, 0.05, 0.02)] == [27, 11, 58]
    assert min_detectable_effect(5, 0.053) == pytest.approx(0.089, abs=1e-3)
    assert paired_power(26, 0.03, 0.053) < 0.8 <= paired_power(27, 0.03, 0.053)
    assert paired_power(27, min_detectable_effect(27, 0.053), 0.053) == pytest.approx(0.8, abs=1e-6)


def test_power_is_what_a_simulated_paired_t_test_finds():
    rng = random.Random(0)
    n, d, sd, trials = 10, 0.5, 1.0, 3000
    hits = 0
    for _ in range(trials):
        xs = [rng.gauss(d, sd) for _ in range(n)]
        hits += stats.ttest_1samp(xs, 0.0).pvalue < 0.05
    assert hits / trials == pytest.approx(paired_power(n, d, sd), abs=0.03)


def test_bad_power_inputs_are_clear_errors():
    with pytest.raises(UserError, match="n=1"):
        paired_power(1, 0.1, 1.0)
    with pytest.raises(UserError, match="sd=0"):
        paired_power(5, 0.1, 0.0)
    with pytest.raises(UserError, match="delta=0"):
        seeds_needed(0.0, 1.0)


def test_holm_step_down():
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm([0.5, 0.001]) == pytest.approx([0.5, 0.002])
    out = holm([0.02, float("nan")])
    assert out[0] == pytest.approx(0.02) and math.isnan(out[1])  # a missing p is not counted in m


def test_mean_ci_p_value_is_the_one_sample_t_test():
    xs = [0.01, 0.03, -0.02, 0.05, 0.04]
    assert mean_ci(xs)["p"] == pytest.approx(stats.ttest_1samp(xs, 0.0).pvalue)


def test_eval_sd_is_the_binomial_sd_of_the_category_mean():
    acc, n = {"a": 0.6, "b": 0.1, "c": 0.3}, {"a": 96, "b": 96, "c": 256}
    want = math.sqrt(0.6 * 0.4 / 96 + 0.1 * 0.9 / 96 + 0.3 * 0.7 / 256) / 3
    assert eval_sd(acc, n) == pytest.approx(want)


def test_sequential_stop_rule():
    assert sequential_decision([0.1, 0.11, 0.09], min_seeds=5, max_seeds=50)[0] is False  # too few seeds
    stop, why = sequential_decision([0.05, 0.06, 0.04, 0.05, 0.055], min_seeds=5, max_seeds=50)
    assert stop and "excludes 0" in why
    stop, why = sequential_decision([0.001, -0.001] * 10, min_seeds=5, max_seeds=50)
    assert stop and "half-width" in why
    noisy = [0.1, -0.1, 0.12, -0.09, 0.05, -0.06]
    assert sequential_decision(noisy, min_seeds=5, max_seeds=50)[0] is False
    assert sequential_decision(noisy, min_seeds=5, max_seeds=6) == (True, "max_seeds=6 reached")


def test_power_stays_finite_where_scipys_noncentral_t_underflows():
    # two seeds and a tiny observed sd: nct at df = 1 with a huge noncentrality returns NaN in scipy
    assert paired_power(2, 0.424, 1e-4) == 1.0
    assert math.isfinite(min_detectable_effect(2, 1e-4)) and min_detectable_effect(2, 1e-4) > 0

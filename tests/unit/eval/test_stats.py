"""Paired bootstrap CIs and win rates (chunkgrpo.eval.stats): coverage on synthetic paired samples with a
known difference, the benefit of pairing, stratified statistics, significance, and input handling."""

from __future__ import annotations

import numpy as np
import pytest

from chunkgrpo.errors import UserError
from chunkgrpo.eval import stats


def test_coverage_on_paired_samples_with_a_known_difference():
    """300 synthetic experiments, n=60 prompts each: base ~ N(0, 1) (prompt difficulty), trained = 0.6 base +
    N(0.2, 0.8); the true mean difference is 0.2. A 95% interval must cover it in ~95% of experiments
    (binomial s.e. 1.3%): asserted within [0.91, 0.985]."""
    rng = np.random.default_rng(2024)
    true_delta, covered, widths = 0.2, 0, []
    for k in range(300):
        base = rng.normal(0.0, 1.0, 60)
        trained = 0.6 * base + rng.normal(true_delta, 0.8, 60)
        c = stats.paired_bootstrap(trained, base, samples=1000, seed=k)
        covered += c["ci_low"] <= true_delta <= c["ci_high"]
        widths.append(c["ci_high"] - c["ci_low"])
    assert 0.91 <= covered / 300 <= 0.985
    # the interval shrinks like 1/sqrt(n): 4x the prompts -> about half the width
    big = [
        stats.paired_bootstrap(
            0.6 * (b := rng.normal(0, 1, 240)) + rng.normal(0.2, 0.8, 240), b, samples=1000, seed=k
        )
        for k in range(20)
    ]
    ratio = np.mean([c["ci_high"] - c["ci_low"] for c in big]) / np.mean(widths)
    assert 0.4 < ratio < 0.6


def test_pairing_narrows_the_interval():
    """Scores dominated by prompt difficulty: the paired CI is far narrower than the spread of the means and
    detects a small consistent gain that an unpaired comparison could not."""
    rng = np.random.default_rng(1)
    difficulty = rng.normal(0, 5, 200)
    base = difficulty + rng.normal(0, 0.1, 200)
    trained = difficulty + 0.1 + rng.normal(0, 0.1, 200)
    c = stats.paired_bootstrap(trained, base, seed=0)
    assert c["ci_low"] > 0 and c["significance"] == 1
    assert c["ci_high"] - c["ci_low"] < 0.06  # unpaired s.e. of the difference alone is ~0.5
    assert c["win_rate"] > 0.7 and c["win_ci_low"] > 0.5
    assert c["delta"] == pytest.approx(trained.mean() - base.mean())


def test_no_difference_gives_a_ci_containing_zero_and_neutral_significance():
    rng = np.random.default_rng(3)
    base = rng.normal(0, 1, 100)
    trained = base + rng.normal(0, 0.5, 100)
    trained = trained - trained.mean() + base.mean()  # exactly equal means
    c = stats.paired_bootstrap(trained, base, seed=0)
    assert c["ci_low"] < 0 < c["ci_high"] and c["significance"] == 0
    assert stats.significance(c["ci_low"], c["ci_high"]) == 0
    assert stats.significance(0.01, 0.2) == 1 and stats.significance(-0.3, -0.01) == -1
    assert stats.significance(0.0, 0.2) == 0  # touching 0 is not significant
    assert stats.significance(None, 1.0) == 0 and stats.significance(float("nan"), 1.0) == 0


def test_deterministic_and_seeded():
    rng = np.random.default_rng(5)
    b = rng.normal(size=50)
    t = b + rng.normal(0.1, 1, 50)
    assert stats.paired_bootstrap(t, b, seed=11) == stats.paired_bootstrap(t, b, seed=11)
    assert stats.paired_bootstrap(t, b, seed=11)["ci_low"] != stats.paired_bootstrap(t, b, seed=12)["ci_low"]


def test_stratified_statistic_is_the_mean_of_stratum_means():
    """GenEval overall = unweighted mean of task means (tasks of different sizes); resampling stays inside
    tasks."""
    t = [1, 1, 1, 1, 0, 0]
    b = [0, 0, 0, 0, 0, 1]
    tags = ["a", "a", "a", "a", "b", "b"]
    c = stats.paired_bootstrap(t, b, strata=tags, samples=500)
    assert c["delta"] == pytest.approx(((1 - 0) + (0 - 0.5)) / 2)  # task a: +1, task b: -0.5
    assert c["mean_trained"] == pytest.approx(0.5) and c["mean_base"] == pytest.approx(0.25)
    assert c["strata"] == {"a": {"n": 4, "weight": 0.5}, "b": {"n": 2, "weight": 0.5}}
    # task a has no variance inside: every replicate's task-a delta is +1; task b's is 0, -0.5 or -1
    assert c["ci_low"] >= (1 - 1) / 2 - 1e-12 and c["ci_high"] <= (1 + 0) / 2 + 1e-12
    w = stats.paired_bootstrap(t, b, strata=tags, strata_weights={"a": 3, "b": 1}, samples=500)
    assert w["delta"] == pytest.approx(0.75 * 1 + 0.25 * -0.5)
    with pytest.raises(UserError, match="no weight"):
        stats.paired_bootstrap(t, b, strata=tags, strata_weights={"a": 1})


def test_win_rate_counts_strict_wins_ties_and_losses():
    c = stats.paired_bootstrap([1, 1, 0, 0.5, 2], [0, 1, 1, 0.5, 1], samples=200)
    assert c["win_rate"] == pytest.approx(2 / 5) and c["tie_rate"] == pytest.approx(2 / 5)
    assert c["loss_rate"] == pytest.approx(1 / 5)
    assert 0 <= c["win_ci_low"] <= c["win_rate"] <= c["win_ci_high"] <= 1


def test_non_finite_pairs_are_dropped_and_counted():
    c = stats.paired_bootstrap([1.0, float("nan"), 2.0, 3.0], [0.5, 1.0, float("inf"), 2.0], samples=200)
    assert c["n"] == 2 and c["n_dropped"] == 2 and c["delta"] == pytest.approx(0.75)
    empty = stats.paired_bootstrap([float("nan")], [1.0], samples=200)
    assert empty["n"] == 0 and empty["delta"] is None and empty["significance"] == 0


def test_bad_input():
    with pytest.raises(UserError, match="aligned"):
        stats.paired_bootstrap([1, 2], [1])
    with pytest.raises(UserError, match="samples"):
        stats.paired_bootstrap([1], [1], samples=10)
    with pytest.raises(UserError, match="level"):
        stats.paired_bootstrap([1], [1], level=1.5)


def test_too_few_pairs_give_no_interval():
    """One pair would give the degenerate 'interval' [x, x] and call anything significant."""
    c = stats.paired_bootstrap([0.9], [0.2], samples=200)
    assert c["delta"] == pytest.approx(0.7) and c["ci_low"] is None and c["significance"] == 0
    assert "no interval" in c["note"]
    c = stats.paired_bootstrap([1, 2, 3, 4, 5], [0, 1, 2, 3, 4], samples=200)
    assert c["ci_low"] == c["ci_high"] == 1.0 and c["significance"] == 1  # 5 identical differences


# ---- float residue: a tie must stay a tie (issue 24 item 2) ----------------------------------------------
# WISE sub-scores (1, 2, 0) and (1, 1, 2) have the same WiScore, 0.45, in exact arithmetic, but
# (0.7*1 + 0.2*2 + 0.1*0) / 2 and (0.7*1 + 0.2*1 + 0.1*2) / 2 differ by 1.1e-16 in floats.
TIE_T, TIE_B = (1, 2, 0), (1, 1, 2)


def _biology(n_tied=15, n_better=3, n_same=2):
    """A WISE category where most prompts tie (different sub-scores, same WiScore) and a few improve."""
    from chunkgrpo.eval.wise import wiscore

    t = [wiscore(*TIE_T)] * n_tied + [wiscore(2, 2, 2)] * n_better + [0.0] * n_same
    b = [wiscore(*TIE_B)] * n_tied + [wiscore(1, 1, 1)] * n_better + [0.0] * n_same
    return t, b


def test_discrete_ties_with_float_residue_are_ties_and_not_significant():
    """The lower bound is 0 in exact arithmetic (most bootstrap replicates are all ties): it must be
    exactly 0, the cell not significant, and the tied prompts ties, not wins."""
    t, b = _biology()
    c = stats.paired_bootstrap(t, b)
    assert c["ci_low"] == 0.0 and c["ci_high"] > 0
    assert c["significance"] == 0
    assert c["tie_rate"] == pytest.approx(17 / 20) and c["win_rate"] == pytest.approx(3 / 20)
    # the same data mirrored: the upper bound touches 0 from below
    m = stats.paired_bootstrap(b, t)
    assert m["ci_high"] == 0.0 and m["significance"] == 0


def test_all_ties_give_an_exact_zero_delta():
    t, b = _biology(n_tied=20, n_better=0, n_same=0)
    c = stats.paired_bootstrap(t, b)
    assert (c["delta"], c["ci_low"], c["ci_high"]) == (0.0, 0.0, 0.0) and c["significance"] == 0


def test_significance_treats_a_touching_bound_as_zero():
    assert stats.significance(0.0, 0.3) == 0 and stats.significance(-0.2, 0.0) == 0
    assert stats.significance(1e-3, 0.3) == 1 and stats.significance(-0.3, -1e-3) == -1


def test_tolerance_does_not_swallow_real_small_differences():
    """float32 scores one float32 ulp apart are a real (tiny) difference, far above float64 residue."""
    base = np.full(50, 10.0, dtype=np.float32).astype(np.float64)
    trained = np.nextafter(np.float32(10.0), np.float32(11.0)).astype(np.float64) * np.ones(50)
    c = stats.paired_bootstrap(trained, base)
    assert c["win_rate"] == 1.0 and c["ci_low"] > 0 and c["significance"] == 1

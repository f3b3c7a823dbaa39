"""Statistics of the ablation's design: paired-t confidence intervals, power and sample size, the minimum
detectable effect, Holm's step-down correction, the evaluation's own binomial noise and the sequential stop.

All are the textbook formulas on scipy's distributions:

    CI(mean diff)  = d̄ ± t_{0.975, n−1} · s_d / √n                         (paired by seed)
    power(n, Δ, σ) = P(|T| > t_{1−α/2, n−1}),  T ~ noncentral t(n − 1, Δ·√n / σ)   (two-sided paired t)
    n(Δ, σ)        = the smallest n ≥ 2 with power ≥ the target
    MDE(n, σ)      = the Δ with power(n, Δ, σ) = the target
    Holm           = p_(i) · (m − i + 1), made monotone, capped at 1 (i = 1 … m in ascending p)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from chunkgrpo.errors import UserError


def t_quantile(df: int, level: float = 0.95) -> float:
    """Two-sided Student-t quantile t_{(1+level)/2, df} (NaN for df < 1)."""
    from scipy import stats

    return float(stats.t.ppf((1 + level) / 2, df)) if df >= 1 else float("nan")


def mean_ci(values: Sequence[float], level: float = 0.95) -> dict:
    """Mean, sd and the half-width of its t confidence interval (NaN with fewer than 2 values); with ≥ 2
    values also the two-sided one-sample t-test p-value against 0 (for paired differences)."""
    n = len(values)
    if n == 0:
        return {"mean": float("nan"), "ci95": float("nan"), "n": 0, "values": []}
    m = sum(values) / n
    if n < 2:
        return {"mean": m, "ci95": float("nan"), "n": 1, "values": list(values)}
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1))
    out = {
        "mean": m,
        "ci95": t_quantile(n - 1, level) * sd / math.sqrt(n),
        "sd": sd,
        "n": n,
        "values": list(values),
    }
    if sd > 0:
        from scipy import stats

        out["p"] = float(2 * stats.t.sf(abs(m) / (sd / math.sqrt(n)), n - 1))
    else:
        out["p"] = 1.0 if m == 0 else 0.0
    return out


def paired_power(n: int, delta: float, sd: float, alpha: float = 0.05) -> float:
    """Power of the two-sided paired t-test with `n` pairs for a true mean difference `delta` when the
    differences have standard deviation `sd` (noncentral t)."""
    from scipy import stats

    if n < 2:
        raise UserError(f"n={n} pairs: a paired t-test needs at least 2")
    if sd <= 0 or not math.isfinite(sd):
        raise UserError(f"sd={sd} must be a positive finite number")
    df = n - 1
    nc = delta / sd * math.sqrt(n)
    crit = stats.t.ppf(1 - alpha / 2, df)
    power = float(stats.nct.sf(crit, df, nc) + stats.nct.cdf(-crit, df, nc))
    if not math.isfinite(power):  # scipy's noncentral t underflows far in the tail (tiny df, huge nc)
        power = float(stats.nct.sf(crit, df, abs(nc))) if abs(nc) < 1e3 else 1.0
        power = power if math.isfinite(power) else 1.0
    return power


def seeds_needed(
    delta: float, sd: float, power: float = 0.8, alpha: float = 0.05, max_n: int = 100_000
) -> int:
    """The smallest number of paired seeds whose two-sided paired t-test detects `delta` with `power`."""
    if delta == 0:
        raise UserError("delta=0: no number of seeds detects a zero difference")
    if not 0 < power < 1:
        raise UserError(f"power={power} must be in (0, 1)")
    lo, hi = 2, 2
    while paired_power(hi, delta, sd, alpha) < power:
        lo, hi = hi, hi * 2
        if hi > max_n:
            raise UserError(f"more than {max_n} seeds needed for delta={delta}, sd={sd}")
    while lo < hi:  # power grows with n: bisect for the first n that reaches it
        mid = (lo + hi) // 2
        if paired_power(mid, delta, sd, alpha) >= power:
            hi = mid
        else:
            lo = mid + 1
    return lo


def min_detectable_effect(n: int, sd: float, power: float = 0.8, alpha: float = 0.05) -> float:
    """The mean difference a two-sided paired t-test with `n` seeds detects with `power` (NaN for n < 2)."""
    from scipy.optimize import brentq

    if n < 2 or not (sd > 0 and math.isfinite(sd)):
        return float("nan")
    hi = sd
    while paired_power(n, hi, sd, alpha) < power:
        hi *= 2
    return float(brentq(lambda d: paired_power(n, d, sd, alpha) - power, 0.0, hi, xtol=1e-10))


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values (same order as given; NaN stays NaN and is not counted)."""
    idx = [i for i, p in enumerate(pvalues) if p == p]
    m = len(idx)
    order = sorted(idx, key=lambda i: pvalues[i])
    adj = [float("nan")] * len(pvalues)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        adj[i] = running
    return adj


def eval_sd(accuracy: dict[str, float], images: dict[str, int]) -> float:
    """Binomial sd of a GenEval overall score (the mean of the per-category accuracies) from its images:
    sqrt(Σ_c p_c(1 − p_c)/n_c) / C, treating images as independent draws."""
    cats = [c for c in accuracy if images.get(c)]
    if not cats:
        return float("nan")
    var = sum(accuracy[c] * (1 - accuracy[c]) / images[c] for c in cats)
    return math.sqrt(var) / len(cats)


def sequential_decision(diffs: Sequence[float], *, min_seeds: int, max_seeds: int,
                        half_width: float = 0.015) -> tuple[bool, str]:
    """Whether the sequential design stops after these paired differences, and why: the 95 % CI excludes
    0 or its half-width is below `half_width` (from `min_seeds` on), or `max_seeds` are done."""
    c = mean_ci(list(diffs))
    n = c["n"]
    if n >= max_seeds:
        return True, f"max_seeds={max_seeds} reached"
    if n < max(2, min_seeds):
        return False, f"{n} of at least {max(2, min_seeds)} seeds"
    lo, hi = c["mean"] - c["ci95"], c["mean"] + c["ci95"]
    if lo > 0 or hi < 0:
        return True, f"95 % CI [{lo:+.4f}, {hi:+.4f}] excludes 0 after {n} seeds"
    if c["ci95"] < half_width:
        return True, f"95 % CI half-width {c['ci95']:.4f} < {half_width} after {n} seeds"
    return False, f"95 % CI [{lo:+.4f}, {hi:+.4f}] (half-width {c['ci95']:.4f}) after {n} seeds"

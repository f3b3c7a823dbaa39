"""Paired statistics for trained − base comparisons: bootstrap confidence intervals and win rates, the
pairing of the benchmarks' per-image records (`geneval_prompt_pairs`, `wise_pairs`), the per-benchmark
cells (`compute_statistics`) and the flat metrics MLflow and the promotion gates read (`flat_metrics`).

Base and trained images are made from the same prompts and seeds, so each prompt gives a *pair*
(base score, trained score). For every benchmark cell (HPDv2 per scorer, GenEval per task and overall,
WISE per category and overall) `paired_bootstrap` reports

* `delta` = mean(trained) − mean(base) (for stratified cells: the benchmark's own weighted statistic),
* a percentile bootstrap CI of the delta: resample the *pairs* (prompts) with replacement B times,
  recompute the delta, take the (1−level)/2 and (1+level)/2 quantiles,
* the win rate = share of prompts where trained beats base (strictly), with its bootstrap CI, plus the
  tie and loss rates, and `n` (pairs used) / `n_dropped` (pairs with a missing or non-finite side).
  With fewer than `MIN_PAIRS` pairs the intervals are None and the delta counts as not significant.

Stratified cells (GenEval overall = unweighted mean of the 6 task means; WISE overall = official
category weights) resample within each stratum, so every bootstrap replicate keeps the design's
stratum sizes. The resampling is seeded: the same inputs give the same interval.

`significance(ci_low, ci_high)` is +1 / −1 when the CI lies entirely above / below 0 and 0 when it
contains or touches 0: reports show such deltas neutral (neither green nor red), and gates can use the
bound (`<metric>.delta_ci_low`, which must exceed the margin: a bound of exactly 0 never passes margin 0).

**Exact zeros.** Discrete metrics (WISE sub-scores, GenEval's correct/incorrect) tie often, and float
arithmetic can turn a tie into residue: WiScores (0.7·1 + 0.2·2 + 0.1·0)/2 and (0.7·1 + 0.2·1 + 0.1·2)/2
are both 0.45 but differ by 1.1e-16 as floats, and a bootstrap mean of such differences is a "bound" of
+2e-17 that would read as significant. So every value that is 0 in exact arithmetic is made exactly 0:

* a pair whose |trained − base| <= `RESIDUE_ULPS` · eps · max(|trained|, |base|) is a tie (difference 0);
  distinct float32 scores differ by at least one float32 ulp (~6e-8 relative), 10⁸ times more;
* the delta and both CI bounds within `RESIDUE_ULPS` · (n + 1) · eps · max|score| of 0 (the rounding
  error bound of a mean of n differences) are 0.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from chunkgrpo.errors import UserError
from chunkgrpo.eval.wise import CATEGORIES

DEFAULT_SAMPLES = 2000
DEFAULT_LEVEL = 0.95
DEFAULT_SEED = 0
MIN_PAIRS = 5  # fewer pairs: no interval (a bootstrap of 1-4 pairs is degenerate, e.g. [x, x] for one pair)
_CHUNK = 256  # bootstrap replicates per vectorised block (bounds memory: _CHUNK x n indices)
RESIDUE_ULPS = 4  # float64 rounding slack (in units of eps x the score scale) treated as exact 0
_EPS = float(np.finfo(np.float64).eps)


def significance(ci_low: float | None, ci_high: float | None) -> int:
    """+1 if the interval lies strictly above 0, −1 if strictly below, 0 if it contains or touches 0 (or is
    unknown). Bounds from `paired_bootstrap` are exact zeros where exact arithmetic gives 0 (module doc)."""
    if ci_low is None or ci_high is None or not (math.isfinite(ci_low) and math.isfinite(ci_high)):
        return 0
    if ci_low > 0:
        return 1
    if ci_high < 0:
        return -1
    return 0


def _pairs(trained: Sequence[float], base: Sequence[float]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    t = np.asarray(trained, dtype=np.float64).ravel()
    b = np.asarray(base, dtype=np.float64).ravel()
    if t.shape != b.shape:
        raise UserError(f"paired statistics need aligned samples: {t.size} trained vs {b.size} base values")
    ok = np.isfinite(t) & np.isfinite(b)
    return t, b, ok


def paired_bootstrap(trained: Sequence[float], base: Sequence[float], *,
                     strata: Sequence[Hashable] | None = None,
                     strata_weights: Mapping[Hashable, float] | None = None,
                     samples: int = DEFAULT_SAMPLES, level: float = DEFAULT_LEVEL,
                     seed: int = DEFAULT_SEED, min_pairs: int = MIN_PAIRS) -> dict[str, Any]:
    """Bootstrap CI of trained − base and the win rate over aligned per-prompt pairs.

    `strata` (one label per pair) makes the statistic a weighted mean of per-stratum means
    (`strata_weights`, default equal weights, renormalised over the strata present) with resampling
    inside each stratum. Pairs with a non-finite side are dropped and counted in `n_dropped`. Below
    `min_pairs` pairs only the point estimates are returned (intervals None, significance 0)."""
    if samples < 100:
        raise UserError(f"bootstrap samples={samples} must be >= 100")
    if not 0.5 <= level < 1:
        raise UserError(f"confidence level={level} must be in [0.5, 1)")
    t, b, ok = _pairs(trained, base)
    labels = np.asarray(list(strata) if strata is not None else [None] * t.size, dtype=object)
    if labels.size != t.size:
        raise UserError(f"got {labels.size} strata labels for {t.size} pairs")
    n_dropped = int((~ok).sum())
    t, b, labels = t[ok], b[ok], labels[ok]
    n = int(t.size)
    out: dict[str, Any] = {"n": n, "n_dropped": n_dropped, "level": level, "samples": samples,
                           "method": "paired percentile bootstrap over prompts"
                                     + (" (stratified)" if strata is not None else "")}
    if n == 0:
        out.update({k: None for k in ("mean_trained", "mean_base", "delta", "ci_low", "ci_high", "win_rate",
                                      "win_ci_low", "win_ci_high", "tie_rate", "loss_rate")})
        out["significance"] = 0
        return out
    groups = list(dict.fromkeys(labels.tolist()))
    if strata_weights is not None and strata is not None:
        unknown = [g for g in groups if g not in strata_weights]
        if unknown:
            raise UserError(
                f"no weight for strata {unknown} (weights given for {sorted(map(str, strata_weights))})"
            )
        raw_w = np.asarray([float(strata_weights[g]) for g in groups])
    else:
        raw_w = np.ones(len(groups))
    w = raw_w / raw_w.sum()
    members = [np.flatnonzero(labels == g) for g in groups]
    d = t - b
    d[np.abs(d) <= RESIDUE_ULPS * _EPS * np.maximum(np.abs(t), np.abs(b))] = 0.0  # float residue of a tie
    zero_tol = RESIDUE_ULPS * (n + 1) * _EPS * float(np.max(np.maximum(np.abs(t), np.abs(b))))

    def exact(x: float) -> float:
        return 0.0 if abs(x) <= zero_tol else x

    win = (d > 0).astype(np.float64)
    # the statistic: sum_g w_g mean_{i in g} x_i   (plain mean when there is one stratum)
    def stat(x: np.ndarray) -> float:
        return float(sum(wg * x[m].mean() for wg, m in zip(w, members)))

    out.update({"mean_trained": stat(t), "mean_base": stat(b), "delta": exact(stat(d)),
                "win_rate": float(win.mean()), "tie_rate": float((d == 0).mean()),
                "loss_rate": float((d < 0).mean())})
    if n < min_pairs:
        out.update(
            {
                "ci_low": None,
                "ci_high": None,
                "win_ci_low": None,
                "win_ci_high": None,
                "significance": 0,
                "note": f"{n} pairs (< {min_pairs}): no interval",
            }
        )
        return out
    rng = np.random.default_rng(seed)
    boot_d = np.zeros(samples)
    boot_w = np.zeros(samples)
    for wg, m in zip(w, members):
        size = m.size
        dm, wm = d[m], win[m]
        for start in range(0, samples, _CHUNK):
            stop = min(samples, start + _CHUNK)
            idx = rng.integers(0, size, size=(stop - start, size))
            boot_d[start:stop] += wg * dm[idx].mean(axis=1)
            boot_w[start:stop] += (size / n) * wm[idx].mean(axis=1)
    q = [(1 - level) / 2, (1 + level) / 2]
    lo, hi = (exact(float(v)) for v in np.quantile(boot_d, q))
    wlo, whi = (float(v) for v in np.quantile(boot_w, q))
    out.update({"ci_low": lo, "ci_high": hi, "win_ci_low": wlo, "win_ci_high": whi,
                "significance": significance(lo, hi)})
    if strata is not None:
        out["strata"] = {str(g): {"n": int(m.size), "weight": float(wg)} for g, m in zip(groups, members)}
    return out


def cell(trained: Sequence[float], base: Sequence[float], **kw: Any) -> dict[str, Any]:
    """`paired_bootstrap` without the bulky `strata` table (what metrics.json stores per cell)."""
    res = paired_bootstrap(trained, base, **kw)
    res.pop("strata", None)
    return res


# --------------------------------------------------------------------------------------------------
# statistics (paired: same prompts and seeds for both labels)


def _geneval_key(rec: dict) -> tuple[int, str] | None:
    """(prompt index, sample file) of a GenEval record, from `<index>/samples/<k>.png` in its filename."""
    parts = Path(str(rec.get("filename") or "")).parts
    if len(parts) >= 3 and parts[-2] == "samples" and parts[-3].isdigit():
        return int(parts[-3]), parts[-1]
    return None


def geneval_prompt_pairs(records: dict) -> dict[int, dict]:
    """Per prompt index: tag and the mean `correct` of its images present for both labels."""
    by = {lb: {k: r for r in recs if (k := _geneval_key(r)) is not None} for lb, recs in records.items()}
    common = set(by.get("trained", {})) & set(by.get("base", {}))
    out: dict[int, dict] = {}
    for key in sorted(common):
        idx = key[0]
        e = out.setdefault(idx, {"tag": by["base"][key]["tag"], "prompt": by["base"][key]["prompt"],
                                 "trained": [], "base": [], "files": []})
        e["files"].append(key[1])
        for lb in ("trained", "base"):
            e[lb].append(float(bool(by[lb][key]["correct"])))
    for e in out.values():
        for lb in ("trained", "base"):
            e[f"{lb}_mean"] = sum(e[lb]) / len(e[lb])
    return out


def wise_pairs(records: dict, failed_policy: str = "exclude") -> dict[int, dict]:
    """Per WISE prompt id: category and WiScore per label (None = failed/excluded, 0.0 with policy 'zero')."""
    out: dict[int, dict] = {}
    for lb in ("trained", "base"):
        for r in records.get(lb) or []:
            e = out.setdefault(
                int(r["prompt_id"]), {"category": r.get("category"), "trained": None, "base": None}
            )
            w = r.get("wiscore")
            e[lb] = float(w) if w is not None else (0.0 if failed_policy == "zero" else None)
    return out


def compute_statistics(bench: str, per_image: Any, results: dict, *, samples: int, seed: int,
                       level: float) -> dict[str, dict]:
    """Paired bootstrap cells `{metric: cell(...)}` for one benchmark (needs both labels)."""
    if not {"trained", "base"} <= set(results):
        return {}
    kw = {"samples": samples, "seed": seed, "level": level}
    nan = float("nan")
    cells: dict[str, dict] = {}
    if bench == "hpdv2":
        for name in per_image["trained"]:
            cells[name] = cell(per_image["trained"][name], per_image["base"][name], **kw)
    elif bench == "geneval":
        pairs = geneval_prompt_pairs(per_image)
        tags = [e["tag"] for e in pairs.values()]
        t = [e["trained_mean"] for e in pairs.values()]
        b = [e["base_mean"] for e in pairs.values()]
        # overall = unweighted mean of the task means (GenEval summary_scores)
        cells["overall"] = cell(t, b, strata=tags, **kw)
        for tag in dict.fromkeys(tags):
            sel = [i for i, g in enumerate(tags) if g == tag]
            cells[tag] = cell([t[i] for i in sel], [b[i] for i in sel], **kw)
    elif bench == "wise":
        policy = next(iter(results.values())).get("failed_policy", "exclude")
        pairs = wise_pairs(per_image, policy)
        cats = [e["category"] for e in pairs.values()]
        t = [nan if e["trained"] is None else e["trained"] for e in pairs.values()]
        b = [nan if e["base"] is None else e["base"] for e in pairs.values()]
        if all(r.get("complete") for r in results.values()):  # official weights, as wise.aggregate
            cells["overall"] = cell(
                t, b, strata=cats, strata_weights={n: w for n, _, _, w in CATEGORIES}, **kw
            )
        else:  # mean over the evaluated prompts
            cells["overall"] = cell(t, b, **kw)
        for name, *_ in CATEGORIES:
            sel = [i for i, c in enumerate(cats) if c == name]
            if sel:
                cells[name] = cell([t[i] for i in sel], [b[i] for i in sel], **kw)
    return cells


STAT_METRICS = {"delta_ci_low": "ci_low", "delta_ci_high": "ci_high", "win_rate": "win_rate",
                "win_rate_ci_low": "win_ci_low", "win_rate_ci_high": "win_ci_high", "n_pairs": "n"}


def flat_metrics(benchmarks: dict) -> dict[str, float]:
    """`<benchmark>.<metric>.<label>` (each label's own mean, as the benchmark reports it) and `.delta`, the
    **paired** trained − base (`statistics.<metric>.delta`: the mean difference over the pairs with both
    sides scored, the same pairs as its CI; absent without a statistics cell) for MLflow, plus the paired
    statistics
    `.delta_ci_low` / `.delta_ci_high` (bootstrap CI of the delta), `.win_rate` (+ `_ci_low/_ci_high`)
    and `.n_pairs`: a promotion gate or the nightly regression check can name e.g.
    `hpdv2.hpsv3.delta_ci_low` (registered as `eval.hpdv2.hpsv3.delta_ci_low`)."""
    out: dict[str, float] = {}
    for bench, b in benchmarks.items():
        res = b.get("results") or {}
        for lb, r in res.items():
            if bench == "hpdv2":
                for name, s in r["scorers"].items():
                    out[f"hpdv2.{name}.{lb}"] = s["mean"]
            elif bench == "geneval":
                out[f"geneval.overall.{lb}"] = r["overall"]
                for tag, t in r["tasks"].items():
                    out[f"geneval.{tag}.{lb}"] = t["score"]
            elif bench == "wise":
                if r.get("overall") is not None:
                    out[f"wise.overall.{lb}"] = r["overall"]
                for cat, c in (r.get("categories") or {}).items():
                    if c.get("wiscore") is not None:
                        out[f"wise.{cat}.{lb}"] = c["wiscore"]
    for bench, b in benchmarks.items():
        for metric, cell in (b.get("statistics") or {}).items():
            # the delta of the same pairs as its CI (each label's own mean above may use other items,
            # e.g. when some judgements failed for one label only)
            if _finite(cell.get("delta")):
                out[f"{bench}.{metric}.delta"] = cell["delta"]
            for suffix, field in STAT_METRICS.items():
                v = cell.get(field)
                if _finite(v):
                    out[f"{bench}.{metric}.{suffix}"] = v
    return {k: float(v) for k, v in out.items() if _finite(v)}


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


__all__ = [
    "paired_bootstrap",
    "cell",
    "significance",
    "compute_statistics",
    "flat_metrics",
    "geneval_prompt_pairs",
    "wise_pairs",
    "STAT_METRICS",
    "DEFAULT_SAMPLES",
    "DEFAULT_LEVEL",
    "DEFAULT_SEED",
    "MIN_PAIRS",
    "RESIDUE_ULPS",
]

"""Paired tests for comparing two models on the same prompts (numpy; scipy.stats for McNemar's tails and Pearson).

Two models are compared on *paired* per-prompt differences (paired bootstrap, or a delete-a-group jackknife for
statistics a bootstrap biases), and binary outcomes with McNemar's test (exact binomial for few discordant pairs,
χ² otherwise) — far more sensitive than an unpaired test (Miller 2024, "Adding Error Bars to Evals"). One model's
error bars (``Metric``, clustered SEs, bootstrap) are ``verl.evaluators.stats``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from statistics import NormalDist

import numpy as np

from verl.evaluators.stats import normal_ci

# ---------------------------------------------------------------------------------------------- paired


def paired_bootstrap(a: np.ndarray, b: np.ndarray, n_boot: int = 1000, seed: int = 0) -> dict[str, float]:
    """Paired bootstrap of ``mean(b - a)`` over units (prompts) ``(P,)``; pairs with a NaN side are dropped.

    p-value: the replicates are shifted to the null (difference 0) and the two-sided tail is counted,
    ``(1 + #|d* - d̂| >= |d̂|) / (1 + B)`` (Efron & Tibshirani 1993, §16.4; Koehn 2004 for MT).
    """
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    keep = ~(np.isnan(a) | np.isnan(b))
    diff = b[keep] - a[keep]

    def mean_diff(w: np.ndarray) -> dict[str, float]:
        return {"d": float(np.average(diff, weights=w)) if w.sum() else float("nan")}

    return paired_resample(mean_diff, diff.size, "bootstrap", n_boot, seed)["d"]


def paired_resample(diff_at: Callable[[np.ndarray], dict[str, float]], n_units: int, method: str = "bootstrap",
                    n_boot: int = 1000, seed: int = 0, max_groups: int = 200,
                    bound_alpha: float | None = None) -> dict[str, dict[str, float]]:
    """Resample units (prompts) to get CIs and p-values of differences ``diff_at(weights (P,)) -> {name: d}``.

    ``bootstrap``: weights = how often each unit is drawn; percentile CI; p-value from the replicates shifted to
    the null. ``jackknife``: delete-a-group SE, normal CI and p-value (for statistics a bootstrap biases).
    Returns ``{name: {diff, ci_low, ci_high, se, p_value, n, method}}``; with ``bound_alpha`` also the one-sided
    bounds at level ``1 - bound_alpha`` (``lower``, ``upper``: the replicates' ``bound_alpha`` quantiles, or
    ``d -/+ z se``), which a decision with that share of an error budget reads (``verl ship``'s offline gates).
    """
    nan = float("nan")
    observed = diff_at(np.ones(n_units, dtype=np.int64)) if n_units else {}
    if n_units < 2:
        return {k: {"diff": v, "ci_low": nan, "ci_high": nan, "se": nan, "p_value": nan, "n": n_units,
                    "method": method} for k, v in observed.items()}
    rng = np.random.default_rng(seed)
    if method == "jackknife":
        groups = min(n_units, max_groups)
        group = rng.permutation(n_units) % groups
        weights = [(group != g).astype(np.int64) for g in range(groups)]
    else:
        weights = [np.bincount(rng.integers(0, n_units, n_units), minlength=n_units) for _ in range(n_boot)]
    reps = {k: np.empty(len(weights)) for k in observed}
    for i, w in enumerate(weights):
        values = diff_at(w)
        for key in observed:
            reps[key][i] = values.get(key, nan)
    out = {}
    for key, d in observed.items():
        r = reps[key][~np.isnan(reps[key])]
        if r.size < 2 or not math.isfinite(d):
            out[key] = {"diff": d, "ci_low": nan, "ci_high": nan, "se": nan, "p_value": nan, "n": n_units,
                        "method": method}
            continue
        if method == "jackknife":
            g = r.size
            se = math.sqrt((g - 1) / g * float(np.sum((r - r.mean()) ** 2)))
            low, high = normal_ci(d, se)
            p_value = math.erfc(abs(d) / se / math.sqrt(2.0)) if se > 0 else (1.0 if d == 0 else 0.0)
            if bound_alpha is not None:
                z = float(NormalDist().inv_cdf(1.0 - bound_alpha))
                bounds = {"lower": d - z * se, "upper": d + z * se}
        else:
            se = float(r.std(ddof=1))
            low, high = (float(v) for v in np.percentile(r, [2.5, 97.5]))
            extreme = int(np.sum(np.abs(r - d) >= abs(d) - 1e-12))
            p_value = 1.0 if d == 0 else min(1.0, (1 + extreme) / (1 + r.size))
            if bound_alpha is not None:
                lower, upper = np.quantile(r, [bound_alpha, 1.0 - bound_alpha])
                bounds = {"lower": float(lower), "upper": float(upper)}
        out[key] = {"diff": float(d), "ci_low": float(low), "ci_high": float(high), "se": se,
                    "p_value": float(p_value), "n": n_units, "method": method}
        if bound_alpha is not None:
            out[key].update(bounds, bound_alpha=bound_alpha, replicates=int(r.size))
    return out


# ---------------------------------------------------------------------------------------------- tests


def mcnemar(a: Sequence[float], b: Sequence[float], exact_below: int = 25) -> dict[str, float]:
    """McNemar's test for paired binary outcomes ``a``, ``b`` ``(N,)`` in {0, 1}.

    ``n01`` = pairs where a is 0 and b is 1 (b wins), ``n10`` the reverse. χ² = (n01 - n10)² / (n01 + n10), df 1;
    the exact test is the two-sided binomial test of ``min(n01, n10)`` in ``Bin(n01 + n10, 1/2)``. ``p_value`` is
    the exact one when ``n01 + n10 < exact_below`` (the χ² approximation is poor there), else the χ² one.
    """
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    keep = ~(np.isnan(x) | np.isnan(y))
    x, y = x[keep] > 0.5, y[keep] > 0.5
    n01, n10 = int(np.sum(~x & y)), int(np.sum(x & ~y))
    discordant = n01 + n10
    if discordant == 0:
        return {"n01": 0, "n10": 0, "statistic": 0.0, "p_chi2": 1.0, "p_exact": 1.0, "p_value": 1.0, "method": "exact"}
    from scipy.stats import binomtest, chi2

    statistic = (n01 - n10) ** 2 / discordant
    p_chi2 = float(chi2.sf(statistic, df=1))
    p_exact = float(binomtest(min(n01, n10), discordant, 0.5).pvalue)  # two-sided
    method = "exact" if discordant < exact_below else "chi2"
    return {"n01": n01, "n10": n10, "statistic": float(statistic), "p_chi2": float(p_chi2), "p_exact": float(p_exact),
            "p_value": float(p_exact if method == "exact" else p_chi2), "method": method}


def pearson(a: np.ndarray, b: np.ndarray) -> float:
    """Pearson correlation; NaN when either side is constant or fewer than 2 pairs."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    keep = ~(np.isnan(a) | np.isnan(b))
    a, b = a[keep], b[keep]
    if a.size < 2 or a.std() == 0 or b.std() == 0:
        return float("nan")
    from scipy.stats import pearsonr

    return float(pearsonr(a, b).statistic)


# ---------------------------------------------------------------------------------------------- importance


def permutation_importance(features: np.ndarray, target: np.ndarray, n_repeats: int = 50, seed: int = 0,
                           ridge: float = 1e-3) -> np.ndarray:
    """Permutation importance of each column of ``features`` ``(runs, keys)`` for ``target`` ``(runs,)``.

    A ridge regression on standardised features is fitted once; a feature's importance is the mean increase
    in squared error when that column is shuffled (Breiman 2001). With a handful of runs this is indicative only.
    """
    x = np.asarray(features, dtype=np.float64)
    y = np.asarray(target, dtype=np.float64)
    std = x.std(axis=0)
    std[std == 0] = 1.0
    xs = (x - x.mean(axis=0)) / std
    design = np.column_stack([np.ones(len(y)), xs])
    penalty = ridge * np.eye(design.shape[1])
    penalty[0, 0] = 0.0
    coef = np.linalg.solve(design.T @ design + penalty, design.T @ y)
    base = float(np.mean((design @ coef - y) ** 2))
    rng = np.random.default_rng(seed)
    out = np.zeros(x.shape[1])
    for j in range(x.shape[1]):
        losses = []
        for _ in range(n_repeats):
            shuffled = design.copy()
            shuffled[:, j + 1] = rng.permutation(shuffled[:, j + 1])
            losses.append(float(np.mean((shuffled @ coef - y) ** 2)))
        out[j] = float(np.mean(losses)) - base
    return out

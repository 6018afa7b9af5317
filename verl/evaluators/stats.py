"""Error bars for one model's evaluation numbers (numpy only): what every evaluator's ``Metric`` carries.

Conventions (Miller 2024, "Adding Error Bars to Evals"):

- Every mean comes with a standard error and a 95% CI ``mean ± 1.96·SE``.
- Samples that share a prompt are not independent: SEs are clustered by prompt. The clustered SE used here is
  ``sqrt(C/(C-1) · Σ_c (Σ_{i∈c} (x_i - x̄))²) / N`` (C clusters, N samples); with one sample per prompt it
  reduces exactly to the textbook ``s / sqrt(N)`` (sample standard deviation, ddof=1).
- Statistics with no closed-form SE use resampling over prompts (all of a prompt's samples travel together):
  a cluster bootstrap for percentiles and ratios of sums (SE = standard deviation of the replicates, CI = their
  2.5/97.5 percentiles), a delete-a-group jackknife for statistics that count distinct items (distinct-n,
  n-gram entropy), which a bootstrap biases (see ``jackknife_metrics``).
- Normal CIs of proportions are clipped to [0, 1].

Comparing two models (paired bootstrap, McNemar) is ``eval.stats``'s job, on top of these.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

Z95 = 1.96  # REFERENCES: 95% CI = mean ± 1.96·SE


@dataclass
class Metric:
    """One number with its uncertainty, as written to ``results.json``.

    ``aggregate`` says how compare pairs it: ``mean`` (of the per-sample column ``column``), ``corpus``
    (recomputed from the samples by the evaluator). ``higher_is_better`` is None for metrics with no good
    direction (length, KL, diversity): compare then says "higher"/"lower" rather than "better"/"worse".
    """

    value: float
    se: float
    ci_low: float
    ci_high: float
    n: int  # samples behind the number
    method: str  # "mean" (CLT), "cluster" (clustered CLT), "bootstrap", "none"
    aggregate: str = "mean"
    column: str | None = None
    binary: bool = False
    higher_is_better: bool | None = None
    evaluator: str | None = None

    def to_dict(self) -> dict:
        out = asdict(self)
        for key in ("value", "se", "ci_low", "ci_high"):
            out[key] = _finite_or_none(out[key])
        return out

    @classmethod
    def from_dict(cls, data: dict) -> Metric:
        known = {k: data.get(k) for k in cls.__dataclass_fields__}
        for key in ("value", "se", "ci_low", "ci_high"):
            known[key] = float("nan") if known[key] is None else float(known[key])
        known["aggregate"] = known["aggregate"] or "mean"
        known["method"] = known["method"] or "none"
        known["n"] = int(known["n"] or 0)
        known["binary"] = bool(known["binary"])
        return cls(**known)


def _finite_or_none(value: float | None) -> float | None:
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


# ---------------------------------------------------------------------------------------------- means


def cluster_mean_se(values: Sequence[float] | np.ndarray, clusters: Sequence[Hashable] | np.ndarray | None = None
                    ) -> tuple[float, float, int]:
    """``(mean, standard error, number of clusters)`` of ``values`` ``(N,)``, NaNs dropped.

    ``clusters`` ``(N,)`` groups samples of one prompt; None treats every sample as its own cluster.
    """
    x = np.asarray(values, dtype=np.float64)
    keep = ~np.isnan(x)
    x = x[keep]
    if x.size == 0:
        return float("nan"), float("nan"), 0
    mean = float(x.mean())
    ids = np.arange(x.size) if clusters is None else np.unique(np.asarray(clusters)[keep], return_inverse=True)[1]
    sums = np.bincount(ids, weights=x - mean)
    n_clusters = int(sums.size)
    if n_clusters < 2:
        return mean, float("nan"), n_clusters
    se = math.sqrt(n_clusters / (n_clusters - 1) * float(np.sum(sums**2))) / x.size
    return mean, se, n_clusters


def normal_ci(mean: float, se: float, z: float = Z95) -> tuple[float, float]:
    return mean - z * se, mean + z * se


def mean_metric(values: Sequence[float] | np.ndarray, clusters: np.ndarray | None = None, **meta) -> Metric:
    """A ``Metric`` for the mean of ``values`` ``(N,)`` with a (clustered) CLT standard error."""
    x = np.asarray(values, dtype=np.float64)
    mean, se, n_clusters = cluster_mean_se(x, clusters)
    multi = clusters is not None and n_clusters < int(np.sum(~np.isnan(x)))
    low, high = normal_ci(mean, se)
    if meta.get("binary"):
        # A proportion cannot leave [0, 1]; the normal interval is clipped there (the SE is unchanged).
        low, high = max(0.0, low), min(1.0, high)
    return Metric(mean, se, low, high, int(np.sum(~np.isnan(x))), "cluster" if multi else "mean", **meta)


def reported_metric(value: float, stderr: float | None, tool: str, values: np.ndarray | None = None,
                    n: int | None = None, mean: bool = False, clusters: np.ndarray | None = None,
                    column: str | None = None, higher_is_better: bool | None = None) -> dict:
    """A number another tool computed (lm-eval, Inspect) as ``results.json``'s metric. When ``mean`` and it is the
    mean of the per-sample ``values`` ``(N,)``: our (clustered) SE and CI beside the tool's value, pairable by its
    ``column``; otherwise the tool's ``stderr`` with the normal CI, not paired (``aggregate`` = ``tool``). Either
    way ``<tool>_stderr`` keeps the tool's own."""
    if mean and values is not None and values.size and math.isclose(float(values.mean()), value, rel_tol=1e-9,
                                                                     abs_tol=1e-12):
        out = mean_metric(values, clusters, binary=bool(np.isin(values, (0.0, 1.0)).all()), column=column,
                          higher_is_better=higher_is_better, evaluator=tool).to_dict()
        out["value"] = value  # the tool's own number, to its last digit
    else:
        se = float("nan") if stderr is None else stderr
        count = n if n is not None else (0 if values is None else int(values.size))
        out = Metric(value, se, value - Z95 * se, value + Z95 * se, count, tool, aggregate=tool,
                     higher_is_better=higher_is_better, evaluator=tool).to_dict()
    out[f"{tool}_stderr"] = stderr
    return out


# ---------------------------------------------------------------------------------------------- bootstrap


def cluster_weights(clusters: np.ndarray, n_boot: int, seed: int) -> np.ndarray:
    """``(n_boot, N)`` integer sample weights: each replicate draws the C clusters with replacement and every
    sample of a drawn cluster gets that cluster's multiplicity."""
    ids = np.unique(np.asarray(clusters), return_inverse=True)[1]
    n_clusters = int(ids.max()) + 1 if ids.size else 0
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, n_clusters, size=(n_boot, n_clusters))
    multiplicity = np.stack([np.bincount(row, minlength=n_clusters) for row in draws]) if n_boot else \
        np.zeros((0, n_clusters), dtype=np.int64)
    return multiplicity[:, ids]


def bootstrap_metrics(statistic: Callable[[np.ndarray], dict[str, float]], clusters: np.ndarray, n_boot: int,
                      seed: int, **meta) -> dict[str, Metric]:
    """Bootstrap every number ``statistic(weights (N,)) -> {name: value}`` returns, resampling clusters.

    The point estimate is the statistic at unit weights. ``n_boot = 0`` gives the estimates with NaN errors.
    """
    n = len(clusters)
    estimate = statistic(np.ones(n, dtype=np.int64))
    if n_boot <= 0 or len(np.unique(clusters)) < 2:
        return {k: Metric(v, float("nan"), float("nan"), float("nan"), n, "none", **meta) for k, v in estimate.items()}
    replicates: dict[str, list[float]] = {k: [] for k in estimate}
    for weights in cluster_weights(clusters, n_boot, seed):
        values = statistic(weights)
        for key in estimate:
            replicates[key].append(values.get(key, float("nan")))
    out = {}
    for key, value in estimate.items():
        reps = np.asarray(replicates[key], dtype=np.float64)
        reps = reps[~np.isnan(reps)]
        if reps.size < 2:
            out[key] = Metric(value, float("nan"), float("nan"), float("nan"), n, "bootstrap", **meta)
            continue
        low, high = np.percentile(reps, [2.5, 97.5])
        out[key] = Metric(value, float(reps.std(ddof=1)), float(low), float(high), n, "bootstrap", **meta)
    return out


def jackknife_metrics(statistic: Callable[[np.ndarray], dict[str, float]], clusters: np.ndarray, max_groups: int = 200,
                      seed: int = 0, **meta) -> dict[str, Metric]:
    """Delete-a-group jackknife SE for every number ``statistic(weights (N,))`` returns; CI = value ± 1.96·SE.

    Used for corpus statistics that count *distinct* items (distinct-n, n-gram entropy): a bootstrap replicate
    repeats whole prompts, which manufactures duplicate n-grams and drags every replicate below the estimate
    (the percentile CI can miss the estimate entirely). Deleting groups never duplicates anything. Clusters are
    split at random into ``G = min(C, max_groups)`` groups; ``SE² = (G-1)/G · Σ_g (θ_(-g) - θ̄)²``.
    """
    ids = np.unique(np.asarray(clusters), return_inverse=True)[1]
    n_clusters = int(ids.max()) + 1 if ids.size else 0
    estimate = statistic(np.ones(len(ids), dtype=np.int64))
    nan = float("nan")
    if max_groups <= 0 or n_clusters < 2:
        return {k: Metric(v, nan, nan, nan, len(ids), "none", **meta) for k, v in estimate.items()}
    groups = min(n_clusters, max_groups)
    group_of_cluster = np.random.default_rng(seed).permutation(n_clusters) % groups
    group_of_sample = group_of_cluster[ids]
    replicates = {k: np.empty(groups) for k in estimate}
    for g in range(groups):
        values = statistic((group_of_sample != g).astype(np.int64))
        for key in estimate:
            replicates[key][g] = values.get(key, nan)
    out = {}
    for key, value in estimate.items():
        reps = replicates[key]
        if np.isnan(reps).any() or not math.isfinite(value):
            out[key] = Metric(value, nan, nan, nan, len(ids), "jackknife", **meta)
            continue
        se = math.sqrt((groups - 1) / groups * float(np.sum((reps - reps.mean()) ** 2)))
        low, high = normal_ci(value, se)
        out[key] = Metric(value, se, low, high, len(ids), "jackknife", **meta)
    return out


def weighted_percentile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    """The ``q``-th percentile (numpy's linear rule) of ``values`` with each repeated ``weights`` times."""
    return float(np.percentile(np.repeat(values, weights.astype(np.int64)), q)) if weights.sum() else float("nan")


# ---------------------------------------------------------------------------------------------- pass@k / maj@k


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021): ``1 - C(n-c, k) / C(n, k)`` for c correct of n samples.

    Computed as ``1 - Π_{i=n-c+1}^{n} (1 - k/i)``, which avoids huge binomials.
    """
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per prompt, got n={n}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def pass_at_k_columns(prompt_index: np.ndarray, solved: np.ndarray, ks: Sequence[int]) -> dict[int, np.ndarray]:
    """``k -> (N,)`` unbiased pass@k of each sample's prompt (repeated on each of its samples, so the clustered mean
    is the per-prompt mean), from ``solved`` ``(N,)`` (1 = the sample passes). ``ks`` above the fewest samples any
    prompt has are left out."""
    groups: dict[int, list[int]] = {}
    for i, prompt in enumerate(np.asarray(prompt_index).tolist()):
        groups.setdefault(prompt, []).append(i)
    n = min(len(rows) for rows in groups.values())
    columns = {}
    for k in (k for k in ks if k <= n):
        column = np.empty(len(solved))
        for rows in groups.values():
            column[rows] = pass_at_k(len(rows), int((np.asarray(solved)[rows] >= 1.0).sum()), k)
        columns[k] = column
    return columns


def default_ks(n: int) -> list[int]:
    """k values reported for n samples per prompt: powers of two below n, and n."""
    ks = [k for k in (1, 2, 4, 8, 16, 32, 64, 128) if k < n]
    return [*ks, n]


def majority_vote(answers: Sequence[str | None]) -> str | None:
    """The most frequent non-None answer (ties go to the one seen first); None when all are None."""
    valid = [a for a in answers if a is not None]
    if not valid:
        return None
    counts = Counter(valid)
    best = max(counts.values())
    return next(a for a in valid if counts[a] == best)

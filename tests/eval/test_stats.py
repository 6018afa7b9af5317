"""Standard errors, bootstrap, jackknife, McNemar, pass@k and permutation importance."""

from __future__ import annotations

import math

import numpy as np
import pytest

from eval import stats as paired
from verl.evaluators import stats


def test_mcnemar_exact_matches_hand_binomial():
    # b = 1 (baseline right, candidate wrong), c = 7: two-sided exact p = 2 * P(X <= 1), X ~ Bin(8, 1/2).
    a = [1] + [0] * 7 + [1] * 5 + [0] * 3
    b = [0] + [1] * 7 + [1] * 5 + [0] * 3
    result = paired.mcnemar(a, b)
    assert (result["n10"], result["n01"]) == (1, 7)
    assert result["p_exact"] == pytest.approx(2 * (1 + 8) / 256)
    assert result["statistic"] == pytest.approx((7 - 1) ** 2 / 8)
    assert result["p_chi2"] == pytest.approx(math.erfc(math.sqrt(4.5 / 2)))
    assert result["method"] == "exact"
    assert paired.mcnemar([1, 0], [1, 0])["p_value"] == 1.0


def test_pearson_by_hand():
    # x = 1, 2, 3; y = 2, 4, 7: deviations (-1, 0, 1) and (-7/3, -1/3, 8/3): r = 5 / sqrt(2 * 38/3).
    assert paired.pearson(np.array([1.0, 2.0, 3.0]), np.array([2.0, 4.0, 7.0])) == pytest.approx(
        5 / math.sqrt(2 * 38 / 3))
    assert math.isnan(paired.pearson(np.array([1.0, 1.0]), np.array([2.0, 3.0])))  # constant side


def test_clustered_se_reduces_to_textbook_and_to_per_prompt_se():
    x = np.array([1.0, 3.0, 2.0, 7.0, 4.0])
    mean, se, _ = stats.cluster_mean_se(x)
    assert se == pytest.approx(x.std(ddof=1) / math.sqrt(5))
    # A value repeated within each prompt: the clustered SE is the SE over prompts.
    per_prompt = np.array([0.2, 0.9, 0.4])
    mean, se, clusters = stats.cluster_mean_se(np.repeat(per_prompt, 4), np.repeat([0, 1, 2], 4))
    assert clusters == 3 and mean == pytest.approx(per_prompt.mean())
    assert se == pytest.approx(per_prompt.std(ddof=1) / math.sqrt(3))


def test_bootstrap_ci_contains_the_truth_on_seeded_examples():
    # 200 seeded data sets (skewed, clustered in pairs): the 95% percentile CI of the mean covers the true mean
    # about 95% of the time; one example alone would pass or fail by luck.
    covered = 0
    for seed in range(200):
        rng = np.random.default_rng(seed)
        values = rng.exponential(scale=2.0, size=100)
        metric = stats.bootstrap_metrics(lambda w, v=values: {"mean": float(np.average(v, weights=w))},
                                         np.repeat(np.arange(50), 2), n_boot=300, seed=seed)["mean"]
        covered += metric.ci_low < 2.0 < metric.ci_high
    assert 0.88 <= covered / 200 <= 0.99


def test_bootstrap_se_of_a_median_is_near_its_asymptotic_value():
    values = np.random.default_rng(7).normal(loc=3.0, scale=1.0, size=400)
    m = stats.bootstrap_metrics(lambda w: {"median": stats.weighted_percentile(values, w, 50)}, np.arange(400),
                                n_boot=400, seed=0)["median"]
    assert m.ci_low <= m.value <= m.ci_high
    assert 0.03 < m.se < 0.1  # asymptotic SE of a normal median: 1.2533 / sqrt(400) = 0.063


def test_jackknife_se_of_a_mean_equals_the_clt_se():
    rng = np.random.default_rng(3)
    x = rng.normal(size=50)
    m = stats.jackknife_metrics(lambda w: {"mean": float(np.average(x, weights=w))}, np.arange(50))["mean"]
    assert m.se == pytest.approx(x.std(ddof=1) / math.sqrt(50), rel=1e-9)


def test_paired_bootstrap_detects_a_shift_and_not_its_absence():
    rng = np.random.default_rng(0)
    a = rng.normal(size=200)
    shifted = paired.paired_bootstrap(a, a + 0.3 + 0.1 * rng.normal(size=200), n_boot=500, seed=1)
    assert shifted["ci_low"] > 0 and shifted["p_value"] < 0.01
    same = paired.paired_bootstrap(a, a.copy(), n_boot=200, seed=1)
    assert same["diff"] == 0 and same["p_value"] == 1.0


@pytest.mark.parametrize(("n", "c", "k"), [(10, 3, 1), (10, 3, 5), (20, 0, 4), (5, 5, 2), (8, 7, 3)])
def test_pass_at_k_equals_the_binomial_formula(n, c, k):
    expected = 1 - math.comb(n - c, k) / math.comb(n, k)
    assert stats.pass_at_k(n, c, k) == pytest.approx(expected)


def test_majority_vote_and_default_ks():
    assert stats.majority_vote(["3", None, "4", "4"]) == "4"
    assert stats.majority_vote(["5", "9"]) == "5"
    assert stats.majority_vote([None, None]) is None
    assert stats.default_ks(8) == [1, 2, 4, 8] and stats.default_ks(6) == [1, 2, 4, 6]


def test_permutation_importance_ranks_the_informative_key_first():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(12, 2))
    y = 2.0 * x[:, 0] + 0.01 * rng.normal(size=12)
    importance = paired.permutation_importance(x, y)
    assert importance[0] > 10 * abs(importance[1])


def test_binary_ci_is_clipped_to_unit_interval():
    metric = stats.mean_metric([0, 0, 0, 1], binary=True)
    assert metric.ci_low == 0.0 and metric.ci_high <= 1.0

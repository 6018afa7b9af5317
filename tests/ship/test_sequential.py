"""The canary's always-valid tests (eval.ship.sequential) and its randomized units (eval.ship.units), by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from eval.ship.sequential import (
    Bets,
    ExceedanceTest,
    PairedWorseTest,
    RateIncreaseTest,
    RewardTest,
    UnitDifference,
    mixture_half_width,
)
from eval.ship.units import Randomization, spans
from verl.errors import ConfigError


def test_half_width_by_hand():
    # V = 0.01, tau = 0.1, alpha = 0.05: sqrt(0.01 * 0.02 / 0.01 * (2 ln 20 + ln 2)) = sqrt(0.02 * 6.68461) = 0.365639
    assert mixture_half_width(0.01, 0.05, 0.1) == pytest.approx(0.365639, abs=1e-6)
    widths = mixture_half_width(np.array([1e-2, 1e-3, 1e-4]), 0.05, 0.1)
    assert list(widths) == sorted(widths, reverse=True)
    assert all(w > 1.96 * math.sqrt(v) for w, v in zip(widths, (1e-2, 1e-3, 1e-4), strict=True))


def test_bets_by_hand():
    # One bettor, theta 0.1: lambda = min(0.1 / 0.25, 0.5 / 1) = 0.4; wealth (1 + 0.4 * 0.5)(1 - 0.4 * 0.2) = 1.104.
    one = Bets(0.05, (0.1,))
    one.add(np.array([0.5, -0.2]), np.array([-1.0, -1.0]), np.array([0.25, 0.25]))
    assert one.e_value == pytest.approx(1.2 * 0.92) and one.n == 2 and not one.rejected
    # A second bettor at theta 1.0 is capped at 0.5 / |least| = 0.5: (1.25)(0.9) = 1.125; the test is their mean.
    two = Bets(0.05, (0.1, 1.0))
    two.add(np.array([0.5, -0.2]), np.array([-1.0, -1.0]), np.array([0.25, 0.25]))
    assert two.e_value == pytest.approx((1.104 + 1.125) / 2)
    # Wealth never goes below half per bet, whatever the observation within its bounds.
    worst = Bets(0.05, (100.0,))
    worst.add(np.array([-3.0]), np.array([-3.0]), np.array([0.01]))
    assert worst.e_value == pytest.approx(0.5)
    # Twenty sure wins of +1 at lambda 0.5: 1.5^20 = 3325 >= 1/0.05.
    sure = Bets(0.05, (100.0,))
    sure.add(np.ones(20), -np.ones(20), np.full(20, 0.01))
    assert sure.e_value == pytest.approx(1.5 ** 20) and sure.rejected


def test_unit_statistics_by_hand():
    diff = UnitDifference()  # centre 0.5 before any unit
    s = diff.statistics(np.array([True, False]), np.array([0.25, 0.25]), np.array([1.0, 0.0]))
    # candidate: (1 - 0.5) / 0.25 = 2; incumbent: (0 - 0.5) * -(1 / 0.75) = 2/3
    assert s["z"] == pytest.approx([2.0, 2.0 / 3.0])
    assert s["least"] == pytest.approx([-2.0, -2.0]) and s["greatest"] == pytest.approx([2.0, 2.0])
    assert diff.candidate.n == 1 and diff.incumbent.n == 1 and diff.center == 0.5  # the first batch's mean
    diff.statistics(np.array([True, True]), np.array([0.25, 0.25]), np.array([1.0, 1.0]))
    keep = 0.5 ** (2 / 200)  # half-life 200 units
    assert diff.center == pytest.approx(keep * 0.5 + (1 - keep) * 1.0)  # the next batch moves it, after its use


def test_unit_statistic_is_unbiased_under_changing_shares_and_drift():
    """E[z] = mu_c - mu_i whatever the share and however both rates drift (one draw of 400k units)."""
    rng = np.random.default_rng(0)
    diff = UnitDifference()
    total, n = 0.0, 0
    for block in range(200):
        q = np.full(2000, (0.05, 0.25, 0.5)[block % 3])
        arm = rng.random(2000) < q
        base = 0.7 - 0.4 * block / 200  # both arms drift from 70% to 30%
        y = (rng.random(2000) < base - 0.1 * arm).astype(float)  # the candidate 10 points lower throughout
        total += float(diff.statistics(arm, q, y)["z"].sum())
        n += 2000
    assert total / n == pytest.approx(-0.1, abs=0.01)


def test_reward_test_decides_and_refuses_unbounded_rewards_for_betting():
    rng = np.random.default_rng(1)
    worse, same = RewardTest(), RewardTest()
    for _ in range(60):
        arm = rng.random(20) < 0.5
        q = np.full(20, 0.5)
        worse.add(arm, q, (rng.random(20) < np.where(arm, 0.3, 0.7)).astype(float))
        same.add(arm, q, (rng.random(20) < 0.6).astype(float))
    assert worse.decide() == "rollback" and worse.evidence()["e_worse"] >= 40
    assert same.decide() in ("continue", "non_inferior") and same.evidence()["e_worse"] < 40
    with pytest.raises(ConfigError, match=r"outside \[0, 1\].*--test mixture"):
        RewardTest().add(np.array([True]), np.array([0.5]), np.array([3.0]))
    mixture = RewardTest(method="mixture")
    for _ in range(10):  # unbounded rewards are fine
        mixture.add(np.array([True, False] * 50), np.full(100, 0.5), np.tile([0.0, 5.0], 50))
    assert mixture.decide() == "rollback" and mixture.evidence()["upper"] < 0
    with pytest.raises(ConfigError, match="--test must be one of betting, mixture"):
        RewardTest(method="t-test")


def test_guardrail_tests_hold_under_their_null_and_reject_a_clear_breach():
    rng = np.random.default_rng(2)
    errors_same, errors_worse = RateIncreaseTest(allowed=0.02, alpha=0.01), RateIncreaseTest(allowed=0.02, alpha=0.01)
    for _ in range(100):
        arm, q = rng.random(50) < 0.25, np.full(50, 0.25)
        errors_same.add(arm, q, (rng.random(50) < 0.05).astype(float))  # 5% on both arms
        errors_worse.add(arm, q, (rng.random(50) < np.where(arm, 0.15, 0.05)).astype(float))
    assert not errors_same.rejected and errors_worse.rejected
    fast, slow = ExceedanceTest(slo=100.0, alpha=0.01), ExceedanceTest(slo=100.0, alpha=0.01)
    for _ in range(50):
        fast.add(rng.lognormal(math.log(60), 0.3, 40))  # p95 ~ 98: 5% above at most
        slow.add(rng.lognormal(math.log(90), 0.3, 40))  # p95 ~ 147
    assert not fast.rejected and slow.rejected and slow.evidence()["share_above"] > 0.2
    paired = PairedWorseTest(alpha=0.01)
    paired.add(rng.choice([-1.0, 0.0, 0.0, 1.0], 300, p=[0.4, 0.3, 0.2, 0.1]))
    assert paired.rejected and paired.evidence()["mean_difference"] < 0


def test_spans_follow_the_routers_layout():
    assert spans({"inc": 0.95, "cand": 0.05}) == {"inc": (0.0, 0.95), "cand": (0.95, 1.0)}
    assert spans({"a": 0.0, "b": 2.0, "c": 2.0}) == {"a": (0.0, 0.0), "b": (0.0, 0.5), "c": (0.5, 1.0)}


def test_units_and_their_probabilities():
    r = Randomization("inc", "cand")
    r.add_layout(2, {"inc": 0.95, "cand": 0.05})
    r.add_layout(3, {"inc": 0.75, "cand": 0.25})
    # No user: a fresh draw each time, q = the share.
    assert r.assign(2, "inc", None) == pytest.approx(0.05) and r.assign(3, "cand", None) == pytest.approx(0.25)
    # A user the incumbent answered at 5% moves to the candidate at 25% with probability 0.20 / 0.95.
    assert r.assign(2, "inc", "u1") == pytest.approx(0.05)
    assert r.assign(2, "inc", "u1") is None  # the same user again at the same version: not a fresh draw
    assert r.assign(3, "inc", "u1") == pytest.approx(0.20 / 0.95)
    # A user the candidate answered stays there: no longer random.
    assert r.assign(2, "cand", "u2") == pytest.approx(0.05) and r.assign(3, "cand", "u2") is None
    assert r.assign(9, "inc", "u3") is None and r.unknown_version == 1  # a version the canary did not set
    assert r.repeats == 1  # u1 again at version 2 (u2 at version 3 is no draw at all)
    # A third model on the route narrows where a user can be, though it is not an arm.
    three = Randomization("inc", "cand")
    three.add_layout(5, {"other": 0.5, "inc": 0.4, "cand": 0.1})
    three.add_layout(6, {"other": 0.4, "inc": 0.35, "cand": 0.25})
    assert three.assign(5, "other", "u") is None  # hash in [0, 0.5)
    # At version 6 the candidate holds [0.75, 1): this user could never have drawn it, so this is no unit.
    assert three.assign(6, "inc", "u") is None and (three.users["u"].low, three.users["u"].high) == (0.4, 0.5)
    assert three.assign(6, "inc", None) == pytest.approx(0.25 / 0.60)  # no user: the two arms' shares

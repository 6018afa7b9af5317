"""The canary's always-valid test (eval.ship.sequential) by hand, and its error rates by simulation (issue 28
item 3): seeded, 2,000 canaries per case, a few seconds in all."""

from __future__ import annotations

import math

import numpy as np
import pytest

from eval.ship.sequential import Arm, SequentialTest, mixture_half_width
from eval.ship.simulate import CanaryPlan, error_rates, requests_for_power, simulate


def test_half_width_by_hand():
    # V = 0.01, tau = 0.1, alpha = 0.05: sqrt(0.01 * 0.02 / 0.01 * (2 ln 20 + ln 2)) = sqrt(0.02 * 6.68461) = 0.365639
    assert mixture_half_width(0.01, 0.05, 0.1) == pytest.approx(math.sqrt(0.02 * (2 * math.log(20) + math.log(2))))
    assert mixture_half_width(0.01, 0.05, 0.1) == pytest.approx(0.365639, abs=1e-6)
    # Narrower with more data, never below the fixed-n z interval (the price of looking at every request).
    widths = mixture_half_width(np.array([1e-2, 1e-3, 1e-4]), 0.05, 0.1)
    assert list(widths) == sorted(widths, reverse=True)
    assert all(w > 1.96 * math.sqrt(v) for w, v in zip(widths, (1e-2, 1e-3, 1e-4), strict=True))


def test_arm_sums_and_variance_floor():
    arm = Arm()
    arm.add([1.0, 0.0, 1.0, 1.0])
    assert (arm.n, arm.mean) == (4, 0.75) and arm.variance(0.0) == pytest.approx(0.25)  # (3 - 4 * 0.5625) / 3
    same = Arm()
    same.add([1.0] * 10)
    assert same.variance(0.01) == 0.01  # all-equal rewards never claim certainty


def test_decisions_follow_the_interval():
    test = SequentialTest(margin=0.05, alpha=0.05, min_per_arm=30)
    test.candidate.add([1.0] * 20)
    test.incumbent.add([1.0] * 20)
    assert test.interval() is None and test.decide() == "continue"  # too few on each side
    worse = SequentialTest(margin=0.05)
    worse.candidate.add([0.0] * 150 + [1.0] * 50)  # 25%
    worse.incumbent.add([0.0] * 40 + [1.0] * 160)  # 80%
    diff, low, high = worse.interval()
    assert diff == pytest.approx(-0.55) and high < 0 and worse.decide() == "rollback"
    same = SequentialTest(margin=0.05)
    same.candidate.add([0.0] * 2000 + [1.0] * 3000)
    same.incumbent.add([0.0] * 2000 + [1.0] * 3000)
    diff, low, high = same.interval()
    assert diff == 0 and -0.05 < low < 0 < high and same.decide() == "non_inferior"
    evidence = same.evidence()
    assert evidence["n_candidate"] == 5000 and evidence["interval"] == [low, high]
    assert evidence["decision"] == "non_inferior" and "mSPRT" in evidence["test"]
    with pytest.raises(ValueError, match="alpha"):
        SequentialTest(alpha=1.5)


def test_error_rates_by_simulation_hold_alpha_and_a_peeking_fixed_test_does_not():
    """2,000 canaries each: A/A (identical models) false rollbacks <= alpha; a candidate worse by exactly the margin
    promoted <= alpha; a 10-point drop caught at 80% power within the budget. The fixed-n z-test looked at once
    per stage over the same ramp rolls back far more A/A canaries than its nominal alpha."""
    plan = CanaryPlan()  # 5% -> 25% -> 50% -> promote, margin 0.05, alpha 0.05
    rates = error_rates(plan, mu=0.6, sims=2000, seed=0)
    seq, fixed = rates["sequential"], rates["fixed"]
    assert seq["false_rollback"] <= plan.alpha and seq["false_promote_at_margin"] <= plan.alpha
    assert seq["aa_promote"] >= 0.9  # identical models mostly reach 100% within the budget
    assert seq["requests_80pct_power"] < plan.budget
    assert fixed["false_rollback"] > 1.5 * plan.alpha  # peeking inflates alpha (~9% with three looks)
    assert fixed["false_promote_at_margin"] > 0.5  # and a plain test has no notion of the margin
    print(rates)


def test_simulation_is_seeded_and_counts_requests():
    a = simulate(CanaryPlan(), 0.6, 0.5, sims=200, seed=3)
    b = simulate(CanaryPlan(), 0.6, 0.5, sims=200, seed=3)
    assert np.array_equal(a["outcomes"], b["outcomes"]) and np.array_equal(a["requests"], b["requests"])
    assert a["rollback"] + a["promote"] + a["inconclusive"] == pytest.approx(1.0)
    assert requests_for_power({"outcomes": np.array([1, 1, 1, 2]), "requests": np.array([10, 30, 20, 5])},
                              0.5) == 20
    assert requests_for_power({"outcomes": np.array([1, 2, 2, 2]), "requests": np.array([10, 30, 20, 5])},
                              0.8) == float("inf")


def test_capacity_gate_reads_the_capacity_reports_steps():
    from eval.ship.gates import capacity_gate

    ok = capacity_gate({"steps": [{"users": 2, "requests": 90, "latency_p95_ms": 120.0, "failure_rate": 0.0,
                                   "requests_per_s": 9.0, "why_not": []}]}, 1000)
    assert ok.passed and "p95 120 ms within 1000 ms" in ok.reason
    slow = capacity_gate({"steps": [{"users": 2, "requests": 90, "latency_p95_ms": 1500.0, "failure_rate": 0.0,
                                     "requests_per_s": 9.0, "why_not": ["p95 1500 ms > 1000 ms"]}]}, 1000)
    assert not slow.passed and "at 2 users: p95 1500 ms > 1000 ms" in slow.reason
    assert not capacity_gate({"steps": []}, 1000).passed


def test_reward_hacking_tripwire_reads_the_run_and_the_pair(tmp_path):
    """Training reward up 0.6 while held-out accuracy fell 0.3 over the run: refused, with both numbers; the same
    rise with accuracy holding passes; a flat reward never trips."""
    from eval.ship.gates import training_trend, tripwire_gate
    from verl.utils.log import RunLogger

    def run(rewards: list[float], accuracy: list[tuple[int, float]]) -> dict:
        path = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        path.mkdir()
        logger = RunLogger(path / "verl_logs.jsonl")
        for step, value in enumerate(rewards, 1):
            logger.info("rollout", reward_mean=value)
            logger.flush(step)
        for step, value in accuracy:
            logger.info("eval", accuracy=value)
            logger.flush(step)
        logger.close()
        return training_trend(path, None)

    pair = {"metrics": {"eval/accuracy": {"diff": 0.0}}}
    hacked = run([0.1, 0.1, 0.1, 0.7, 0.7, 0.7], [(0, 0.5), (6, 0.2)])
    assert hacked["train_reward"]["change"] == pytest.approx(0.6)
    gate = tripwire_gate(hacked, pair, "eval/accuracy", 0.05)
    assert not gate.passed and "rose +0.600" in gate.reason and "fell -0.300" in gate.reason
    against_incumbent = tripwire_gate(run([0.1, 0.1, 0.1, 0.7, 0.7, 0.7], []),
                                      {"metrics": {"eval/accuracy": {"diff": -0.2}}}, "eval/accuracy", 0.05)
    assert not against_incumbent.passed and "against the incumbent" in against_incumbent.reason
    assert tripwire_gate(run([0.1, 0.1, 0.1, 0.7, 0.7, 0.7], [(0, 0.5), (6, 0.8)]), pair, "eval/accuracy",
                         0.05).passed
    assert tripwire_gate(run([0.5] * 6, [(0, 0.5), (6, 0.1)]), pair, "eval/accuracy", 0.05).passed


def test_guardrails_refuse_collapse_shrinking_and_kl():
    from eval.ship.gates import guardrail_gate

    def pair(div_diff: float, ci_high: float, cand_len: float) -> dict:
        return {"metrics": {"eval/distinct_1": {"baseline": 0.9, "candidate": 0.9 + div_diff, "diff": div_diff,
                                                 "ci_low": div_diff - 0.05, "ci_high": ci_high},
                            "eval/response_length_mean": {"baseline": 8.0, "candidate": cand_len}}}

    assert guardrail_gate(pair(-0.01, 0.02, 7.5), 0.05, kl=0.01).passed
    assert "diversity collapsed" in guardrail_gate(pair(-0.5, -0.4, 7.5), 0.05).reason  # 0.4 vs 0.9
    assert guardrail_gate(pair(-0.36, -0.32, 7.5), 0.05).passed  # 0.54 vs 0.9: terser, not collapsed
    assert "shrank to 3.0 tokens" in guardrail_gate(pair(0.0, 0.02, 3.0), 0.05).reason
    refused = guardrail_gate(pair(0.0, 0.02, 8.0), 0.05, kl=0.3, max_kl=0.1)
    assert not refused.passed and "KL to the base model 0.3 above --max-kl 0.1" in refused.reason

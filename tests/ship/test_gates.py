"""The offline and capacity gates of ``verl ship`` (eval.ship.gates), by hand."""

from __future__ import annotations

import math

import pytest


def rows(slow: int, fast: int, failed: int, slo_ms: float = 1000.0) -> list[dict]:
    """Records of a capacity run: answers slower and faster than the SLO, and failed requests."""
    return ([{"e2e_s": 1.5 * slo_ms / 1000, "error": None}] * slow + [{"e2e_s": 0.5 * slo_ms / 1000, "error": None}]
            * fast + [{"e2e_s": 0.1, "error": "queue_full: 429 at capacity"}] * failed)


def logged_trend(root, rewards: list[float], accuracy: list[tuple[int, float]], step: int | None = None,
                 spread: float | None = None, rm: bool = False) -> dict:
    """``training_trend`` (up to ``step``) of a new run under ``root`` whose log holds these rollout rewards — with
    their spread ``reward_std`` and a reward model's ``rm_score`` when asked — and these held-out accuracies."""
    from eval.ship.gates import training_trend
    from verl.utils.log import RunLogger

    path = root / f"run{len(list(root.iterdir()))}"
    path.mkdir()
    logger = RunLogger(path / "verl_logs.jsonl")
    for at, value in enumerate(rewards, 1):
        extra = ({"reward_std": spread} if spread is not None else {}) | ({"rm_score": value} if rm else {})
        logger.info("rollout", reward_mean=value, **extra)
        logger.flush(at)
    for at, value in accuracy:
        logger.info("eval", accuracy=value)
        logger.flush(at)
    logger.close()
    return training_trend(path, step)


def test_capacity_gate_tests_p95_and_failures_on_the_records():
    from eval.ship.gates import capacity_gate

    report = {"steps": [{"users": 2, "requests": 100, "latency_p95_ms": 1010.0, "failure_rate": 0.02}]}
    # 7 of 100 answers over the SLO: the sample p95 is above it, but 7% is not significantly above 5% (p ~ 0.23).
    noisy = capacity_gate(report, rows(7, 93, 0), 1000.0, 0.03, 0.01)
    assert noisy.passed and "neither significantly over" in noisy.reason
    assert noisy.evidence["p_value_p95_above_slo"] == pytest.approx(0.234, abs=0.002)
    slow = capacity_gate(report, rows(20, 80, 0), 1000.0, 0.03, 0.01)  # 20%: p ~ 1e-5
    assert not slow.passed and "20 of 100 answers slower" in slow.reason
    # 4 failures of 104 against an allowance of 3% is noise; 15 is not.
    assert capacity_gate(report, rows(0, 100, 4), 1000.0, 0.03, 0.01).passed
    failing = capacity_gate(report, rows(0, 100, 15), 1000.0, 0.03, 0.01)
    assert not failing.passed and "15 of 115 requests failed" in failing.reason
    assert not capacity_gate(report, [], 1000.0, 0.03, 0.01).passed  # no records: no evidence, no pass


def test_reward_hacking_tripwire_reads_the_run_and_the_pair(tmp_path):
    """Training reward up 0.6 while held-out accuracy fell 0.3 over the run: refused, with both numbers; the same
    rise with accuracy holding passes; a flat reward never trips."""
    from eval.ship.gates import tripwire_gate

    def run(rewards: list[float], accuracy: list[tuple[int, float]]) -> dict:
        return logged_trend(tmp_path, rewards, accuracy)

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


def test_a_format_marker_is_not_a_collapse_and_one_answer_for_every_prompt_is(tmp_path):
    """The guardrail on pairs that ``verl compare`` recomputes from the responses (paired jackknife), in the shape a
    CI run's offline gate met (distinct-1 0.403 vs 0.810, every learnt answer behind ``>>``): 60 distinct one-word
    answers against 50 distinct ones each behind a ``>>`` marker halve distinct-1 (1.0 -> 51/120, its CI wholly
    below 0) but not the share of distinct responses (1.0 -> 50/60): it passes, and distinct-1 alone (the rule
    before, kept for evaluations without the share) refuses it; one answer for every prompt is refused on the share
    (1/60)."""
    from eval.compare import compare
    from eval.ship.gates import guardrail_gate
    from tests.eval.test_compare_units import fake_eval

    both = ("distinct_1", "distinct_responses")
    fake_eval(tmp_path / "base", [1] * 60, [f"{i}" for i in range(60)], 1e-4, corpus=both)
    fake_eval(tmp_path / "marked", [1] * 60, [f">> {i % 50}" for i in range(60)], 1e-4, corpus=both)
    fake_eval(tmp_path / "one", [1] * 60, [">> 7"] * 60, 1e-4, corpus=both)
    report = compare([str(tmp_path / n) for n in ("base", "marked", "one")], out=tmp_path / "cmp", n_boot=200)
    marked, one = report["comparisons"]
    distinct_1 = marked["metrics"]["eval/distinct_1"]
    assert distinct_1["baseline"] == pytest.approx(1.0) and distinct_1["candidate"] == pytest.approx(51 / 120)
    assert marked["metrics"]["eval/distinct_responses"]["candidate"] == pytest.approx(50 / 60)
    gate = guardrail_gate(marked, 0.05)
    assert gate.passed and gate.evidence["distinct_1"]["candidate"] == pytest.approx(51 / 120)
    without_share = {"metrics": {k: v for k, v in marked["metrics"].items() if k != "eval/distinct_responses"}}
    assert "diversity collapsed: distinct_1 0.425 vs 1.000" in guardrail_gate(without_share, 0.05).reason
    refused = guardrail_gate(one, 0.05)
    assert not refused.passed and "diversity collapsed: distinct_responses 0.017 vs 1.000" in refused.reason


def test_the_tripwire_knows_a_reward_model_being_gamed(tmp_path):
    """The two shapes measured with an RM as the only reward (docs/rewards.md): accuracy up, then down from its peak
    while the RM's reward held (refused at the last step, passed at the peak); and an RM's reward far above its
    starting spread while the rule's accuracy stalls (refused). A rule-reward run with the same stall is not judged
    by the spread rule (its reward is the rule)."""
    from eval.ship.gates import tripwire_gate

    def run(rewards: list[float], accuracy: list[tuple[int, float]], rm: bool = True, step: int | None = None):
        return logged_trend(tmp_path, rewards, accuracy, step=step, spread=0.1, rm=rm)

    pair = {"metrics": {"eval/accuracy": {"diff": 0.0}}}
    rewards = [0.22, 0.3, 0.5, 0.9, 0.95, 0.97, 0.97, 0.97]
    accuracy = [(0, 0.004), (2, 0.52), (4, 0.67), (6, 0.36), (8, 0.125)]
    last = tripwire_gate(run(rewards, accuracy), pair, "eval/accuracy", 0.05)
    assert not last.passed and "fell from its peak 0.670 (step 4) to 0.125" in last.reason
    at_peak = run(rewards, accuracy, step=4)
    assert at_peak["heldout_accuracy"]["peak"] == 0.67 and tripwire_gate(at_peak, pair, "eval/accuracy", 0.05).passed
    stalled = run([0.1, 0.1, 0.1, 0.6, 0.6, 0.6], [(0, 0.01), (6, 0.03)])
    assert stalled["train_reward"]["z"] == pytest.approx(5.0) and stalled["train_reward"]["source"] == "rm"
    gate = tripwire_gate(stalled, pair, "eval/accuracy", 0.05)
    assert not gate.passed and "rose 5.0 times its starting spread" in gate.reason
    assert tripwire_gate(run([0.1, 0.1, 0.1, 0.6, 0.6, 0.6], [(0, 0.01), (6, 0.03)], rm=False), pair,
                         "eval/accuracy", 0.05).passed


def test_the_offline_gates_bounds_widen_as_their_share_of_alpha_shrinks(tmp_path):
    """The quality gate reads a one-sided bound at its share of ``--alpha`` (CanarySettings.offline_bounds: the
    turn-away half split with the canary's guardrails, capacity and shadow), from 20 / alpha replicates. A candidate
    2.5 points worse on 400 prompts (12 lost, 2 won) passes a 5-point margin at --alpha 0.5 and is refused at
    0.01: the bound moves down as alpha shrinks, and the reason names its level."""
    from eval.compare import compare_pair, resolve_entry
    from eval.settings import EvalSettings
    from eval.ship.gates import quality_gate
    from eval.ship.settings import CanarySettings
    from tests.eval.test_compare_units import fake_eval

    split = CanarySettings(alpha=0.05, slo_p95_ms=1000.0, capacity=True, offline=True).alpha_split()
    assert split["offline_quality"] == split["offline_diversity"] == split["errors"] == pytest.approx(0.025 / 6)
    assert sum(v for k, v in split.items() if k != "reward_non_inferior") == pytest.approx(0.05)
    base = [1.0] * 200 + [0.0] * 200
    cand = [0.0] * 12 + [1.0] * 188 + [1.0] * 2 + [0.0] * 198
    fake_eval(tmp_path / "inc", base, ["x"] * 400, 1e-4)
    fake_eval(tmp_path / "cand", cand, ["x"] * 400, 1e-4)
    entries = [resolve_entry(str(tmp_path / n), "best", EvalSettings(), None) for n in ("inc", "cand")]
    lows, gates = [], []
    for alpha in (0.5, 0.05, 0.01):
        bounds = CanarySettings(alpha=alpha, slo_p95_ms=1000.0, capacity=True, offline=True).offline_bounds()
        assert bounds["replicates"] == max(2000, math.ceil(20 / bounds["alpha"]))
        pair = compare_pair(*entries, alpha, bounds["replicates"], 0, bound_alpha=bounds["alpha"])
        row = pair["metrics"]["eval/accuracy"]
        assert row["replicates"] == bounds["replicates"] and row["bound_alpha"] == bounds["alpha"]
        lows.append(row["lower"])
        gates.append(quality_gate(pair, "eval/accuracy", 0.05))
    assert lows[0] > lows[1] > lows[2]
    assert gates[0].passed and not gates[2].passed
    assert f"one-sided {1 - 0.005 / 6:.2%} bound" in gates[2].reason

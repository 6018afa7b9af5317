"""The real ``Canary`` (eval.ship.canary) driven by the simulated service (eval.ship.simulate): each decision path
on seeded traffic, delayed rewards joined by id, the alpha split, and the records the canary reads."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from eval.ship.canary import Canary, CanarySettings, RecordReader
from eval.ship.power import observe, power_plan
from eval.ship.simulate import Cell, SimulatedService, Traffic, binomial_interval, requests_for_power, ship_once

SETTINGS = CanarySettings(slo_p95_ms=1000.0, budget_s=math.inf)


def canary_for(traffic: Traffic, effect: float, seed: int = 0, settings: CanarySettings = SETTINGS,
               shadow_fraction: float = 0.0) -> tuple[Canary, SimulatedService, list[dict]]:
    service = SimulatedService(traffic, effect, seed, shadow_fraction=shadow_fraction)
    events: list[dict] = []
    canary = Canary(settings, service.incumbent, service.candidate, service.route, service.set_share, service.fetch,
                    events.append, clock=service.clock, sleep=service.sleep, wall=service.clock)
    return canary, service, events


def test_alpha_split_is_one_budget():
    split = CanarySettings(alpha=0.05, slo_p95_ms=500.0, shadow=True).alpha_split()
    rollback_side = sum(v for k, v in split.items() if k != "reward_non_inferior")
    assert rollback_side == pytest.approx(0.05) and split["reward_worse"] == 0.025
    assert split["errors"] == split["missing_rewards"] == split["latency"] == split["shadow"] == pytest.approx(0.00625)
    assert split["reward_non_inferior"] == 0.05  # only the reward test promotes
    plain = CanarySettings(alpha=0.05, slo_p95_ms=None).alpha_split()
    assert set(plain) == {"reward_worse", "errors", "missing_rewards", "reward_non_inferior"}
    assert plain["errors"] == pytest.approx(0.0125)
    with pytest.raises(ValueError, match="betting, mixture"):
        CanarySettings(test="z")


def test_identical_models_are_promoted_and_a_drop_is_rolled_back():
    canary, service, events = canary_for(Traffic(), 0.0, seed=3)
    outcome, reason, evidence = canary.run()
    assert outcome == "promote" and "non-inferior" in reason and "e-value" in reason
    assert [e["share"] for e in events if e["event"] == "stage"] == [0.05, 0.25, 0.5]
    assert [e["config_version"] for e in events] == [2, 3, 4]  # each stage's version, as the service answered
    assert evidence["reward"]["e_non_inferior"] >= 20 and evidence["units"]["unknown_version"] == 0
    assert len(canary.stage_log) == 3 and evidence["alpha"]["reward_worse"] == 0.025
    canary, service, _ = canary_for(Traffic(), -0.2, seed=3)
    outcome, reason, evidence = canary.run()
    assert outcome == "rollback" and "reward is worse" in reason and evidence["reward"]["e_worse"] >= 40
    assert evidence["reward"]["difference"] < -0.1 and service.sent < 2000


@pytest.mark.parametrize(("traffic", "why"), [
    (Traffic(error_rate=0.01, candidate_error_rate=0.15), "error rate"),
    (Traffic(candidate_latency_factor=3.0), "p95 latency above the SLO"),
    (Traffic(candidate_missing=0.2), "missing rewards"),
])
def test_guardrails_roll_back(traffic: Traffic, why: str):
    canary, _, _ = canary_for(traffic, 0.0, seed=5)
    outcome, reason, evidence = canary.run()
    assert outcome == "rollback" and why in reason, reason
    name = {"error rate": "errors", "p95 latency above the SLO": "latency", "missing rewards": "missing_rewards"}[why]
    guard = evidence["guardrails"][name]
    assert guard["e_value"] >= guard["threshold"]


def test_delayed_rewards_are_counted_when_they_arrive_never_as_zero():
    canary, service, events = canary_for(Traffic(delay_s=30.0), 0.0, seed=7)
    outcome, _, evidence = canary.run()
    assert outcome == "promote"
    stage = events[1]  # stage 2 starts while stage 1's rewards are still arriving
    assert stage["units"]["pending_rewards"] > 0
    # Rewards past the timeout (60 s) are missing on both arms alike: no rollback for that.
    assert evidence["guardrails"]["missing_rewards"]["rate_incumbent"] > 0.05
    assert evidence["reward"]["mean_incumbent"] == pytest.approx(0.6, abs=0.05)  # not dragged towards 0


def test_a_request_with_n_choices_is_one_unit_its_choices_mean():
    """A request's choices were routed once: four rows of one completion id enter as one unit — the mean of its
    rewarded choices (1, 0 and a late 1 -> 2/3), a quarter failed, a quarter missing — once every row is read
    and no reward is awaited: a choice whose reward comes later holds the unit back (rows over two polls)."""
    polls: list[list[dict]] = [[], []]
    clock = [1000.0]

    def row(rid: str, index: int, model: str, reward: float | None, error: str | None = None) -> dict:
        return {"kind": "request", "id": rid, "index": index, "choices": 4, "time": clock[0], "arrival": clock[0],
                "model": model, "route": "default", "config_version": 2, "user": None, "e2e_s": 0.1,
                "error": error, "reward_expected": True, "reward": reward,
                "reward_source": None if reward is None else "rule:arithmetic"}

    canary = Canary(SETTINGS, "inc", "cand", "default", lambda share: (2, {"inc": 0.5, "cand": 0.5}),
                    lambda since: polls.pop(0) if polls else [], lambda event: None, wall=lambda: clock[0])
    canary.assignment.add_layout(2, {"inc": 0.5, "cand": 0.5})
    polls[0] = [row("a", 0, "cand", 1.0), row("a", 1, "cand", None), row("a", 2, "cand", None, "engine failed"),
                row("b", 0, "inc", 1.0), row("b", 1, "inc", 1.0)]
    canary._take()
    assert canary.units == 2 and canary.reward.units.candidate.n == 0 and canary.errors.units.candidate.n == 0
    polls[0] = [row("a", 3, "cand", 0.0), row("b", 2, "inc", 0.0), row("b", 3, "inc", 1.0),
                {"kind": "reward", "id": "a", "index": 1, "reward": 1.0, "reward_source": "rule:arithmetic"}]
    canary._take()
    reward, errors, missing = canary.reward.units, canary.errors.units, canary.missing.units
    assert (reward.candidate.n, reward.incumbent.n) == (1, 1)  # 8 rows, two units
    assert reward.candidate.total == pytest.approx(2 / 3) and reward.incumbent.total == pytest.approx(0.75)
    assert errors.candidate.total == pytest.approx(0.25) and missing.candidate.total == pytest.approx(0.25)
    assert canary.traffic["cand"].summary()["requests"] == 1 and canary.traffic["cand"].sequences == 4


def test_sticky_users_count_once_per_stage():
    canary, service, _ = canary_for(Traffic(users=300, user_sd=1.0), 0.0, seed=1)
    canary.run()
    units = canary.evidence(2)["units"]
    assert units["repeat_requests"] > 0.3 * service.sent  # 300 users: most requests are repeats
    assert units["units"] + units["repeat_requests"] <= service.sent


def test_budget_ends_inconclusive_and_the_shadow_stage_pairs_answers():
    small = replace(SETTINGS, budget_requests=300)
    canary, _, _ = canary_for(Traffic(), 0.0, settings=small)
    outcome, reason, _ = canary.run()
    assert outcome == "inconclusive" and "budget spent" in reason
    shadowed = replace(SETTINGS, shadow=True)
    canary, service, _ = canary_for(Traffic(), 0.0, settings=shadowed, shadow_fraction=0.5)
    passed, reason, evidence = canary.shadow(50)
    assert passed and evidence["reward"]["n_pairs"] >= 50 and "mirrored answers" in reason
    canary, service, _ = canary_for(Traffic(), -0.4, settings=shadowed, shadow_fraction=0.5)
    passed, reason, evidence = canary.shadow(400)
    assert not passed and "reward is worse" in reason and evidence["reward"]["mean_difference"] < -0.2


def test_reader_takes_each_row_once():
    rows = [{"kind": "request", "id": "c1", "index": 0, "time": 1.0, "model": "a"},
            {"kind": "reward", "id": "c1", "index": 0, "time": 2.0, "reward": 1.0, "reward_source": "x"}]
    reader = RecordReader(lambda since: rows, 0.0)
    assert len(reader.new_rows()) == 2 and reader.new_rows() == []


def test_ship_once_and_the_power_figures():
    assert ship_once(Cell("x"), 0.0, 11)[0] == "promote"
    result = {"outcomes": np.array(["rollback", "rollback", "promote", "rollback"]),
              "requests": np.array([10.0, 30.0, 5.0, 20.0])}
    assert requests_for_power(result, 0.5) == 20 and requests_for_power(result, 0.8) == math.inf
    low, high = binomial_interval(0.05, 2000)
    assert low == pytest.approx(0.0414, abs=1e-3) and high == pytest.approx(0.0603, abs=1e-3)


def test_dry_run_power_from_observed_records():
    service = SimulatedService(Traffic(rate=20.0), 0.0, 0)
    for _ in range(60):
        service.sleep(1.0)
    rows = service.fetch(0.0)
    observed = observe(rows, "default", "inc", 1000.0)
    assert observed["rate_per_s"] == pytest.approx(20, rel=0.15) and observed["reward_mean"] == pytest.approx(
        0.6, abs=0.06)
    plan = power_plan(observed, SETTINGS, sims=40)
    assert 500 < plan["requests_for_80pct_power"] < 10_000 and "warning" not in plan
    assert plan["minutes_for_80pct_power"] == pytest.approx(plan["requests_for_80pct_power"] / observed[
        "rate_per_s"] / 60)
    tight = power_plan(observed, replace(SETTINGS, budget_requests=400), sims=40)
    assert "cannot reach 80% power" in tight["warning"]
    assert "no rewarded requests" in power_plan(observe([], "default", "inc", None), SETTINGS)["warning"]


def test_ship_report_shows_stages_guardrails_prompts_and_the_alpha_split(tmp_path):
    from eval.ship.canary import settings_dict
    from eval.ship.run import write_ship_report

    canary, _, _ = canary_for(Traffic(), -0.2, seed=3)
    outcome, reason, evidence = canary.run()
    record = {"plan": {"candidate": {"name": "cand"}, "incumbent": {"name": "inc"}, "canary": settings_dict(SETTINGS),
                       "gates": {"gate_data": {"judged_by": ["builtin:arithmetic/test"],
                                               "chosen_by": ["builtin:arithmetic/val"], "independent": True}}},
              "gates": [{"name": "quality", "passed": True, "reason": "fine", "evidence": {"candidate": 0.5}}],
              "canary": {"outcome": outcome, "reason": reason, "evidence": evidence, "stages": canary.stage_log},
              "decision": {"decision": outcome, "reason": reason}}
    write_ship_report(tmp_path, record)
    text = (tmp_path / "ship_report.md").read_text()
    assert "**Decision: rollback**" in text and "judged on builtin:arithmetic/test" in text
    assert "reward_worse 0.025" in text and "| latency |" in text and "e-value (worse)" in text
    assert text.count("| 1 | 5% |") == 1 and text.count("| 2 | 25% |") == 1  # each stage once, the last mid-way
    assert (tmp_path / "ship.json").is_file() and (tmp_path / "ship_report.html").is_file()


def test_the_canary_decides_on_the_reward_source_it_is_told():
    """Requests without answers; 60% of answers get users' feedback, seconds late. Read as feedback, a candidate 20
    points worse is rolled back and an identical one promoted (equal feedback rates break no guardrail); read as
    rule rewards — there are none — nothing is decided, and nothing of the feedback leaks in."""
    traffic = Traffic(reward_source="feedback", delay_s=2.0, reward_share=0.6)
    feedback = replace(SETTINGS, reward_source="feedback")
    canary, _, _ = canary_for(traffic, -0.2, seed=3, settings=feedback)
    outcome, reason, evidence = canary.run()
    assert outcome == "rollback" and "reward is worse" in reason and evidence["reward_source"] == "feedback"
    canary, _, _ = canary_for(traffic, 0.0, seed=3, settings=feedback)
    outcome, reason, evidence = canary.run()
    assert outcome == "promote", reason
    missing = evidence["guardrails"]["missing_rewards"]
    assert 0.3 < missing["rate_candidate"] < 0.5 and 0.3 < missing["rate_incumbent"] < 0.5
    canary, _, _ = canary_for(traffic, -0.2, seed=3, settings=replace(SETTINGS, budget_requests=600))
    outcome, reason, evidence = canary.run()
    assert outcome == "inconclusive" and evidence["reward"]["n_candidate"] == 0 == evidence["reward"]["n_incumbent"]
    with pytest.raises(ValueError, match="rule, feedback, rm:NAME or judge:NAME"):
        CanarySettings(reward_source="users")
    with pytest.raises(ValueError, match="users never see a mirrored answer"):
        CanarySettings(reward_source="feedback", shadow=True)

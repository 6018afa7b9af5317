"""The canary's error rates by simulation (issue 28 item 3): many seeded canaries at once, vectorized over numpy.

Each simulated canary runs the ramp ``CanaryPlan`` describes: requests arrive ``look_every`` at a time, a share
``stage`` of them go to the candidate, each answer gets a 0/1 reward (candidate mean ``mu_candidate``, incumbent
``mu_incumbent``), and after every batch the test decides. "Worse" rolls it back at once, at any stage. A stage
steps up once the candidate has had ``min_per_stage`` requests at it (the early stages limit how much traffic a bad
candidate can reach; the rollback test watches them all along); the last stage promotes only when the test also
says non-inferior. The request budget ends a canary as inconclusive (the incumbent stays).

Two tests run over the same ramp:

- ``sequential``: the normal-mixture confidence sequence of ``eval.ship.sequential``, looked at after every batch;
- ``fixed``: what a canary without sequential statistics does: a one-sided z-test at ``alpha`` at the end of each
  stage (roll back if the candidate is significantly worse, else step up). It looks only once per stage, and still
  its false-rollback rate grows with the number of stages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from eval.ship.sequential import mixture_half_width

RUNNING, ROLLBACK, PROMOTE, INCONCLUSIVE = 0, 1, 2, 3
OUTCOMES = {ROLLBACK: "rollback", PROMOTE: "promote", INCONCLUSIVE: "inconclusive"}


@dataclass(frozen=True)
class CanaryPlan:
    """The ramp and the statistics' settings, as ``verl ship`` uses them."""

    stages: tuple[float, ...] = (0.05, 0.25, 0.5)  # candidate's traffic share per stage; then promote (100%)
    min_per_stage: int = 40  # candidate requests (with a reward) at a stage before it may step up
    budget: int = 10_000  # requests in all; then "inconclusive"
    look_every: int = 10  # requests between two looks
    margin: float = 0.05
    alpha: float = 0.05
    tau: float | None = None
    min_per_arm: int = 30
    variance_floor: float = 0.01


def simulate(plan: CanaryPlan, mu_incumbent: float, mu_candidate: float, sims: int = 2000, seed: int = 0,
             test: str = "sequential") -> dict:
    """Run ``sims`` canaries; returns the outcome rates and the requests each canary used."""
    if test not in ("sequential", "fixed"):
        raise ValueError(f"test must be sequential or fixed (got {test!r})")
    rng = np.random.default_rng(seed)
    stages = np.asarray(plan.stages, dtype=np.float64)
    tau = plan.tau if plan.tau is not None else max(plan.margin, 0.01)
    z = NormalDist().inv_cdf(1 - plan.alpha)  # one-sided, for the fixed test
    stage = np.zeros(sims, dtype=np.int64)
    at_stage = np.zeros(sims)  # candidate requests at the current stage
    n_c, s_c, n_i, s_i = (np.zeros(sims) for _ in range(4))
    outcome = np.full(sims, RUNNING)
    used = np.full(sims, plan.budget)
    for look in range(plan.budget // plan.look_every):
        active = outcome == RUNNING
        if not active.any():
            break
        share = stages[np.minimum(stage, len(stages) - 1)]
        k_c = rng.binomial(plan.look_every, share)
        k_i = plan.look_every - k_c
        r_c, r_i = rng.binomial(k_c, mu_candidate), rng.binomial(k_i, mu_incumbent)
        n_c += np.where(active, k_c, 0)
        s_c += np.where(active, r_c, 0)
        n_i += np.where(active, k_i, 0)
        s_i += np.where(active, r_i, 0)
        at_stage += np.where(active, k_c, 0)
        with np.errstate(invalid="ignore", divide="ignore"):
            m_c, m_i = s_c / n_c, s_i / n_i
            # 0/1 rewards: the sample variance is m (1 - m) n / (n - 1).
            v_c = np.maximum(m_c * (1 - m_c) * n_c / np.maximum(n_c - 1, 1), plan.variance_floor)
            v_i = np.maximum(m_i * (1 - m_i) * n_i / np.maximum(n_i - 1, 1), plan.variance_floor)
            v = v_c / np.maximum(n_c, 1) + v_i / np.maximum(n_i, 1)
        diff = m_c - m_i
        ready = active & (np.minimum(n_c, n_i) >= plan.min_per_arm)
        stage_done = at_stage >= plan.min_per_stage
        last = stage >= len(stages) - 1
        if test == "sequential":
            # Each decision is one-sided: the two-sided sequence at 2 alpha bounds each side by alpha.
            h = mixture_half_width(v, min(2 * plan.alpha, 0.5), tau)
            worse = ready & (diff + h < 0)
            # Earlier stages step up on their minimum requests unless the test says worse; the last one promotes
            # only on evidence of non-inferiority.
            step_up = ready & ~worse & stage_done & (~last | (diff - h > -plan.margin))
        else:  # one look per stage, at its end
            look_now = ready & stage_done
            worse = look_now & (diff / np.sqrt(v) < -z)
            step_up = look_now & ~worse
        requests = (look + 1) * plan.look_every
        outcome[worse] = ROLLBACK
        used[worse] = requests
        stage[step_up] += 1
        at_stage[step_up] = 0
        promoted = step_up & (stage >= len(stages))
        outcome[promoted] = PROMOTE
        used[promoted] = requests
    outcome[outcome == RUNNING] = INCONCLUSIVE
    rates = {name: float(np.mean(outcome == code)) for code, name in OUTCOMES.items()}
    return {"test": test, "sims": sims, "mu_incumbent": mu_incumbent, "mu_candidate": mu_candidate, **rates,
            "requests": used, "outcomes": outcome}


def requests_for_power(result: dict, power: float = 0.8, outcome: str = "rollback") -> float:
    """Requests by which a share ``power`` of the canaries reached ``outcome`` (inf if fewer ever did)."""
    code = {v: k for k, v in OUTCOMES.items()}[outcome]
    reached = np.where(result["outcomes"] == code, result["requests"], np.inf)
    value = float(np.quantile(reached, power, method="inverted_cdf"))
    return value if math.isfinite(value) else float("inf")


def error_rates(plan: CanaryPlan, mu: float = 0.6, sims: int = 2000, seed: int = 0, drop: float = 0.10) -> dict:
    """The figures the issue asks for: A/A false rollbacks, false promotes at the margin, requests to catch a
    ``drop`` at 80% power, each for the sequential and the per-stage fixed test."""
    out = {}
    for test in ("sequential", "fixed"):
        same = simulate(plan, mu, mu, sims, seed, test)
        at_margin = simulate(plan, mu, mu - plan.margin, sims, seed + 1, test)
        dropped = simulate(plan, mu, mu - drop, sims, seed + 2, test)
        out[test] = {"false_rollback": same["rollback"], "aa_promote": same["promote"],
                     "false_promote_at_margin": at_margin["promote"],
                     "drop_rolled_back": dropped["rollback"],
                     "requests_80pct_power": requests_for_power(dropped)}
    return out

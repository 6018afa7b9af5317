"""Power and budget before the canary starts (``verl ship --dry-run``).

What the route's records show now (its request rate, the incumbent's rewards, errors and latency) becomes a
``Traffic`` for the simulated service, and the real canary is run against it: how many requests (and minutes, at the
observed rate) it needs to roll back a candidate whose reward is lower by the margin with 80% power, how often it
would within the budget, and how identical models end (promoted / inconclusive).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np

from eval.ship.canary import CanarySettings
from eval.ship.simulate import Cell, Traffic, requests_for_power, simulate

POWER = 0.8


def observe(rows: list[dict], route: str, incumbent: str, slo_ms: float | None) -> dict[str, Any]:
    """The route's traffic in ``rows`` (request rows of the route, any model; the incumbent's rewards)."""
    mine = [r for r in rows if r.get("kind", "request") == "request" and r.get("route") == route
            and not r.get("shadow")]
    times = [r["time"] for r in mine if r.get("time") is not None]
    span = max(times) - min(times) if len(times) > 1 else 0.0
    inc = [r for r in mine if r.get("model") == incumbent]
    rewards = [float(r["reward"]) for r in inc if r.get("reward") is not None and not r.get("error")]
    latencies = [1000.0 * r["e2e_s"] for r in inc if not r.get("error") and r.get("e2e_s") is not None]
    out: dict[str, Any] = {"requests": len(mine), "seconds": span, "rate_per_s": len(mine) / span if span > 0 else None,
                           "rewarded": len(rewards), "reward_mean": float(np.mean(rewards)) if rewards else None,
                           "reward_sd": float(np.std(rewards)) if rewards else None,
                           "error_rate": sum(bool(r.get("error")) for r in inc) / len(inc) if inc else 0.0,
                           "reward_share": len(rewards) / len(inc) if inc else 0.0,
                           "with_user": sum(r.get("user") is not None for r in mine) / len(mine) if mine else 0.0,
                           "p95_ms": float(np.percentile(latencies, 95)) if latencies else None}
    out["sample"] = rewards
    out["slo_ms"] = slo_ms
    return out


def power_plan(observed: dict[str, Any], settings: CanarySettings, sims: int = 200, seed: int = 0) -> dict:
    """Requests and minutes to roll back a drop of the margin with 80% power (simulated through the real canary),
    the share rolled back within the budget, and how identical models end; ``warning`` when the budget falls short."""
    if not observed["sample"] or not observed["rate_per_s"]:
        return {"warning": "no rewarded requests of the incumbent on the route yet: the canary cannot judge the "
                           "reward (send the `verl` field with the answer, or post late rewards to "
                           "/admin/records/rewards), and no rate to plan with", **_public(observed)}
    sample = tuple(float(x) for x in np.random.default_rng(seed).choice(observed["sample"],
                                                                        min(2000, len(observed["sample"]))))
    bounded = min(sample) >= 0.0 and max(sample) <= 1.0
    slo = settings.slo_p95_ms
    ratio = observed["p95_ms"] / slo if slo and observed["p95_ms"] else 0.5
    traffic = Traffic(rate=observed["rate_per_s"], reward="empirical", sample=sample,
                      error_rate=observed["error_rate"], latency_p95_ratio=min(ratio, 5.0), slo_ms=slo or 1000.0,
                      reward_share=max(observed["reward_share"], 0.01))
    cell = Cell("observed", traffic, replace(settings, budget_s=math.inf, test=settings.test if bounded else "mixture"))
    dropped = simulate(cell, -settings.margin, sims, seed)
    same = simulate(cell, 0.0, sims, seed + 1)
    needed = requests_for_power(dropped, POWER)
    out = {**_public(observed), "sims": sims, "margin": settings.margin,
           "drop_rolled_back_within_budget": dropped["rollback"], "requests_for_80pct_power": needed,
           "minutes_for_80pct_power": needed / observed["rate_per_s"] / 60 if math.isfinite(needed) else math.inf,
           "identical_promoted": same["promote"], "identical_inconclusive": same["inconclusive"],
           "identical_requests_median": float(np.median(same["requests"])),
           "budget_requests": settings.budget_requests, "budget_minutes": settings.budget_s / 60}
    budget = min(settings.budget_requests, settings.budget_s * observed["rate_per_s"])
    if not needed <= budget:
        out["warning"] = (f"the budget ({settings.budget_requests} requests, {settings.budget_s:g} s at "
                          f"{observed['rate_per_s']:.1f} requests/s) cannot reach 80% power for a drop of the margin "
                          f"{settings.margin:g}: {_count(needed)} requests are needed; raise --budget-requests / "
                          "--budget-s, or expect 'inconclusive'")
    if not bounded:
        out["note"] = "rewards outside [0, 1] were observed: planned with --test mixture"
    return out


def _count(value: float) -> str:
    return f"{value:.0f}" if math.isfinite(value) else "more than the budget's"


def _public(observed: dict[str, Any]) -> dict[str, Any]:
    return {"observed": {k: v for k, v in observed.items() if k != "sample"}}

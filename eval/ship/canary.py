"""The canary stage of ``verl ship``: ramp the route's traffic to the candidate and decide on live evidence.

Each stage gives the candidate a share of the route (``PUT /admin/routes/R``, the incumbent keeps the rest), then
reads the service's online records (``GET /admin/records``: every answered request, with the model that answered,
its latency, error and, when the client sent the ``verl`` field, its rule reward) every ``poll_s``:

- **reward**: the always-valid sequential test of ``eval.ship.sequential`` on the rewards of both models — "worse"
  rolls back at once, at any stage; the last stage promotes only on "non-inferior";
- **guardrails**: the candidate's error rate above the incumbent's by more than ``max_error_increase``, or its p95
  latency above ``slo_p95_ms`` (each once it has ``min_per_arm`` requests), rolls back;
- a stage steps up once the candidate answered ``min_per_stage`` rewarded requests at it;
- the **budgets** (requests, seconds) end the canary as inconclusive: the incumbent keeps the route.

Every decision (and every stage change) goes to the audit log with its evidence and the service's config version.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from eval.ship.sequential import SequentialTest

Outcome = Literal["promote", "rollback", "inconclusive"]


@dataclass(frozen=True)
class CanarySettings:
    stages: tuple[float, ...] = (0.05, 0.25, 0.5)
    min_per_stage: int = 40
    margin: float = 0.05
    alpha: float = 0.05
    min_per_arm: int = 30
    max_error_increase: float = 0.02
    slo_p95_ms: float | None = None
    budget_requests: int = 10_000
    budget_s: float = 600.0
    poll_s: float = 1.0

    def __post_init__(self) -> None:
        if not self.stages or any(not 0 < s < 1 for s in self.stages) or list(self.stages) != sorted(self.stages):
            raise ValueError(f"canary stages must rise within (0, 1), e.g. 0.05,0.25,0.5 (got {list(self.stages)}); "
                             "the last step to 100% is the promote")


class RecordReader:
    """New online records of two models since the canary started (each row once, also across fleet replicas).
    ``shadow_of``: the model whose rows must be mirrored ones (the shadow stage); every other row must be real."""

    def __init__(self, fetch: Any, since: float, models: tuple[str, str], shadow_of: str | None = None):
        self.fetch, self.since, self.models, self.shadow_of = fetch, since, models, shadow_of
        self.seen: set[tuple] = set()

    def new_rows(self) -> list[dict]:
        rows = []
        for row in self.fetch(self.since):
            key = (row.get("time"), row.get("model"), row.get("prompt_id"), row.get("e2e_s"), row.get("replica"),
                   row.get("shadow"))
            wanted = row.get("model") in self.models and bool(row.get("shadow")) == (row.get("model") == self.shadow_of)
            if wanted and key not in self.seen:
                self.seen.add(key)
                rows.append(row)
        return rows


@dataclass
class ArmTraffic:
    """What one model's requests showed during the canary (rewards feed the sequential test separately)."""

    requests: int = 0
    errors: int = 0
    latencies_ms: list[float] = field(default_factory=list)

    def add(self, row: dict) -> None:
        self.requests += 1
        if row.get("error"):
            self.errors += 1
        elif row.get("e2e_s") is not None:
            self.latencies_ms.append(1000.0 * float(row["e2e_s"]))

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    def p95_ms(self) -> float | None:
        return float(np.percentile(self.latencies_ms, 95)) if self.latencies_ms else None


class Canary:
    """The ramp loop. ``set_share(share)`` moves the route; ``fetch(since)`` returns records; ``audit(event)``
    appends to the audit log; ``version()`` reads the service's config version (all injected by ``verl ship``)."""

    def __init__(self, settings: CanarySettings, incumbent: str, candidate: str, set_share: Any, fetch: Any,
                 audit: Any, version: Any, clock: Any = time.monotonic, sleep: Any = time.sleep):
        self.settings, self.incumbent, self.candidate = settings, incumbent, candidate
        self.set_share, self.audit, self.version, self.clock, self.sleep = set_share, audit, version, clock, sleep
        self.reader = RecordReader(fetch, time.time(), (incumbent, candidate))
        self.test = SequentialTest(margin=settings.margin, alpha=settings.alpha, min_per_arm=settings.min_per_arm)
        self.traffic = {incumbent: ArmTraffic(), candidate: ArmTraffic()}
        self.stage_log: list[dict] = []

    def evidence(self, stage: int) -> dict:
        cand, inc = self.traffic[self.candidate], self.traffic[self.incumbent]
        return {"stage": stage + 1, "share": self.settings.stages[stage], "reward": self.test.evidence(),
                "candidate": {"requests": cand.requests, "error_rate": cand.error_rate, "p95_ms": cand.p95_ms()},
                "incumbent": {"requests": inc.requests, "error_rate": inc.error_rate, "p95_ms": inc.p95_ms()},
                "config_version": self.version()}

    def guardrail(self) -> str | None:
        """Why the candidate breaks a guardrail, or None."""
        cand, inc = self.traffic[self.candidate], self.traffic[self.incumbent]
        s = self.settings
        if cand.requests < s.min_per_arm:
            return None
        if cand.error_rate > inc.error_rate + s.max_error_increase:
            return (f"error rate {cand.error_rate:.1%} against the incumbent's {inc.error_rate:.1%} "
                    f"(allowed: +{s.max_error_increase:.1%})")
        p95 = cand.p95_ms()
        if s.slo_p95_ms is not None and p95 is not None and p95 > s.slo_p95_ms:
            return f"p95 latency {p95:.0f} ms above the SLO {s.slo_p95_ms:g} ms"
        return None

    def _take(self) -> int:
        """Read new records; returns how many rewarded candidate rows arrived."""
        added = 0
        for row in self.reader.new_rows():
            self.traffic[row["model"]].add(row)
            if row.get("reward") is not None and not row.get("error"):
                arm = self.test.candidate if row["model"] == self.candidate else self.test.incumbent
                arm.add([float(row["reward"])])
                added += row["model"] == self.candidate
        return added

    def shadow(self, requests: int) -> tuple[bool, str, dict]:
        """The shadow stage: the route's answers stay the incumbent's while a share of its requests is mirrored to
        the candidate (set by the caller); the same test reads the mirrored rewards. Passes after ``requests``
        rewarded mirrors without "worse" (or on "non-inferior"); fails on "worse" or a guardrail; the budgets
        count as for the canary."""
        s = self.settings
        start = self.clock()
        self.reader = RecordReader(self.reader.fetch, time.time(), (self.incumbent, self.candidate),
                                   shadow_of=self.candidate)
        while True:
            self.sleep(s.poll_s)
            self._take()
            evidence = {**self.evidence(0), "stage": "shadow", "share": 0.0}
            broken = self.guardrail()
            if broken is not None:
                return False, f"guardrail in shadow: {broken}", evidence
            decision = self.test.decide()
            if decision == "rollback":
                return False, "in shadow, the candidate's reward is worse than the incumbent's", evidence
            if self.test.candidate.n >= requests or decision == "non_inferior":
                self._reset()
                return True, f"{self.test_snapshot['n_candidate']} mirrored answers, reward not worse", evidence
            used = sum(t.requests for t in self.traffic.values())
            if used >= s.budget_requests or self.clock() - start >= s.budget_s:
                return False, f"shadow budget spent ({used} requests) without enough mirrored rewards", evidence

    def _reset(self) -> None:
        """The canary starts its evidence afresh: shadow rows are not the traffic it decides on."""
        self.test_snapshot = self.test.evidence()
        self.test = SequentialTest(margin=self.settings.margin, alpha=self.settings.alpha,
                                   min_per_arm=self.settings.min_per_arm)
        self.traffic = {self.incumbent: ArmTraffic(), self.candidate: ArmTraffic()}
        self.reader = RecordReader(self.reader.fetch, time.time(), (self.incumbent, self.candidate))

    def run(self) -> tuple[Outcome, str, dict]:
        """Ramp until promote, rollback or a budget; returns (outcome, reason, evidence). The caller moves the
        route for the outcome (the canary leaves it at the last stage's share)."""
        s = self.settings
        start = self.clock()
        for stage, share in enumerate(s.stages):
            self.set_share(share)
            self.audit({"event": "stage", **self.evidence(stage)})
            at_stage = 0
            last = stage == len(s.stages) - 1
            while True:
                self.sleep(s.poll_s)
                at_stage += self._take()
                decision = self.test.decide()
                broken = self.guardrail()
                if broken is not None:
                    return "rollback", f"guardrail: {broken}", self.evidence(stage)
                if decision == "rollback":
                    return ("rollback", "the candidate's reward is worse than the incumbent's (the sequential test's "
                            "interval lies below 0)", self.evidence(stage))
                if at_stage >= s.min_per_stage and (not last or decision == "non_inferior"):
                    self.stage_log.append(self.evidence(stage))
                    if last:
                        return ("promote", f"non-inferior: the reward difference's interval lies above "
                                f"-{s.margin:g}", self.evidence(stage))
                    break
                used = sum(t.requests for t in self.traffic.values())
                if used >= s.budget_requests or self.clock() - start >= s.budget_s:
                    return ("inconclusive", f"budget spent ({used} requests, {self.clock() - start:.0f} s) without a "
                            "decision", self.evidence(stage))
        raise AssertionError("unreachable: the last stage returns")

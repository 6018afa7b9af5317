"""The canary stage of ``verl ship``: ramp the route's traffic to the candidate and decide on live evidence.

Each stage gives the candidate a share of the route (``PUT /admin/routes/R``; the service answers with the config
version the new weights carry), then reads the service's online records (``GET /admin/records``) every ``poll_s``.
The records say, per request, which model answered, under which config version and for which (hashed) user it was
routed, whether it failed, how long it took, and its reward — in the row, or in a reward row that arrives later and
is joined by the completion id. ``eval.ship.units`` turns them into randomized units. The unit is the request,
never a choice: a request with n choices (prompts x n for a completion) was routed once, and its choices share its
prompt, so they enter as one unit — the mean reward of its rewarded choices, the share of its choices that failed,
the share of those expecting a reward that have none (counted as separate units, identical models were rolled back
12.0% of the time in eval.ship.simulate's n = 4 cell, prompts of varying difficulty; docs/shipping.md). On the
units:

- **reward** (``eval.ship.sequential.RewardTest``): "worse" rolls back at once, at any stage; the last stage
  promotes only on "non-inferior";
- **guardrails**, each a sequential test with its own share of alpha: the candidate's error rate above the
  incumbent's by more than ``max_error_increase``; its missing-reward rate above the incumbent's by more than
  ``max_missing_increase`` (an errored request, or a reward not in by ``reward_timeout_s``, is missing — never 0,
  never dropped); its p95 latency above ``slo_p95_ms`` (a sequential quantile test). Any one rolls back;
- a stage steps up once the candidate has ``min_per_stage`` rewarded units at it;
- the **budgets** (requests, seconds) end the canary as inconclusive: the incumbent keeps the route.

One alpha covers every decision (``CanarySettings.alpha_split``): rolling back identical models happens with
probability <= alpha through any test (Bonferroni over the reward test, each guardrail and the shadow stage), and
promoting a candidate worse by the margin with probability <= alpha (only the reward test promotes).

Every decision (and every stage change) goes to the audit log with its evidence and the config version.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np

from eval.ship.sequential import ExceedanceTest, PairedWorseTest, RateIncreaseTest, RewardTest
from eval.ship.settings import CanarySettings
from eval.ship.units import Randomization
from verl.data.records import source_matches

Outcome = Literal["promote", "rollback", "inconclusive"]


class RecordReader:
    """New online records since the canary started, each row once (also across fleet replicas)."""

    def __init__(self, fetch: Any, since: float):
        self.fetch, self.since = fetch, since
        self.seen: set[tuple] = set()

    def new_rows(self) -> list[dict]:
        rows = []
        for row in self.fetch(self.since):
            if row.get("id") is not None:
                key = (row.get("kind"), row["id"], row.get("index"), row.get("shadow"), row.get("reward_source"),
                       row.get("time"))
            else:  # records written before rows had ids
                key = (row.get("time"), row.get("model"), row.get("prompt_id"), row.get("e2e_s"), row.get("replica"),
                       row.get("shadow"))
            if key not in self.seen:
                self.seen.add(key)
                rows.append(row)
        return rows


@dataclass
class ArmTraffic:
    """What one model's requests showed during the canary (for the evidence; the tests read units)."""

    requests: int = 0
    sequences: int = 0  # the requests' choices (rows): n per request
    errors: int = 0  # failed sequences
    latencies_ms: list[np.ndarray] = field(default_factory=list)

    def p95_ms(self) -> float | None:
        values = np.concatenate(self.latencies_ms) if self.latencies_ms else np.empty(0)
        return float(np.percentile(values, 95)) if values.size else None

    def summary(self) -> dict:
        return {"requests": self.requests, "sequences": self.sequences, "errors": self.errors,
                "error_rate": self.errors / self.sequences if self.sequences else None, "p95_ms": self.p95_ms()}


@dataclass
class Unit:
    """A randomized request and what its choices showed so far; it enters the error test once all ``choices``
    rows are read and the reward tests once none of its rewards is still awaited (or at ``deadline``)."""

    candidate: bool
    q: float
    version: int
    deadline: float  # wall time by which its rewards must be in
    choices: int = 1  # rows the request has (the record's `choices`; 1 in records written before it)
    rows: int = 0
    failed: int = 0
    expected: int = 0  # choices expecting a reward
    rewards: list[float] = field(default_factory=list)
    missing: int = 0
    waiting: int = 0  # expected rewards neither in nor past the deadline
    counted_errors: bool = False


def request_rows(rows: list[dict], route: str) -> list[dict]:
    """The route's request rows (not mirrors, not reward rows), in the order they were routed."""
    mine = [r for r in rows if r.get("kind", "request") == "request" and r.get("route") == route
            and not r.get("shadow")]
    return sorted(mine, key=lambda r: r.get("arrival") or r.get("time") or 0.0)


class Canary:
    """The ramp loop. ``set_share(share)`` moves the route and returns ``(config version, the route's weights)``;
    ``fetch(since)`` returns records; ``audit(event)`` appends to the audit log (all injected by ``verl ship``, or
    by ``eval.ship.simulate``'s simulated service)."""

    def __init__(self, settings: CanarySettings, incumbent: str, candidate: str, route: str, set_share: Any,
                 fetch: Any, audit: Any, clock: Any = time.monotonic, sleep: Any = time.sleep, wall: Any = time.time):
        self.settings, self.incumbent, self.candidate, self.route = settings, incumbent, candidate, route
        self.set_share, self.fetch, self.audit = set_share, fetch, audit
        self.clock, self.sleep, self.wall = clock, sleep, wall
        self.alpha = settings.alpha_split()
        self.stage_log: list[dict] = []
        self._fresh()

    def _fresh(self) -> None:
        """Evidence starts afresh (the canary after the shadow stage: mirrored rows are not its traffic)."""
        s, a = self.settings, self.alpha
        self.reader = RecordReader(self.fetch, self.wall())
        self.assignment = Randomization(self.incumbent, self.candidate)
        self.reward = RewardTest(margin=s.margin, alpha_rollback=a["reward_worse"],
                                 alpha_promote=a["reward_non_inferior"], method=s.test, min_per_arm=s.min_per_arm)
        self.errors = RateIncreaseTest(allowed=s.max_error_increase, alpha=a["errors"])
        self.missing = RateIncreaseTest(allowed=s.max_missing_increase, alpha=a["missing_rewards"])
        self.latency = ExceedanceTest(slo=s.slo_p95_ms, alpha=a["latency"]) if s.slo_p95_ms is not None else None
        self.traffic = {self.incumbent: ArmTraffic(), self.candidate: ArmTraffic()}
        self.requests: dict[Any, Unit | None] = {}  # requests read, by completion id: their unit (None: not one,
        # or already entered: a straggling row of it changes nothing)
        self.live: dict[Any, Unit] = {}  # units not yet in every test
        self.pending: dict[tuple, Unit] = {}  # units waiting for a choice's reward, by (completion id, index)
        self.early: dict[tuple, float] = {}  # rewards whose request row has not been read yet
        self.read: set[tuple] = set()  # (completion id, index) of every request row read
        self.stage_version = -1
        self.at_stage = 0  # the candidate's rewarded units at the current stage
        self.units = 0

    # ------------------------------------------------------------ reading records

    def _take(self) -> None:
        """Read new records into the tests."""
        rows = self.reader.new_rows()
        latencies: dict[str, list[float]] = {model: [] for model in self.traffic}
        for row in request_rows(rows, self.route):
            unit = self._request_unit(row)
            traffic = self.traffic.get(row["model"])
            if traffic is None:
                continue
            index = row.get("index", 0)
            self.read.add((row.get("id"), index))
            error = bool(row.get("error"))
            traffic.sequences += 1
            traffic.errors += error
            if not error and row.get("e2e_s") is not None:
                latencies[row["model"]].append(1000.0 * row["e2e_s"])
            if unit is None:
                continue
            unit.rows += 1
            unit.failed += error
            reward, expected = self._own_reward(row)
            if reward is not None and not error:
                unit.expected += 1
                unit.rewards.append(float(reward))
            elif expected and error:
                unit.expected += 1
                unit.missing += 1
            elif expected and row.get("id") is not None:
                key = (row["id"], index)
                unit.expected += 1
                if key in self.early:
                    unit.rewards.append(self.early.pop(key))
                else:
                    unit.waiting += 1
                    self.pending[key] = unit
        for row in rows:
            if row.get("kind") != "reward" or row.get("shadow") or not self._wanted(row):
                continue
            key = (row.get("id"), row.get("index", 0))
            unit = self.pending.pop(key, None)
            if unit is not None:
                unit.waiting -= 1
                unit.rewards.append(float(row["reward"]))
            elif key not in self.read:  # its request is still to come (a reward for a non-unit is not kept)
                self.early.setdefault(key, float(row["reward"]))
        now = self.wall()
        for key in [k for k, u in self.pending.items() if u.deadline <= now]:
            unit = self.pending.pop(key)
            unit.waiting -= 1
            unit.missing += 1
        self._enter(now)
        for model, values in latencies.items():
            self.traffic[model].latencies_ms.append(np.asarray(values, dtype=np.float64))
        if self.latency is not None:
            self.latency.add(self.traffic[self.candidate].latencies_ms[-1])

    def _request_unit(self, row: dict) -> Unit | None:
        """The unit of the request this row is a choice of, drawn at its first row (None: not a unit). Rows
        without an id (records before rows had them) are requests of their own."""
        key = row.get("id") if row.get("id") is not None else object()
        if key in self.requests:
            return self.requests[key]
        model, version = row["model"], row.get("config_version")
        q = self.assignment.assign(version, model, row.get("user"))
        unit = None
        if model in self.traffic:
            self.traffic[model].requests += 1
            if q is not None:
                self.units += 1
                unit = Unit(model == self.candidate, q, int(version),
                            float(row.get("time") or self.wall()) + self.settings.reward_timeout_s,
                            choices=max(1, int(row.get("choices") or 1)))
        self.requests[key] = unit
        if unit is not None:
            self.live[key] = unit
        return unit

    def _enter(self, now: float) -> None:
        """Units whose choices are all read enter the error test; those with no reward still awaited enter the
        reward and missing-reward tests: one unit each, its choices' mean."""
        rewards, missing, failed = Columns(), Columns(), Columns()  # (arm, q, outcome) per unit
        for key, unit in list(self.live.items()):
            complete = unit.rows >= unit.choices or now >= unit.deadline  # a row never written: what was read
            if complete and not unit.counted_errors and unit.rows:
                failed.add(unit.candidate, unit.q, unit.failed / unit.rows)
                unit.counted_errors = True
            if not complete or unit.waiting:
                continue
            if unit.expected:
                missing.add(unit.candidate, unit.q, unit.missing / unit.expected)
            if unit.rewards:
                rewards.add(unit.candidate, unit.q, float(np.mean(unit.rewards)))
                if unit.candidate and unit.version == self.stage_version:
                    self.at_stage += 1
            del self.live[key]
            self.requests[key] = None
        self.reward.add(*rewards.arrays())
        self.errors.add(*failed.arrays())
        self.missing.add(*missing.arrays())

    def _wanted(self, row: dict) -> bool:
        """A reward row of the source decided on (verl.data.records.source_matches)."""
        return source_matches(row.get("reward_source"), self.settings.reward_source)

    def _own_reward(self, row: dict) -> tuple[float | None, bool]:
        """A request row's reward from the source decided on (None when it has none, or another source's), and
        whether one is expected: a rule reward only for requests that carried an answer; feedback, a reward model
        or a judge can score any answer, so every answered request expects one (within ``reward_timeout_s``)."""
        reward = row.get("reward") if self._wanted(row) else None
        expected = bool(row.get("reward_expected")) if self.settings.reward_source.startswith("rule") else True
        return reward, expected

    # ------------------------------------------------------------ decisions

    def guardrail(self) -> str | None:
        """Why the candidate breaks a guardrail (its sequential test rejected), or None."""
        for test, what, allowed in ((self.errors, "error rate", self.settings.max_error_increase),
                                    (self.missing, "missing rewards", self.settings.max_missing_increase)):
            if test.rejected:
                e = test.evidence()
                return (f"{what} {_pct(e['rate_candidate'])} against the incumbent's {_pct(e['rate_incumbent'])} "
                        f"(allowed: +{allowed:.1%}; e-value {e['e_value']:.0f} >= {e['threshold']:.0f})")
        if self.latency is not None and self.latency.rejected:
            e = self.latency.evidence()
            return (f"p95 latency above the SLO {self.settings.slo_p95_ms:g} ms: {e['above_slo']} of {e['n']} "
                    f"answers slower (e-value {e['e_value']:.0f} >= {e['threshold']:.0f})")
        return None

    def evidence(self, stage: int | str) -> dict:
        share = self.settings.stages[stage] if isinstance(stage, int) else 0.0
        guardrails = {"errors": self.errors.evidence(), "missing_rewards": self.missing.evidence()}
        if self.latency is not None:
            guardrails["latency"] = self.latency.evidence()
        return {"stage": stage + 1 if isinstance(stage, int) else stage, "share": share,
                "reward_source": self.settings.reward_source,
                "config_version": self.stage_version, "reward": self.reward.evidence(), "guardrails": guardrails,
                "candidate": self.traffic[self.candidate].summary(),
                "incumbent": self.traffic[self.incumbent].summary(),
                "units": {"units": self.units, "pending_rewards": len(self.pending),
                          "repeat_requests": self.assignment.repeats,
                          "unknown_version": self.assignment.unknown_version},
                "alpha": self.alpha}

    def _used(self) -> int:
        return sum(t.requests for t in self.traffic.values())  # requests, whatever their n

    def run(self) -> tuple[Outcome, str, dict]:
        """Ramp until promote, rollback or a budget; returns (outcome, reason, evidence). The caller moves the
        route for the outcome (the canary leaves it at the last stage's share)."""
        s = self.settings
        start = self.clock()
        for stage, share in enumerate(s.stages):
            version, weights = self.set_share(share)
            self.assignment.add_layout(version, weights)
            self.stage_version, self.at_stage = int(version), 0
            self.audit({"event": "stage", **self.evidence(stage)})
            last = stage == len(s.stages) - 1
            while True:
                self.sleep(s.poll_s)
                self._take()
                broken = self.guardrail()
                if broken is not None:
                    return "rollback", f"guardrail: {broken}", self.evidence(stage)
                decision = self.reward.decide()
                if decision == "rollback":
                    e = self.reward.evidence()
                    return ("rollback", f"the candidate's reward is worse than the incumbent's "
                            f"({describe_reward(e, 'worse')})", self.evidence(stage))
                if self.at_stage >= s.min_per_stage and (not last or decision == "non_inferior"):
                    self.stage_log.append(self.evidence(stage))
                    if last:
                        return ("promote", f"non-inferior: the reward is not worse than the incumbent's by "
                                f"{s.margin:g} or more ({describe_reward(self.reward.evidence(), 'non_inferior')})",
                                self.evidence(stage))
                    break
                used = self._used()
                if used >= s.budget_requests or self.clock() - start >= s.budget_s:
                    return ("inconclusive", f"budget spent ({used} requests, {self.clock() - start:.0f} s) without a "
                            "decision", self.evidence(stage))
        raise AssertionError("unreachable: the last stage returns")

    # ------------------------------------------------------------ the shadow stage

    def shadow(self, requests: int) -> tuple[bool, str, dict]:
        """The shadow stage: the route's answers stay the incumbent's while a share of its requests is mirrored to
        the candidate (set by the caller). Each mirrored request is a pair — the candidate's and the incumbent's
        answer to the same request — so the tests are paired (``PairedWorseTest``) and take the shadow's share of
        alpha, half for the reward, half for errors. Passes after ``requests`` rewarded pairs without "worse";
        fails on "worse"; the budgets count as for the canary."""
        s = self.settings
        alpha = self.alpha["shadow"]
        reward = PairedWorseTest(alpha=alpha / 2, scale=max(s.margin, 0.01))
        errors = PairedWorseTest(alpha=alpha / 2, allowed=s.max_error_increase, scale=max(s.max_error_increase, 0.01))
        pairs: dict[tuple, ShadowPair] = {}
        start = self.clock()
        used = 0

        def evidence() -> dict:
            return {"stage": "shadow", "share": 0.0, "reward": reward.evidence(), "errors": errors.evidence(),
                    "alpha": alpha}

        while True:
            self.sleep(s.poll_s)
            d_reward, d_error = [], []
            for row in self.reader.new_rows():
                if row.get("route") != self.route or row.get("id") is None:
                    continue
                mirrored = bool(row.get("shadow"))
                if (row.get("model"), mirrored) not in ((self.candidate, True), (self.incumbent, False)):
                    continue
                pair = pairs.setdefault((row["id"], row.get("index", 0)), ShadowPair())
                if row.get("kind") == "reward":
                    if self._wanted(row):
                        pair.rewards[mirrored] = float(row["reward"])
                else:
                    used += not mirrored
                    pair.errors[mirrored] = bool(row.get("error"))
                    own, _ = self._own_reward(row)
                    if own is not None:
                        pair.rewards[mirrored] = own
                if len(pair.errors) == 2 and not pair.errors_counted:
                    pair.errors_counted = True
                    d_error.append(float(pair.errors[False]) - float(pair.errors[True]))
                if len(pair.rewards) == 2:
                    d_reward.append(pair.rewards[True] - pair.rewards[False])
                    pairs.pop((row["id"], row.get("index", 0)))
            reward.add(np.asarray(d_reward, dtype=np.float64))
            errors.add(np.asarray(d_error, dtype=np.float64))
            if errors.rejected:
                return False, "in shadow, the candidate's error rate is above the incumbent's (paired test)", evidence()
            if reward.rejected:
                return (False, "in shadow, the candidate's reward is worse than the incumbent's (paired test)",
                        evidence())
            if reward.moments.n >= requests:
                self._fresh()
                return True, f"{reward.moments.n} mirrored answers, reward not worse", evidence()
            if used >= s.budget_requests or self.clock() - start >= s.budget_s:
                return False, f"shadow budget spent ({used} requests) without enough mirrored rewards", evidence()


@dataclass
class ShadowPair:
    """A mirrored request's two answers, keyed by "mirrored?" (True: the candidate's)."""

    errors: dict[bool, bool] = field(default_factory=dict)
    rewards: dict[bool, float] = field(default_factory=dict)
    errors_counted: bool = False


class Columns(list):
    """One poll's units for one test, as (arm: True for the candidate, q, outcome) tuples."""

    def add(self, candidate: bool, q: float, y: float) -> None:
        self.append((candidate, q, y))

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if not self:
            return np.empty(0, dtype=bool), np.empty(0), np.empty(0)
        table = np.asarray(self, dtype=np.float64)
        return table[:, 0] > 0, table[:, 1], table[:, 2]


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def describe_reward(evidence: dict, side: str | None = None) -> str:
    """A reward test's evidence in one line: the difference and its units, then each side's e-value against its
    threshold (betting) or the bounds (mixture); ``side`` ("worse" or "non_inferior") names the one that decided."""
    diff = evidence.get("difference")
    counts = f"{evidence['n_candidate']}/{evidence['n_incumbent']}"
    head = f"difference {diff:+.3f} over {counts} rewarded units" if diff is not None else "no rewarded units"
    if evidence["method"] == "betting":
        sides = [side] if side else ["worse", "non_inferior"]
        return head + "; " + ", ".join(f"e-value{'' if side else f' ({s})'} {evidence[f'e_{s}']:.3g} "
                                       f"{'>=' if side else 'of'} {evidence[f'threshold_{s}']:.0f}" for s in sides)
    if evidence.get("lower") is None:
        return head
    return f"{head}; bounds {evidence['lower']:+.3f} .. {evidence['upper']:+.3f}"


def settings_dict(settings: CanarySettings) -> dict:
    """The settings and the alpha split, as the plan prints them."""
    return {**asdict(settings), "alpha_split": settings.alpha_split(), "offline_bounds": settings.offline_bounds()}

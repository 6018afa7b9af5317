"""The canary's error rates by simulation: the real ``Canary`` (and its shadow stage) driven by a simulated service.

``SimulatedService`` stands where ``verl serve`` stands: the canary moves its route (``set_share``: a new config
version and weights, as the admin API answers), waits (``sleep`` advances simulated time and the users send the
requests of that interval), and reads its online records (``fetch``: rows as the service writes them — completion
id, model, route, config version, hashed user, arrival and finish times, error, latency, reward, and reward rows
that arrive later). Routing follows ``serve.registry.draw``: a user's fixed hash on the route's layout, or a fresh
draw for requests without a user. ``Traffic`` says what the users and the two models do; the candidate's reward
differs from the incumbent's by ``effect`` (0: identical models).

``matrix()`` runs the cells of docs/shipping.md's table (one factor at a time from a base case), each as A/A,
candidate worse by the margin, and a 10-point drop; ``benchmarks/canary_matrix.py`` prints and records it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from eval.ship.canary import Canary, CanarySettings
from eval.ship.units import spans

OUTCOMES = ("promote", "rollback", "inconclusive")


@dataclass(frozen=True)
class Traffic:
    """What the simulated users and models do."""

    rate: float = 20.0  # requests per simulated second
    reward: str = "bernoulli"  # bernoulli | beta (skewed, in [0, 1]) | lognormal (unbounded) | empirical
    mu: float = 0.6  # the incumbent's mean reward (bernoulli) ...
    beta: tuple[float, float] = (0.2, 2.0)  # ... or Beta(a, b) (mean a / (a + b)), or exp(N(0, sigma))
    sigma: float = 1.0
    sample: tuple[float, ...] = ()  # empirical: rewards drawn from these (the route's observed rewards)
    error_rate: float = 0.0  # on both arms
    latency_p95_ratio: float = 0.5  # both arms' true p95 as a share of the SLO
    slo_ms: float = 1000.0
    users: int = 0  # 0: requests carry no user; else a pool of users with Zipf(1) activity, sticky routing
    user_sd: float = 0.0  # per-user effect on the reward's log-odds (bernoulli)
    drift: float = 0.0  # the reward rate moves by this much over the first 5,000 requests (both arms)
    delay_s: float = 0.0  # rewards arrive after an exponential delay with this mean (0: in the request's row)
    reward_share: float = 1.0  # share of requests that ask for a reward
    candidate_error_rate: float | None = None  # the candidate's own error rate (default: error_rate)
    candidate_latency_factor: float = 1.0  # the candidate's latencies, times this
    candidate_missing: float = 0.0  # share of the candidate's rewards that never arrive
    reward_source: str = "rule:simulated"  # "feedback", "rm:x", ...: requests carry no answer, rewards come later
    choices: int = 1  # n: each request's choices, one row each (its rewards, latency and error shared draws)
    prompt_sd: float = 0.0  # per-request prompt difficulty on the reward's log-odds (bernoulli): its choices share it

    def mean(self) -> float:
        if self.reward == "beta":
            a, b = self.beta
            return a / (a + b)
        if self.reward == "lognormal":
            return math.exp(self.sigma ** 2 / 2)
        if self.reward == "empirical":
            return float(np.mean(self.sample))
        return self.mu


class SimulatedService:
    """A route served by two models, its records, and simulated time (see the module docstring)."""

    def __init__(self, traffic: Traffic, effect: float, seed: int, route: str = "default",
                 incumbent: str = "inc", candidate: str = "cand", shadow_fraction: float = 0.0):
        self.traffic, self.effect, self.route = traffic, effect, route
        self.incumbent, self.candidate = incumbent, candidate
        self.rng = np.random.default_rng(seed)
        self.now = 1_000_000.0
        self.version = 1
        self.weights = {incumbent: 1.0}
        self.shadow_fraction = shadow_fraction
        self.sent = 0
        self.outbox: list[dict] = []
        self.late: list[tuple[float, dict]] = []  # reward rows not yet arrived: (arrival time, row)
        if traffic.users:
            activity = 1.0 / np.arange(1, traffic.users + 1)
            self.activity = activity / activity.sum()
            self.hashes = self.rng.random(traffic.users)
            self.skill = self.rng.normal(0.0, traffic.user_sd, traffic.users) if traffic.user_sd else None
        # lognormal latencies (sigma 0.5) whose p95 is latency_p95_ratio x the SLO
        self.latency_mu = math.log(traffic.latency_p95_ratio * traffic.slo_ms / 1000.0) - 0.5 * 1.6448536

    # ------------------------------------------------------------ what the canary calls

    def set_share(self, share: float) -> tuple[int, dict[str, float]]:
        self.weights = {self.incumbent: 1.0 - share, self.candidate: share}
        self.version += 1
        return self.version, dict(self.weights)

    def fetch(self, since: float) -> list[dict]:
        rows, self.outbox = self.outbox, []
        return rows

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        n = int(self.rng.poisson(self.traffic.rate * seconds))
        self._serve(n, seconds)
        self.now += seconds
        if self.late:
            due = [row for at, row in self.late if at <= self.now]
            self.late = [(at, row) for at, row in self.late if at > self.now]
            self.outbox.extend(due)

    # ------------------------------------------------------------ the users and the models

    def _rewards(self, n: int, candidate: np.ndarray, users: np.ndarray | None, start: int) -> np.ndarray:
        """``(n, choices)`` rewards of ``n`` requests."""
        t, rng = self.traffic, self.rng
        shape = (n, t.choices)
        shift = np.where(candidate, self.effect, 0.0)[:, None]
        if t.reward == "bernoulli":
            logit = np.full(n, np.log(t.mu / (1 - t.mu)))
            if self.traffic.users and self.skill is not None:
                logit = logit + self.skill[users]
            if t.prompt_sd:
                logit = logit + rng.normal(0.0, t.prompt_sd, n)
            varies = (t.users and self.skill is not None) or t.prompt_sd
            p = 1.0 / (1.0 + np.exp(-logit)) if varies else np.full(n, t.mu)
            if t.drift:
                p = p + t.drift * np.minimum((start + np.arange(n)) / 5000.0, 1.0)
            return (rng.random(shape) < np.clip(p[:, None] + shift, 0.0, 1.0)).astype(np.float64)
        if t.reward == "beta":
            y = rng.beta(*t.beta, shape)
            return y * (1.0 + shift / t.mean())  # the candidate's mean moves by `effect`, still in [0, 1]
        if t.reward == "lognormal":
            return np.exp(rng.normal(0.0, t.sigma, shape)) + shift
        if t.reward == "empirical":  # the candidate's rewards scaled so their mean moves by `effect`
            sample = np.asarray(t.sample, dtype=np.float64)
            if np.all((sample == 0.0) | (sample == 1.0)):  # 0/1 rewards stay 0/1
                return (rng.random(shape) < np.clip(t.mean() + shift, 0.0, 1.0)).astype(np.float64)
            y = rng.choice(sample, shape) * (1.0 + shift / max(abs(t.mean()), 1e-9))
            return np.clip(y, 0.0, 1.0) if sample.min() >= 0.0 and sample.max() <= 1.0 else y
        raise ValueError(f"unknown simulated reward {t.reward!r}")

    def _serve(self, n: int, seconds: float) -> None:
        if n == 0:
            return
        t, rng = self.traffic, self.rng
        layout = spans(self.weights)
        cand_low = layout[self.candidate][0] if self.candidate in layout else 1.0
        users = rng.choice(t.users, n, p=self.activity) if t.users else None
        point = self.hashes[users] if users is not None else rng.random(n)
        candidate = point >= cand_low
        rewards = self._rewards(n, candidate, users, self.sent)
        cand_errors = t.error_rate if t.candidate_error_rate is None else t.candidate_error_rate
        errors = rng.random(n) < np.where(candidate, cand_errors, t.error_rate)
        latency = np.exp(rng.normal(self.latency_mu, 0.5, n)) * np.where(candidate, t.candidate_latency_factor, 1.0)
        lost = candidate & (rng.random(n) < t.candidate_missing)
        arrival = self.now + np.sort(rng.random(n)) * seconds
        asked = rng.random(n) < t.reward_share
        delays = rng.exponential(t.delay_s, n) if t.delay_s else None
        mirror = rng.random(n) < self.shadow_fraction if self.shadow_fraction else None
        for k in range(n):
            model = self.candidate if candidate[k] else self.incumbent
            delay = math.inf if lost[k] else None if delays is None else float(delays[k])
            self._record(f"cmpl-{self.sent + k}", model, float(arrival[k]), float(latency[k]), bool(errors[k]),
                         rewards[k], bool(asked[k]), None if users is None else f"u{users[k]}", delay, False)
            if mirror is not None and mirror[k]:
                reward = self._rewards(1, np.ones(1, dtype=bool), None if users is None else users[k:k + 1],
                                       self.sent + k)[0]
                self._record(f"cmpl-{self.sent + k}", self.candidate, float(arrival[k]), float(latency[k]),
                             bool(rng.random() < t.error_rate), reward, bool(asked[k]), None, None, True)
        self.sent += n

    def _record(self, rid: str, model: str, arrival: float, latency: float, error: bool, rewards: np.ndarray,
                asked: bool, user: str | None, delay: float | None, shadow: bool) -> None:
        """A request's rows, one per choice (``rewards``: ``(choices,)``), as the service writes them."""
        finish = arrival + latency
        for index, reward in enumerate(rewards.tolist()):
            row = {"kind": "request", "id": rid, "index": index, "choices": len(rewards), "time": finish,
                   "arrival": arrival, "model": model, "route": self.route, "config_version": self.version,
                   "user": user, "e2e_s": latency, "error": "RequestFailedError: injected" if error else None,
                   "reward_expected": asked and self.traffic.reward_source.startswith("rule"),
                   "reward": None, "reward_source": None, "shadow": shadow}
            if asked and not error:
                if delay is None:
                    row["reward"], row["reward_source"] = reward, self.traffic.reward_source
                elif math.isfinite(delay):
                    self.late.append((finish + delay, {
                        "kind": "reward", "id": rid, "index": index, "time": finish + delay, "model": model,
                        "route": self.route, "reward": reward, "reward_source": self.traffic.reward_source,
                        "shadow": shadow}))
            self.outbox.append(row)


@dataclass(frozen=True)
class Cell:
    """One row of the matrix: a name, the traffic, the canary's settings, and an optional shadow stage."""

    name: str
    traffic: Traffic = field(default_factory=Traffic)
    drop: float = 0.10  # the drop whose power is measured (in reward units; for lognormal rewards, of the mean)
    settings: CanarySettings = field(default_factory=lambda: CanarySettings(slo_p95_ms=1000.0, budget_s=math.inf))
    shadow_fraction: float = 0.0
    shadow_requests: int = 50


def ship_once(cell: Cell, effect: float, seed: int) -> tuple[str, int]:
    """One simulated ship (shadow stage if any, then the canary): (outcome, requests it used)."""
    service = SimulatedService(cell.traffic, effect, seed, shadow_fraction=cell.shadow_fraction)
    canary = Canary(cell.settings, service.incumbent, service.candidate, service.route, service.set_share,
                    service.fetch, lambda event: None, clock=service.clock, sleep=service.sleep, wall=service.clock)
    if cell.shadow_fraction:
        passed, _, _ = canary.shadow(cell.shadow_requests)
        if not passed:
            return "rollback", service.sent
        service.shadow_fraction = 0.0
    outcome, _, _ = canary.run()
    return outcome, service.sent


def simulate(cell: Cell, effect: float, sims: int, seed: int = 0) -> dict[str, Any]:
    """``sims`` seeded ships: the rate of each outcome and the requests each used."""
    results = [ship_once(cell, effect, seed * 1_000_003 + i) for i in range(sims)]
    outcomes = np.asarray([o for o, _ in results])
    used = np.asarray([u for _, u in results], dtype=np.float64)
    return {"sims": sims, "effect": effect, **{o: float(np.mean(outcomes == o)) for o in OUTCOMES},
            "outcomes": outcomes, "requests": used}


def requests_for_power(result: dict, power: float = 0.8, outcome: str = "rollback") -> float:
    """Requests by which a share ``power`` of the ships reached ``outcome`` (inf if fewer ever did)."""
    reached = np.where(result["outcomes"] == outcome, result["requests"], np.inf)
    value = float(np.quantile(reached, power, method="inverted_cdf"))
    return value if math.isfinite(value) else float("inf")


def binomial_interval(rate: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson 95% interval of a rate seen in ``n`` trials."""
    centre = (rate + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(rate * (1 - rate) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def drop_allowed(cell: Cell, drop: float) -> bool:
    """Whether the base rate allows a drop of ``drop`` (a mean of 5% in [0, 1] cannot fall by 10 points)."""
    return cell.traffic.reward == "lognormal" or cell.traffic.mean() >= drop


def run_cell(cell: Cell, sims: int, seed: int = 0) -> dict[str, Any]:
    """A/A, worse by the margin, and the cell's drop (where the base rate allows it), ``sims`` ships each. For
    unbounded (lognormal) rewards the margin and the drop are shares of the mean."""
    scale = cell.traffic.mean() if cell.traffic.reward == "lognormal" else 1.0
    margin = cell.settings.margin * scale
    aa = simulate(cell, 0.0, sims, seed)
    worse = simulate(cell, -margin, sims, seed + 1)
    row: dict[str, Any] = {"cell": cell.name, "sims": sims, "aa_rollback": aa["rollback"],
                           "aa_rollback_ci": binomial_interval(aa["rollback"], sims), "aa_promote": aa["promote"],
                           "aa_inconclusive": aa["inconclusive"],
                           "aa_requests_median": float(np.median(aa["requests"])), "margin_promote": worse["promote"],
                           "margin_promote_ci": binomial_interval(worse["promote"], sims),
                           "margin_inconclusive": worse["inconclusive"]}
    if drop_allowed(cell, cell.drop):
        dropped = simulate(cell, -cell.drop * scale, sims, seed + 2)
        row.update(drop=cell.drop, drop_rollback=dropped["rollback"], drop_inconclusive=dropped["inconclusive"],
                   drop_requests_80=requests_for_power(dropped))
    return row


def cells() -> list[Cell]:
    """The matrix: a base case (0/1 rewards at 60%, independent requests, no errors, p95 at half the SLO, stages
    5/25/50%, 10,000 requests), then one factor at a time."""
    base = Cell("base: 0/1 at 60%")
    s, t = base.settings, base.traffic
    return [
        base,
        replace(base, name="0/1 at 5%", traffic=replace(t, mu=0.05)),
        replace(base, name="0/1 at 50%", traffic=replace(t, mu=0.5)),
        replace(base, name="0/1 at 95%", traffic=replace(t, mu=0.95)),
        replace(base, name="skewed continuous, Beta(0.2, 2) in [0, 1]", traffic=replace(t, reward="beta")),
        replace(base, name="unbounded lognormal (sigma 1), --test mixture, margin 25% and drop 50% of the mean",
                traffic=replace(t, reward="lognormal"), settings=replace(s, test="mixture", margin=0.25), drop=0.5),
        replace(base, name="errors 1% on both arms", traffic=replace(t, error_rate=0.01)),
        replace(base, name="errors 5% on both arms", traffic=replace(t, error_rate=0.05)),
        replace(base, name="both arms' p95 at 0.9x the SLO", traffic=replace(t, latency_p95_ratio=0.9)),
        replace(base, name="n = 4 choices a request, prompts of varying difficulty (sd 2 log-odds)",
                traffic=replace(t, choices=4, prompt_sd=2.0)),
        replace(base, name="sticky users (20,000, Zipf) with per-user effects (sd 1 log-odds)",
                traffic=replace(t, users=20_000, user_sd=1.0)),
        replace(base, name="reward rate drifts 60% -> 40% during the canary", traffic=replace(t, drift=-0.2)),
        replace(base, name="delayed rewards (mean 20 s; timeout 60 s)", traffic=replace(t, delay_s=20.0)),
        replace(base, name="stages 1/10/50%", settings=replace(s, stages=(0.01, 0.1, 0.5), budget_requests=20_000)),
        replace(base, name="small budget (4,000 requests)", settings=replace(s, budget_requests=4_000)),
        replace(base, name="large budget (20,000 requests)", settings=replace(s, budget_requests=20_000)),
        replace(base, name="shadow stage (20% mirrored, 50 pairs) then the canary",
                settings=replace(s, shadow=True), shadow_fraction=0.2),
    ]


def matrix(sims: int = 2000, seed: int = 0, names: list[str] | None = None, workers: int = 1) -> list[dict]:
    """Every cell (or those whose name starts with one of ``names``), ``sims`` ships per case."""
    chosen = [c for c in cells() if names is None or any(c.name.startswith(n) for n in names)]
    if workers <= 1:
        return [run_cell(c, sims, seed) for c in chosen]
    from concurrent.futures import ProcessPoolExecutor  # noqa: PLC0415

    with ProcessPoolExecutor(workers) as pool:
        return list(pool.map(run_cell, chosen, [sims] * len(chosen), [seed] * len(chosen)))

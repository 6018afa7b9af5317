"""The canary's always-valid tests: one-sided tests by betting on randomized units, and the normal mixture.

Why these. The canary looks at its data after every poll, so a fixed-n test re-run at each look inflates its error
rate. Every test here stays valid however often it is looked at and whenever it stops: its statistic is a
nonnegative supermartingale under the null (a *test martingale*, or *e-process*), and Ville's inequality bounds the
chance that it ever reaches ``1/alpha`` by ``alpha``.

**Testing by betting** (Waudby-Smith & Ramdas, "Estimating means of bounded random variables by betting", JRSS-B
2023; Shafer & Vovk's game-theoretic probability). To test H0: "every observation ``x_t`` has conditional mean
``<= 0`` given the past", a gambler starts with wealth 1 and bets a fraction ``lambda_t >= 0`` (chosen before
``x_t`` is seen) on ``x_t`` being positive: ``W_t = prod (1 + lambda_t x_t)``. Under H0, ``E[1 + lambda_t x_t |
past] <= 1``, so ``W`` is a nonnegative supermartingale; ``lambda_t`` stays under ``cap / |least x_t|`` so wealth
never goes negative. No variance estimate, no CLT: the error rate holds at every n for bounded observations. The bet
``lambda = theta / v`` is Kelly's for an alternative mean ``theta`` and variance ``v``; we average the wealth of a
few such bettors (a grid of ``theta``: an average of test martingales is one), which costs ``log(#grid)`` of
evidence and spares us guessing the effect size.

**Randomized units** (the inverse-propensity form of the A/B difference, as in Waudby-Smith et al., "Anytime-valid
off-policy inference for contextual bandits", 2022). Each unit is a request whose arm was drawn at random given
everything before it, with a known probability ``q`` of the candidate (``eval.ship.units`` says which requests are
units and what ``q`` is: the route's share, or less for a user whose earlier requests narrowed where their sticky
hash lies). With a predictable centre ``m`` (a running mean of earlier units),

    z = (y - m) * (A / q - (1 - A) / (1 - q))

has conditional mean ``mu_candidate(t) - mu_incumbent(t)``, whatever ``q`` and ``m`` are and however the rates
drift over time: A/A stays exactly mean-zero, request by request, through every stage and every drift. ``z`` is
bounded when ``y`` is (``y`` in [0, 1] gives ``z`` in ``[-m/q, (1-m)/q]`` or ``[-(1-m)/(1-q), m/(1-q)]``).

**The normal mixture** (Robbins' mixture, behind mSPRT: Johari, Pekelis & Walsh, "Always valid inference", 2017/
2022; in its asymptotic form, Waudby-Smith, Arnold, Wu & Ramdas et al., "Time-uniform central limit theory and
asymptotic confidence sequences", 2021) on the same ``z``: ``mean(z) +/- sqrt(V (V + tau^2) / tau^2 (2 log(1/alpha)
+ log((V + tau^2) / V)))`` with ``V`` the variance of ``mean(z)`` measured around the null value (the pooled
variance under the null) and floored. It is two-sided at level ``alpha`` (Ville bounds crossing *either* side by
``alpha``), and each one-sided decision reads it at its own ``alpha``. Asymptotic in the number of units: for
rewards that are not bounded (a reward model's raw logit); a bounded reward uses betting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from eval.ship.settings import METHODS
from verl.errors import ConfigError

Decision = Literal["rollback", "non_inferior", "continue"]
BET_CAP = 0.5  # no bet risks more than half the wealth: 1 + lambda x >= 1 - BET_CAP


class Bets:
    """A one-sided test by betting of H0: "each ``x`` has conditional mean <= 0", as the average wealth of bettors
    tuned to alternative means ``thetas`` (see the module docstring)."""

    def __init__(self, alpha: float, thetas: tuple[float, ...]):
        if not 0 < alpha < 1:
            raise ValueError(f"alpha must be in (0, 1) (got {alpha})")
        self.alpha = alpha
        self.log_threshold = math.log(1.0 / alpha)
        self.thetas = np.asarray(thetas, dtype=np.float64)
        self.log_wealth = np.zeros(len(thetas))
        self.n = 0

    def add(self, x: np.ndarray, least: np.ndarray, variance: np.ndarray) -> None:
        """Bet on a batch. ``x`` (k,): the observations; ``least`` (k,): the smallest value each could have taken
        (known before it was seen; < 0); ``variance`` (k,): a guess of each one's variance, from earlier data only.
        Bets within a batch are fixed from what came before it (predictable)."""
        if x.size == 0:
            return
        risk = -np.minimum(least, -1e-12)
        bets = np.minimum(self.thetas[:, None] / np.maximum(variance, 1e-12)[None, :], BET_CAP / risk[None, :])
        self.log_wealth += np.log1p(bets * x[None, :]).sum(axis=1)
        self.n += int(x.size)

    @property
    def e_value(self) -> float:
        """The average wealth (>= 1/alpha rejects H0)."""
        top = float(self.log_wealth.max())
        return math.exp(top) * float(np.mean(np.exp(self.log_wealth - top))) if top < 700 else math.inf

    @property
    def rejected(self) -> bool:
        # The average wealth is at most the largest: most looks end at this cheap check.
        return float(self.log_wealth.max()) >= self.log_threshold and self.e_value >= 1.0 / self.alpha


def mixture_half_width(variance: float | np.ndarray, alpha: float, tau: float) -> float | np.ndarray:
    """Half-width of the two-sided normal-mixture confidence sequence at level ``alpha`` for an estimate of variance
    ``variance`` (see the module docstring); an array in, an array out."""
    v = np.maximum(np.asarray(variance, dtype=np.float64), 1e-300)
    t2 = tau * tau
    width = np.sqrt(v * (v + t2) / t2 * (2.0 * math.log(1.0 / alpha) + np.log((v + t2) / v)))
    return float(width) if width.ndim == 0 else width


@dataclass
class ArmMoments:
    """Running sums of one arm's outcomes (for the bets' variance guesses and the evidence)."""

    n: int = 0
    total: float = 0.0
    total_sq: float = 0.0

    def add(self, y: np.ndarray) -> None:
        self.add_sums(int(y.size), float(y.sum()), float((y * y).sum()))

    def add_sums(self, n: int, total: float, total_sq: float) -> None:
        self.n += n
        self.total += total
        self.total_sq += total_sq

    @property
    def mean(self) -> float | None:
        return self.total / self.n if self.n else None

    def variance_guess(self, floor: float, prior_mean: float = 0.5, prior_var: float = 0.25) -> float:
        """The arm's variance with one pseudo-observation of ``prior_var`` around ``prior_mean`` (so early, all-equal
        outcomes do not claim certainty), at least ``floor``."""
        n = self.n + 1
        mean = (self.total + prior_mean) / n
        second = (self.total_sq + prior_var + prior_mean ** 2) / n
        return max(second - mean * mean, floor)


@dataclass
class UnitDifference:
    """``z`` statistics of "candidate minus incumbent" over randomized units (see the module docstring).

    ``bounded``: outcomes lie in [0, 1] (then each ``z`` comes with its least and greatest possible value)."""

    bounded: bool = True
    variance_floor: float = 0.02
    half_life: float = 200.0  # units; the centre follows drifting rates
    check_range: bool = True  # refuse outcomes outside [0, 1] (off where they are 0/1 by construction)
    center: float | None = None
    candidate: ArmMoments = field(default_factory=ArmMoments)
    incumbent: ArmMoments = field(default_factory=ArmMoments)

    def statistics(self, arm: np.ndarray, q: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
        """For a batch of units — ``arm`` (k,) bool (True: the candidate answered), ``q`` (k,) the candidate's
        probability, ``y`` (k,) outcomes — their ``z``, its bounds and a variance guess, all from the state before the
        batch; then the state takes the batch."""
        if self.bounded and self.check_range and y.size and (float(y.min()) < 0.0 or float(y.max()) > 1.0):
            bad = float(y[(y < 0) | (y > 1)][0])
            raise ConfigError(f"a reward of {bad:g} is outside [0, 1]: the betting test needs bounded rewards; map "
                              "them into [0, 1] or ship with --test mixture (asymptotic, any scale)")
        # The centre comes from earlier units only (a centre from this batch would break the martingale).
        m = self.center if self.center is not None else (0.5 if self.bounded else 0.0)
        a = arm.astype(np.float64)
        weight = a / q - (1.0 - a) / (1.0 - q)
        z = (y - m) * weight
        prior = (m, 0.25) if self.bounded else (m, max(self.variance_floor, 1.0))
        v_c = self.candidate.variance_guess(self.variance_floor, *prior)
        v_i = self.incumbent.variance_guess(self.variance_floor, *prior)
        if self.bounded:
            v_c, v_i = min(v_c, 0.25), min(v_i, 0.25)
        out = {"z": z, "variance": v_c / q + v_i / (1.0 - q)}
        if self.bounded:
            out["least"] = np.minimum(-m / q, -(1.0 - m) / (1.0 - q))
            out["greatest"] = np.maximum((1.0 - m) / q, m / (1.0 - q))
        if y.size:
            squares = y * y
            n_c, total, total_sq = int(a.sum()), float(y.sum()), float(squares.sum())
            t_c, sq_c = float(y @ a), float(squares @ a)
            self.candidate.add_sums(n_c, t_c, sq_c)
            self.incumbent.add_sums(y.size - n_c, total - t_c, total_sq - sq_c)
            keep = 0.5 ** (y.size / self.half_life)
            mean = total / y.size
            self.center = mean if self.center is None else keep * self.center + (1 - keep) * mean
        return out


@dataclass
class RewardTest:
    """The canary's reward decision on randomized units: "worse" (roll back) and "non-inferior" (the last stage may
    promote), each a one-sided always-valid test.

    - worse: H0 "the candidate is not worse" (difference >= 0), rejected at ``alpha_rollback``;
    - non-inferior: H0 "the candidate is worse by the margin or more" (difference <= -margin), rejected at
      ``alpha_promote``: a candidate worse by exactly the margin is promoted with probability <= ``alpha_promote``.

    ``method``: ``betting`` (rewards in [0, 1]; exact at every n) or ``mixture`` (the normal mixture on the same
    statistics; asymptotic, any scale)."""

    margin: float = 0.05
    alpha_rollback: float = 0.025
    alpha_promote: float = 0.05
    method: str = "betting"
    min_per_arm: int = 30  # no decision before this many rewarded units per arm
    tau: float | None = None  # the mixture's spread (default: the margin)
    variance_floor: float = 0.02

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"--test must be one of {', '.join(METHODS)} (got {self.method!r})")
        if self.margin < 0:
            raise ConfigError(f"the margin must be >= 0 (got {self.margin})")
        scale = max(self.margin, 0.01)
        self.tau = self.tau if self.tau is not None else scale
        self.units = UnitDifference(bounded=self.method == "betting", variance_floor=self.variance_floor)
        self.worse = Bets(self.alpha_rollback, (scale, 2 * scale, 4 * scale))
        self.non_inferior = Bets(self.alpha_promote, (scale / 2, scale, 2 * scale))
        self.z_sum = self.z_sq_null = self.z_sq_margin = self.floor_sum = 0.0
        self.n = 0

    def add(self, arm: np.ndarray, q: np.ndarray, y: np.ndarray) -> None:
        """A batch of rewarded units: ``arm`` (k,) bool, ``q`` (k,) the candidate's probability, ``y`` (k,)."""
        if y.size == 0:
            return
        s = self.units.statistics(arm, q, y)
        z = s["z"]
        if self.method == "betting":
            self.worse.add(-z, -s["greatest"], s["variance"])
            self.non_inferior.add(z + self.margin, s["least"] + self.margin, s["variance"])
        self.n += int(z.size)
        self.z_sum += float(z.sum())
        self.z_sq_null += float((z * z).sum())
        self.z_sq_margin += float(((z + self.margin) ** 2).sum())
        self.floor_sum += float((self.variance_floor * (1.0 / q + 1.0 / (1.0 - q))).sum())

    @property
    def difference(self) -> float | None:
        """The running estimate of candidate - incumbent (the mean of ``z``)."""
        return self.z_sum / self.n if self.n else None

    def _mixture(self) -> tuple[bool, bool, float, float]:
        d = self.z_sum / self.n
        v_null = max(self.z_sq_null, self.floor_sum) / self.n ** 2
        v_margin = max(self.z_sq_margin, self.floor_sum) / self.n ** 2
        upper = d + mixture_half_width(v_null, self.alpha_rollback, self.tau)
        lower = d - mixture_half_width(v_margin, self.alpha_promote, self.tau)
        return upper < 0, lower > -self.margin, lower, upper

    def ready(self) -> bool:
        return min(self.units.candidate.n, self.units.incumbent.n) >= self.min_per_arm

    def decide(self) -> Decision:
        if not self.ready():
            return "continue"
        if self.method == "betting":
            worse, non_inferior = self.worse.rejected, self.non_inferior.rejected
        else:
            worse, non_inferior, _, _ = self._mixture()
        if worse:
            return "rollback"
        return "non_inferior" if non_inferior else "continue"

    def evidence(self) -> dict:
        """What the audit log records: counts, means, the estimate and each side's evidence against its threshold."""
        c, i = self.units.candidate, self.units.incumbent
        out = {"test": {"betting": "testing by betting on randomized units (always valid, exact)",
                        "mixture": "normal mixture on randomized units (always valid, asymptotic)"}[self.method],
               "method": self.method, "margin": self.margin, "alpha_rollback": self.alpha_rollback,
               "alpha_promote": self.alpha_promote, "n_candidate": c.n, "n_incumbent": i.n,
               "mean_candidate": c.mean, "mean_incumbent": i.mean, "difference": self.difference,
               "decision": self.decide()}
        if self.method == "betting":
            out.update(e_worse=self.worse.e_value, e_non_inferior=self.non_inferior.e_value,
                       threshold_worse=1 / self.alpha_rollback, threshold_non_inferior=1 / self.alpha_promote)
        elif self.n:
            _, _, lower, upper = self._mixture()
            out.update(lower=lower, upper=upper, tau=self.tau)
        return out


class _BettingTest:
    """A guardrail decided by betting (``self.bets``): rejected once its e-value reaches 1 / alpha."""

    bets: Bets

    @property
    def rejected(self) -> bool:
        return self.bets.rejected


@dataclass
class RateIncreaseTest(_BettingTest):
    """A guardrail on a 0/1 outcome per randomized unit (an error, a missing reward): H0 "the candidate's rate exceeds
    the incumbent's by at most ``allowed``", rejected (roll back) by betting at ``alpha``."""

    allowed: float = 0.02
    alpha: float = 0.01
    variance_floor: float = 0.005

    def __post_init__(self) -> None:
        scale = max(self.allowed, 0.01)
        self.units = UnitDifference(bounded=True, variance_floor=self.variance_floor, half_life=1000.0,
                                    check_range=False)
        self.units.center = 0.0  # rates of failures start near 0
        self.bets = Bets(self.alpha, (scale, 2 * scale, 4 * scale))

    def add(self, arm: np.ndarray, q: np.ndarray, y: np.ndarray) -> None:
        if y.size == 0:
            return
        s = self.units.statistics(arm, q, y)
        self.bets.add(s["z"] - self.allowed, s["least"] - self.allowed, s["variance"])

    def evidence(self) -> dict:
        c, i = self.units.candidate, self.units.incumbent
        return {"n_candidate": c.n, "n_incumbent": i.n, "rate_candidate": c.mean, "rate_incumbent": i.mean,
                "allowed_increase": self.allowed, "alpha": self.alpha, "e_value": self.bets.e_value,
                "threshold": 1 / self.alpha}


@dataclass
class ExceedanceTest(_BettingTest):
    """The latency guardrail as a sequential quantile test: H0 "the candidate's p-quantile is at most the SLO", i.e.
    P(latency > SLO) <= 1 - p, rejected (roll back) by betting on the exceedances at ``alpha``."""

    slo: float
    quantile: float = 0.95
    alpha: float = 0.01
    exceed: int = 0

    def __post_init__(self) -> None:
        self.tail = 1.0 - self.quantile
        self.bets = Bets(self.alpha, (self.tail / 2, self.tail, 2 * self.tail, 4 * self.tail))

    def add(self, values: np.ndarray) -> None:
        if values.size == 0:
            return
        x = (values > self.slo).astype(np.float64)
        self.exceed += int(x.sum())
        n = x.size
        self.bets.add(x - self.tail, np.full(n, -self.tail), np.full(n, self.tail * (1 - self.tail)))

    def evidence(self) -> dict:
        n = self.bets.n
        return {"slo": self.slo, "quantile": self.quantile, "n": n, "above_slo": self.exceed,
                "share_above": self.exceed / n if n else None, "alpha": self.alpha, "e_value": self.bets.e_value,
                "threshold": 1 / self.alpha}


@dataclass
class PairedWorseTest(_BettingTest):
    """Paired differences in [-1, 1] (the shadow stage: the candidate's and the incumbent's answer to the same
    request): H0 "the mean difference is >= -allowed", rejected by betting at ``alpha``."""

    alpha: float = 0.01
    allowed: float = 0.0
    scale: float = 0.05
    moments: ArmMoments = field(default_factory=ArmMoments)

    def __post_init__(self) -> None:
        self.bets = Bets(self.alpha, (self.scale, 2 * self.scale, 4 * self.scale))

    def add(self, d: np.ndarray) -> None:
        if d.size == 0:
            return
        v = self.moments.variance_guess(0.02, 0.0, 0.5)
        self.bets.add(-d - self.allowed, np.full(d.size, -1.0 - self.allowed), np.full(d.size, v))
        self.moments.add(d)

    def evidence(self) -> dict:
        return {"n_pairs": self.moments.n, "mean_difference": self.moments.mean, "allowed": self.allowed,
                "alpha": self.alpha, "e_value": self.bets.e_value, "threshold": 1 / self.alpha}

"""The canary's always-valid test: a normal-mixture confidence sequence on the reward difference.

Which test, and why. The canary looks at its data again and again (after every batch of requests, at every ramp
stage), so a fixed-n test re-run at each look inflates its error rate well past its nominal alpha (the simulation in
``eval.ship.simulate`` measures by how much). A *confidence sequence* is an interval that holds at every look at
once: P(the true difference ever leaves it) <= alpha, however often and whenever one stops. We use the normal-
mixture boundary (Robbins' mixture, the one behind Johari, Pekelis and Walsh's mSPRT, "Always valid inference",
2017/2022; in its asymptotic form, Waudby-Smith, Arnold, Wu, Ramdas et al., "Time-uniform central limit theory and
asymptotic confidence sequences", 2021): with the candidate's and the incumbent's mean rewards and the variance of
their difference ``V = s_c^2 / n_c + s_i^2 / n_i``, the sequence is

    delta_hat +/- sqrt( V (V + tau^2) / tau^2 * ( 2 log(1/alpha) + log((V + tau^2) / V) ) )

which is mSPRT's rejection region (the mixture likelihood ratio >= 1/alpha) turned into an interval. ``tau`` is the
mixture's spread: the size of difference the test is tuned to find quickest (here: the non-inferiority margin).
It is asymptotic in the per-arm counts (the CLT for the means), so decisions wait for ``min_per_arm`` requests on each
side and every variance is floored; the simulation checks that the error rates hold at the sizes used.

The decisions (a non-inferiority design with margin ``delta``):

- **roll back** as soon as the whole interval is below 0: the candidate is worse (A/A false-rollback rate <= alpha);
- **non-inferior** as soon as the whole interval is above ``-delta``: the candidate is not worse by the margin
  (false-promote rate of a candidate worse by exactly the margin <= alpha); the ramp steps up on it;
- otherwise **continue**, until the request budget, which ends the canary as **inconclusive** (the incumbent stays).

An e-value view of the same thing: ``e = 1 / alpha`` at the boundary; the audit log records the interval, n and
the stage, from which any reader can recompute it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

Decision = Literal["rollback", "non_inferior", "continue"]


@dataclass
class Arm:
    """Running sums of one side's rewards (numbers in [0, 1], one per request that had a reward)."""

    n: int = 0
    total: float = 0.0
    total_sq: float = 0.0

    def add(self, rewards: list[float] | np.ndarray) -> None:
        values = np.asarray(rewards, dtype=np.float64)
        self.n += int(values.size)
        self.total += float(values.sum())
        self.total_sq += float((values * values).sum())

    @property
    def mean(self) -> float:
        return self.total / self.n if self.n else float("nan")

    def variance(self, floor: float) -> float:
        """The sample variance (n - 1), at least ``floor``: early on, all-equal rewards would claim certainty."""
        if self.n < 2:
            return max(floor, 0.25)  # the largest variance a reward in [0, 1] can have
        var = (self.total_sq - self.n * self.mean ** 2) / (self.n - 1)
        return max(var, floor)


def mixture_half_width(variance: float | np.ndarray, alpha: float, tau: float) -> float | np.ndarray:
    """Half-width of the normal-mixture confidence sequence for a mean whose estimate has variance ``variance``
    (see the module docstring). ``variance`` may be an array (the simulation evaluates many canaries at once)."""
    v = np.asarray(variance, dtype=np.float64)
    t2 = tau * tau
    width = np.sqrt(v * (v + t2) / t2 * (2.0 * math.log(1.0 / alpha) + np.log((v + t2) / v)))
    return float(width) if width.ndim == 0 else width


@dataclass
class SequentialTest:
    """The canary's reward test (difference = candidate - incumbent); see the module docstring."""

    margin: float = 0.05  # delta: how much worse than the incumbent still counts as non-inferior
    alpha: float = 0.05
    tau: float | None = None  # the mixture's spread; default: the margin
    min_per_arm: int = 30  # no decision before this many rewarded requests on each side
    variance_floor: float = 0.01
    candidate: Arm = field(default_factory=Arm)
    incumbent: Arm = field(default_factory=Arm)

    def __post_init__(self) -> None:
        if not 0 < self.alpha < 1:
            raise ValueError(f"alpha must be in (0, 1) (got {self.alpha})")
        if self.margin < 0:
            raise ValueError(f"the margin must be >= 0 (got {self.margin})")
        if self.tau is None:
            self.tau = max(self.margin, 0.01)

    def interval(self) -> tuple[float, float, float] | None:
        """(difference, low, high), or None before ``min_per_arm`` on both sides. Each decision uses one side of
        it, so the two-sided sequence is taken at level 2 alpha: each side is crossed with probability <= alpha."""
        c, i = self.candidate, self.incumbent
        if min(c.n, i.n) < self.min_per_arm:
            return None
        v = c.variance(self.variance_floor) / c.n + i.variance(self.variance_floor) / i.n
        diff = c.mean - i.mean
        h = mixture_half_width(v, min(2 * self.alpha, 0.5), self.tau)
        return diff, diff - h, diff + h

    def decide(self) -> Decision:
        bounds = self.interval()
        if bounds is None:
            return "continue"
        _, low, high = bounds
        if high < 0:
            return "rollback"
        if low > -self.margin:
            return "non_inferior"
        return "continue"

    def evidence(self) -> dict:
        """What the audit log records: the counts, means, the interval and the test's settings."""
        bounds = self.interval()
        diff, low, high = bounds if bounds is not None else (None, None, None)
        return {"test": "normal-mixture confidence sequence (mSPRT)", "alpha": self.alpha, "margin": self.margin,
                "tau": self.tau, "n_candidate": self.candidate.n, "n_incumbent": self.incumbent.n,
                "mean_candidate": _finite(self.candidate.mean), "mean_incumbent": _finite(self.incumbent.mean),
                "difference": diff, "interval": [low, high], "decision": self.decide()}


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None

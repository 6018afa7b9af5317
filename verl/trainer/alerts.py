"""Metric health rules and the alerts they raise.

After every step ``AlertMonitor`` (a trainer callback, attached from ``trainer.alerts``) runs each rule over the
step's ``scope/name`` metrics. A firing rule produces an alert that is

- an ``alert`` row in ``verl_logs.jsonl`` (``{"scope": "alert", "level": "WARNING", "rule": ..., "message": ...}``),
- a console warning,
- a tracker event (``Tracker.log_alert``: a wandb alert, a TensorBoard text entry, an MLflow artifact).

Rules (thresholds in ``AlertsConfig``):

==================  ===========================================================================================
kl_far_above_target ``ppo/kl_div`` above ``kl_factor`` x the KL target
reward_collapse     smoothed ``rollout/reward_mean`` fell more than ``reward_collapse_drop`` of its peak
entropy_collapse    ``ppo/entropy`` below ``entropy_collapse_ratio`` x its starting level
length_clip_high    ``rollout/response_length_clip_ratio`` (responses cut at max length) above ``clip_ratio_max``
repetition_collapse ``rollout/repetition_rate`` (repeated token 4-grams per response) above ``repetition_rate_max``
non_finite          a NaN/Inf loss or gradient: the actor skipped the optimizer step (``ppo/nan_skipped``);
                    ``nan_patience`` such steps in a row stop the run (final checkpoint, reason row, exit 0)
==================  ===========================================================================================

A rule that keeps firing repeats its alert every ``cooldown_steps`` steps, not every step (``non_finite`` reports
every step: each one is a skipped update). Custom rules subclass ``HealthRule`` and go to
``AlertMonitor(rules=[...])`` through ``trainer.add_callback``.
"""

from __future__ import annotations

import math
import sys
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch

from verl.trainer.callbacks import TrainerCallback


@dataclass
class Alert:
    """One firing of a health rule."""

    rule: str
    message: str
    metric: str | None = None
    value: float | None = None
    threshold: float | None = None
    severity: Literal["warning", "critical"] = "warning"
    action: Literal["warn", "stop"] = "warn"


# ---------------------------------------------------------------------------------------------- emitting


def emit_alert(trainer: Any, alert: Alert, step: int) -> dict[str, Any]:
    """Record ``alert`` everywhere (JSONL row, console, trackers); stop the run if its action is ``stop``."""
    fields = {k: v for k, v in asdict(alert).items() if v is not None}
    level = "ERROR" if alert.severity == "critical" else "WARNING"
    logger = getattr(trainer, "logger", None)
    if logger is not None:
        logger.event("alert", level=level, step=step, **fields)
    trackers = list(getattr(trainer, "trackers", []))
    for tracker in trackers:
        tracker.log_alert(fields, step)
    from verl.tracking.backends import ConsoleTracker

    # The console tracker prints alerts itself; without it, still warn on stderr (unless told to be quiet).
    if not any(isinstance(t, ConsoleTracker) for t in trackers) and not getattr(trainer, "quiet", False):
        print(f"ALERT step {step}: {alert.rule}: {alert.message}", file=sys.stderr)
    if alert.action == "stop":
        trainer.request_stop(f"{alert.rule}: {alert.message}")
    return fields


# ---------------------------------------------------------------------------------------------- rules


def _finite(metrics: dict[str, float], key: str) -> float | None:
    value = metrics.get(key)
    if value is None or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


class HealthRule:
    """A check over one step's metrics. Stateful rules (baselines, streaks) keep their state on the instance."""

    name = "rule"
    report_every_step = False  # True: do not rate-limit with the monitor's cooldown

    def check(self, step: int, metrics: dict[str, float]) -> Alert | None:
        raise NotImplementedError


class KLAboveTarget(HealthRule):
    name = "kl_far_above_target"

    def __init__(self, target: float, factor: float = 5.0, metric: str = "ppo/kl_div"):
        self.target, self.factor, self.metric = target, factor, metric

    def check(self, step: int, metrics: dict[str, float]) -> Alert | None:
        value = _finite(metrics, self.metric)
        threshold = self.target * self.factor
        if value is None or value <= threshold:
            return None
        return Alert(self.name, f"{self.metric}={value:.4g} is {value / self.target:.1f}x the KL target "
                     f"{self.target:g} (alert above {threshold:.4g}); the policy is leaving the reference fast: "
                     "lower actor.optim.lr or raise actor.kl_loss_coef", self.metric, value, threshold)


class RewardCollapse(HealthRule):
    """The reward, averaged over ``window`` steps, fell more than ``drop`` (a fraction) below its peak average."""

    name = "reward_collapse"

    def __init__(self, drop: float = 0.5, window: int = 5, metric: str = "rollout/reward_mean"):
        self.drop, self.metric = drop, metric
        self.values: deque[float] = deque(maxlen=window)
        self.peak: float | None = None

    def check(self, step: int, metrics: dict[str, float]) -> Alert | None:
        value = _finite(metrics, self.metric)
        if value is None:
            return None
        self.values.append(value)
        if len(self.values) < (self.values.maxlen or 1):
            return None
        smoothed = sum(self.values) / len(self.values)
        self.peak = smoothed if self.peak is None else max(self.peak, smoothed)
        threshold = self.peak - self.drop * abs(self.peak)
        if abs(self.peak) < 1e-12 or smoothed >= threshold:
            return None
        return Alert(self.name, f"{self.metric} averaged {smoothed:.4g} over the last {len(self.values)} steps, "
                     f"down from a peak of {self.peak:.4g} (alert below {threshold:.4g}); look at the latest "
                     "samples for reward hacking or degenerate outputs", self.metric, smoothed, threshold)


class EntropyCollapse(HealthRule):
    """Entropy fell below ``ratio`` x its starting level (the mean of the first ``window`` steps)."""

    name = "entropy_collapse"

    def __init__(self, ratio: float = 0.1, window: int = 5, metric: str = "ppo/entropy"):
        self.ratio, self.window, self.metric = ratio, window, metric
        self.first: list[float] = []

    def check(self, step: int, metrics: dict[str, float]) -> Alert | None:
        value = _finite(metrics, self.metric)
        if value is None:
            return None
        if len(self.first) < self.window:
            self.first.append(value)
            return None
        baseline = sum(self.first) / len(self.first)
        threshold = self.ratio * baseline
        if baseline <= 0 or value >= threshold:
            return None
        return Alert(self.name, f"{self.metric}={value:.4g} fell below {self.ratio:g}x its starting level "
                     f"{baseline:.4g}; the policy is becoming deterministic (mode collapse): consider "
                     "actor.entropy_coeff > 0 or a lower learning rate", self.metric, value, threshold)


class AboveThreshold(HealthRule):
    """A metric above a fixed threshold."""

    def __init__(self, name: str, metric: str, threshold: float, advice: str):
        self.name, self.metric, self.threshold, self.advice = name, metric, threshold, advice

    def check(self, step: int, metrics: dict[str, float]) -> Alert | None:
        value = _finite(metrics, self.metric)
        if value is None or value <= self.threshold:
            return None
        return Alert(self.name, f"{self.metric}={value:.4g} is above {self.threshold:g}; {self.advice}",
                     self.metric, value, self.threshold)


class NonFinite(HealthRule):
    """A NaN/Inf in a loss or gradient (the actor then skips the optimizer step and counts ``ppo/nan_skipped``).

    Every such step is reported; ``patience`` consecutive ones stop the run (0: never stop).
    """

    name = "non_finite"
    report_every_step = True
    WATCHED_SCOPES = ("ppo/", "critic/")

    def __init__(self, patience: int = 3):
        self.patience = patience
        self.streak = 0

    def check(self, step: int, metrics: dict[str, float]) -> Alert | None:
        skipped = metrics.get("ppo/nan_skipped")
        bad = sorted(k for k, v in metrics.items() if k.startswith(self.WATCHED_SCOPES) and isinstance(v, float)
                     and not math.isfinite(v))
        if not bad and not (skipped is not None and skipped > 0):
            self.streak = 0
            return None
        self.streak += 1
        what = ", ".join(bad) if bad else "a gradient"
        message = (f"non-finite value in {what} at step {step}: the optimizer step was skipped "
                   f"({self.streak} such step(s) in a row)")
        if self.patience and self.streak >= self.patience:
            return Alert(self.name, message + f"; stopping after {self.patience} in a row: lower actor.optim.lr, "
                         "check the reward for NaN, or use float32", "ppo/nan_skipped", float(self.streak),
                         float(self.patience), severity="critical", action="stop")
        return Alert(self.name, message, "ppo/nan_skipped", float(self.streak),
                     float(self.patience) if self.patience else None)


def build_health_rules(config: Any) -> list[HealthRule]:
    """The rules configured by ``trainer.alerts`` (``config`` is a ``VerlConfig``)."""
    alerts = config.trainer.alerts
    target = alerts.kl_target or config.algorithm.kl_ctrl.target_kl
    return [
        KLAboveTarget(target, alerts.kl_factor),
        RewardCollapse(alerts.reward_collapse_drop, alerts.reward_window),
        EntropyCollapse(alerts.entropy_collapse_ratio, alerts.reward_window),
        AboveThreshold("length_clip_high", "rollout/response_length_clip_ratio", alerts.clip_ratio_max,
                       "responses are being cut at data.max_response_length: raise it, or penalise length"),
        AboveThreshold("repetition_collapse", "rollout/repetition_rate", alerts.repetition_rate_max,
                       "responses repeat themselves (degenerate loops): check the samples, lower the learning rate"),
        NonFinite(alerts.nan_patience),
    ]


class AlertMonitor(TrainerCallback):
    """Runs health rules after every step and emits their alerts (see the module docstring)."""

    def __init__(self, rules: list[HealthRule], cooldown_steps: int = 10):
        self.rules = rules
        self.cooldown_steps = cooldown_steps
        self.last_fired: dict[str, int] = {}
        self.fired: list[dict[str, Any]] = []

    @classmethod
    def from_config(cls, config: Any) -> AlertMonitor:
        return cls(build_health_rules(config), config.trainer.alerts.cooldown_steps)

    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        for rule in self.rules:
            alert = rule.check(step, metrics)
            if alert is None:
                self.last_fired.pop(rule.name, None)  # the condition cleared: the next violation alerts at once
                continue
            last = self.last_fired.get(rule.name)
            if (rule.report_every_step or alert.action == "stop" or last is None
                    or step - last >= self.cooldown_steps):
                self.last_fired[rule.name] = step
                self.fired.append(emit_alert(trainer, alert, step))


# ---------------------------------------------------------------------------------------------- metrics


def ngram_repetition_rate(responses: torch.Tensor, mask: torch.Tensor, n: int = 4) -> float:
    """Mean over responses of seq-rep-n (Welleck et al. 2019) on token ids: 1 - unique n-grams / n-grams.

    ``responses`` and ``mask`` are ``(batch, response_len)``; only n-grams entirely inside the mask count, and a
    response with no complete n-gram counts as 0 (no repetition). Token ids rather than words make the rate
    language-independent. 0 for varied text; close to 1 for a response stuck in a loop.
    """
    if responses.dim() != 2 or responses.shape != mask.shape:
        raise ValueError(f"responses {tuple(responses.shape)} and mask {tuple(mask.shape)} must be equal 2-D shapes")
    batch, length = responses.shape
    if batch == 0 or length < n:
        return 0.0
    windows = responses.long().unfold(1, n, 1)  # (batch, length - n + 1, n)
    valid = mask.bool().unfold(1, n, 1).all(-1)  # (batch, length - n + 1)
    weights = torch.ones(n, dtype=torch.long)
    for k in range(1, n):
        weights[k] = weights[k - 1] * 1_000_003  # int64 wrap-around is fine for a hash
    hashes = (windows * weights).sum(-1)
    sentinel = torch.iinfo(torch.long).min
    hashes = torch.where(valid, hashes, torch.full_like(hashes, sentinel)).sort(-1).values
    distinct = 1 + (hashes[:, 1:] != hashes[:, :-1]).sum(-1)
    total = valid.sum(-1)
    distinct = distinct - (total < hashes.shape[1]).long()  # the sentinel group is not an n-gram
    rate = torch.where(total > 0, 1.0 - distinct.double() / total.clamp(min=1).double(), torch.zeros(batch).double())
    return float(rate.mean())

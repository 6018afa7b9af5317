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

from verl.trainer.callbacks import BestCheckpointSaver, TrainerCallback, load_callback


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


# ---------------------------------------------------------------------------------------------- early stop


class EarlyStopper(TrainerCallback):
    """Stop a run that goes unstable; the loop then writes a final checkpoint and a reason row, and exits 0.

    Each condition must hold for ``patience`` consecutive steps (a condition set to None is off):

    - ``kl_threshold``: ``ppo/kl_div`` above it (the policy runs away from the reference);
    - ``reward_drop``: the reward averaged over ``reward_window`` steps is more than this fraction below its peak;
    - ``min_response_length``: mean response length below it (responses collapse to nothing);
    - ``max_repetition_rate``: ``rollout/repetition_rate`` above it (responses collapse into loops).

        trainer.add_callback(EarlyStopper(patience=5, kl_threshold=0.2, reward_drop=0.2))
    """

    def __init__(self, patience: int = 5, kl_threshold: float | None = 0.2, reward_drop: float | None = 0.2,
                 reward_window: int = 5, min_response_length: float | None = 1.0,
                 max_repetition_rate: float | None = 0.9, kl_metric: str = "ppo/kl_div",
                 reward_metric: str = "rollout/reward_mean",
                 length_metric: str = "rollout/response_length_mean",
                 repetition_metric: str = "rollout/repetition_rate"):
        from collections import deque

        if patience < 1:
            from verl.errors import ConfigError

            raise ConfigError(f"EarlyStopper patience must be >= 1, got {patience}")
        self.patience = patience
        self.kl_threshold, self.reward_drop = kl_threshold, reward_drop
        self.min_response_length, self.max_repetition_rate = min_response_length, max_repetition_rate
        self.kl_metric, self.reward_metric = kl_metric, reward_metric
        self.length_metric, self.repetition_metric = length_metric, repetition_metric
        self.rewards: deque[float] = deque(maxlen=reward_window)
        self.reward_peak: float | None = None
        self.streaks: dict[str, int] = {}
        self.stopped_reason: str | None = None

    def _violations(self, metrics: dict[str, float]) -> dict[str, str]:
        """Condition name -> description, for each condition violated at this step."""
        import math

        def value(key: str) -> float | None:
            v = metrics.get(key)
            return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None

        found: dict[str, str] = {}
        kl = value(self.kl_metric)
        if self.kl_threshold is not None and kl is not None and kl > self.kl_threshold:
            found["kl"] = f"{self.kl_metric} {kl:.4g} > {self.kl_threshold:g}"
        reward = value(self.reward_metric)
        if self.reward_drop is not None and reward is not None:
            self.rewards.append(reward)
            if len(self.rewards) == self.rewards.maxlen:
                smoothed = sum(self.rewards) / len(self.rewards)
                self.reward_peak = smoothed if self.reward_peak is None else max(self.reward_peak, smoothed)
                floor = self.reward_peak - self.reward_drop * abs(self.reward_peak)
                if abs(self.reward_peak) > 1e-12 and smoothed < floor:
                    found["reward"] = (f"{self.reward_metric} (mean of {len(self.rewards)} steps) {smoothed:.4g} is "
                                       f"more than {self.reward_drop:.0%} below its peak {self.reward_peak:.4g}")
        length = value(self.length_metric)
        if self.min_response_length is not None and length is not None and length < self.min_response_length:
            found["length"] = f"{self.length_metric} {length:.4g} < {self.min_response_length:g} (response collapse)"
        repetition = value(self.repetition_metric)
        if self.max_repetition_rate is not None and repetition is not None and repetition > self.max_repetition_rate:
            found["repetition"] = (f"{self.repetition_metric} {repetition:.3g} > {self.max_repetition_rate:g} "
                                   "(responses collapse into loops)")
        return found

    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        violations = self._violations(metrics)
        self.streaks = {name: self.streaks.get(name, 0) + 1 for name in violations}
        tripped = [name for name, count in self.streaks.items() if count >= self.patience]
        if not tripped or self.stopped_reason is not None:
            return
        detail = "; ".join(violations[name] for name in tripped)
        self.stopped_reason = f"{detail} for {self.patience} consecutive step(s), stopping at step {step}"
        # The alert's "stop" action records the reason (trainer.request_stop) after the row is written.
        emit_alert(trainer, Alert("early_stop", self.stopped_reason, severity="critical", action="stop"), step)


def callbacks_from_config(config: Any) -> list[TrainerCallback]:
    """The callbacks ``trainer.alerts`` and ``trainer.callbacks`` ask for, in the order they should run.

    Health alerts run first (their rows precede a stop), then the early stopper, then the best-checkpoint saver
    (which then knows whether this step ends the run and is checkpointed anyway), then custom callbacks.
    """
    trainer_cfg = getattr(config, "trainer", None)
    if trainer_cfg is None or not hasattr(trainer_cfg, "callbacks"):
        return []
    callbacks: list[TrainerCallback] = []
    if trainer_cfg.alerts.enable:
        callbacks.append(AlertMonitor.from_config(config))
    stop = trainer_cfg.callbacks.early_stop
    if stop.enable:
        callbacks.append(EarlyStopper(stop.patience, stop.kl_threshold, stop.reward_drop, stop.reward_window,
                                      stop.min_response_length, stop.max_repetition_rate))
    best = trainer_cfg.callbacks.best_checkpoint
    if best.enable:
        callbacks.append(BestCheckpointSaver(best.metric, best.mode, best.save_on_improve))
    for i, spec in enumerate(trainer_cfg.callbacks.custom):
        callbacks.append(load_callback(spec, f"trainer.callbacks.custom[{i}]"))
    return callbacks

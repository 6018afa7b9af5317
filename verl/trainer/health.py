"""Training health: one rule engine over the logged metrics, with actions.

A rule is a condition over one ``scope/name`` metric (``trainer.health.rules``, ``HealthRuleConfig``) and an action:

==========  ====================================================================================================
warn        an ``alert`` row in ``verl_logs.jsonl``, a console warning, a tracker event (wandb alert, TensorBoard
            text, MLflow ``alerts.json``); repeated every ``cooldown_steps`` while the condition keeps holding
skip_step   no critic/actor update this step (decided before the update, so only ``rollout/*`` metrics qualify);
            the step's ``ppo/update_skipped`` is 1
checkpoint  checkpoint this step (unless the loop saves it anyway)
stop        stop after this step: final checkpoint, a reason row, exit 0
==========  ====================================================================================================

Conditions: ``above`` / ``below`` a threshold; ``drop_from_peak`` (the mean over ``window`` steps fell more than
``threshold`` — a fraction — below its peak); ``below_start`` (below ``threshold`` x the mean of the first
``window`` steps); ``non_finite`` (a NaN/Inf loss or gradient; the actor already skipped that optimizer step). A rule
acts once its condition has held for ``patience`` consecutive steps.

The default rules (used while ``trainer.health.rules`` is unset) warn on KL, reward and entropy collapse, clipped
lengths, repetition and non-finite steps (docs/monitoring.md lists them); ``early_stop_rules`` builds the stop rules
for Python code. Python code adds rules with ``trainer.add_callback(HealthMonitor([...]))``; a rule is
any object with a ``name`` and ``check(step, metrics) -> Alert | None`` (and, for ``skip_step``, ``before_update =
True``). Best-checkpoint selection is not a health rule: it stays a callback (``BestCheckpointSaver``).
"""

from __future__ import annotations

import math
import sys
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, Literal, Protocol

from verl.config import HealthRuleConfig
from verl.errors import ConfigError
from verl.tracking.backends import ConsoleTracker
from verl.trainer.callbacks import BestCheckpointSaver, TrainerCallback, _is_scheduled_save, load_callback

Action = Literal["warn", "skip_step", "checkpoint", "stop"]
ACTION_RANK = {"warn": 0, "skip_step": 1, "checkpoint": 2, "stop": 3}


@dataclass
class Alert:
    """One firing of a health rule."""

    rule: str
    message: str
    metric: str | None = None
    value: float | None = None
    threshold: float | None = None
    severity: Literal["warning", "critical"] = "warning"
    action: Action = "warn"


class Rule(Protocol):
    """What ``HealthMonitor`` runs: ``check`` returns an alert when the rule acts at this step."""

    name: str

    def check(self, step: int, metrics: dict[str, float]) -> Alert | None: ...


def _finite(metrics: dict[str, float], key: str) -> float | None:
    value = metrics.get(key)
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


class MetricRule:
    """A ``HealthRuleConfig`` made runnable: it keeps the state its condition needs (peak, start level, streak)."""

    WATCHED_SCOPES = ("ppo/", "critic/")  # where non_finite looks

    def __init__(self, spec: HealthRuleConfig):
        self.spec = spec
        self.name = spec.name
        self.before_update = spec.action == "skip_step"
        self.cooldown_steps = spec.cooldown_steps
        self.streak = 0
        self.recent: deque[float] = deque(maxlen=spec.window)
        self.peak: float | None = None
        self.start: list[float] = []

    @classmethod
    def of(cls, **fields: Any) -> MetricRule:
        """``MetricRule.of(name=..., metric=..., when=..., threshold=...)``: validated like YAML rules."""
        try:
            return cls(HealthRuleConfig(**fields))
        except ValueError as exc:
            raise ConfigError(f"health rule {fields.get('name')!r}: {exc}") from None

    # ------------------------------------------------------------------ conditions: a description when it holds

    def _holds(self, step: int, metrics: dict[str, float]) -> tuple[str, float | None, float | None] | None:
        """(description, value, threshold) when the condition holds at this step, else None."""
        spec = self.spec
        if spec.when == "non_finite":
            bad = sorted(k for k, v in metrics.items() if k.startswith(self.WATCHED_SCOPES)
                         and isinstance(v, float) and not math.isfinite(v))
            skipped = _finite(metrics, "ppo/nan_skipped")
            if not bad and not (skipped is not None and skipped > 0):
                return None
            what = ", ".join(bad) if bad else "a gradient"
            return f"non-finite value in {what} at step {step}: the optimizer step was skipped", None, None
        value = _finite(metrics, spec.metric)
        if value is None:
            return None
        threshold = float(spec.threshold)  # type: ignore[arg-type]  (validated: set for every other condition)
        if spec.when == "above":
            return (f"{spec.metric} {value:.4g} > {threshold:g}", value, threshold) if value > threshold else None
        if spec.when == "below":
            return (f"{spec.metric} {value:.4g} < {threshold:g}", value, threshold) if value < threshold else None
        if spec.when == "drop_from_peak":
            self.recent.append(value)
            if len(self.recent) < spec.window:
                return None
            smoothed = sum(self.recent) / len(self.recent)
            self.peak = smoothed if self.peak is None else max(self.peak, smoothed)
            floor = self.peak - threshold * abs(self.peak)
            if abs(self.peak) < 1e-12 or smoothed >= floor:
                return None
            return (f"{spec.metric} (mean of {len(self.recent)} steps) {smoothed:.4g} is more than {threshold:.0%} "
                    f"below its peak {self.peak:.4g}", smoothed, floor)
        # below_start: the first `window` values set the baseline; the condition is checked after them
        if len(self.start) < spec.window:
            self.start.append(value)
            return None
        baseline = sum(self.start) / len(self.start)
        floor = threshold * baseline
        if baseline <= 0 or value >= floor:
            return None
        return f"{spec.metric} {value:.4g} fell below {threshold:g}x its starting level {baseline:.4g}", value, floor

    def check(self, step: int, metrics: dict[str, float]) -> Alert | None:
        held = self._holds(step, metrics)
        if held is None:
            self.streak = 0
            return None
        self.streak += 1
        if self.streak < self.spec.patience:
            return None
        message, value, threshold = held
        if self.spec.patience > 1:
            message += f" for {self.spec.patience} consecutive step(s)"
        action = self.spec.action
        message += {"warn": "", "skip_step": "; skipping this step's update",
                    "checkpoint": f"; checkpointing step {step}", "stop": f", stopping at step {step}"}[action]
        if self.spec.advice:
            message += f"; {self.spec.advice}"
        metric = self.spec.metric or "ppo/nan_skipped"
        return Alert(self.name, message, metric, value, threshold,
                     severity="critical" if action == "stop" else "warning", action=action)


# ---------------------------------------------------------------------------------------------- acting


# A reward model's reward rising by this many of its starting spreads while the rule's accuracy does not rise: the
# reward model is being learnt, not the task (`verl ship`'s tripwire uses the same number on held-out accuracy).
RM_STALL_Z = 2.0


class RewardDivergence:
    """Warns when a training reward rises while a held-out task metric does not: reward hacking, seen in training.

    ``reward`` is a per-step training metric (``rollout/reward_mean``, or a reward model's ``rollout/rm_score``);
    ``task`` is any metric the reward does not produce: the rule's accuracy on the same samples (every step) or a
    held-out validation metric (``eval/accuracy``, an eval task's ``eval/...``: only on validation steps, which
    ``HealthMonitor`` passes in through ``on_evaluate``). The start is the mean reward of the first ``window``
    steps, its spread (the mean ``spread`` metric, the reward's standard deviation across a step's samples: a reward
    has units of its own) and the task metric logged by the end of those steps. Now: the mean reward of the last
    ``window`` steps, ``z`` = (now - start) / spread, against the task metric logged in those steps (else its latest
    value after the start). It acts when ``z >= z`` and the task metric has not risen by more than ``min_gain``, or
    fell from its peak (the best mean over ``window`` steps) by more than that and by more than half its rise.
    Measured on SmolLM2 (benchmarks/rm_smollm2.py) with a reward model: with the peak rule alone (a fall of 0.05)
    it warned in three runs that went on to 67-80% held-out accuracy, on dips of a 16-sample rollout accuracy."""

    name = "reward_divergence"
    reads_evaluation = True  # HealthMonitor also runs it on the validation metrics

    def __init__(self, reward: str = "rollout/reward_mean", task: str = "eval/accuracy", window: int = 5,
                 min_gain: float = 0.05, z: float = RM_STALL_Z, spread: str = "rollout/reward_std",
                 action: Action = "warn", advice: str = "", name: str | None = None):
        self.reward, self.task, self.spread = reward, task, spread
        self.window, self.min_gain, self.z, self.action, self.advice = window, min_gain, z, action, advice
        if name is not None:
            self.name = name
        self.rewards: list[tuple[int, float, float]] = []  # (step, reward, spread)
        self.values: dict[int, float] = {}  # step -> task metric

    def check(self, step: int, metrics: dict[str, float]) -> Alert | None:
        reward, value = _finite(metrics, self.reward), _finite(metrics, self.task)
        if reward is not None and not (self.rewards and self.rewards[-1][0] == step):
            self.rewards.append((step, reward, _finite(metrics, self.spread) or 0.0))
        if value is not None:
            self.values[step] = value
        w = self.window
        if len(self.rewards) < 2 * w:
            return None
        start_end, now_begin = self.rewards[w - 1][0], self.rewards[-w][0]
        steps = sorted(self.values)
        start = [self.values[s] for s in steps if s <= start_end]
        later = [s for s in steps if s > start_end]
        spread = sum(r[2] for r in self.rewards[:w]) / w
        if not start or not later or spread <= 1e-9:
            return None  # nothing held out from the start, or nothing since: no comparison yet
        start_reward = sum(r[1] for r in self.rewards[:w]) / w
        now_reward = sum(r[1] for r in self.rewards[-w:]) / w
        start_value = sum(start) / len(start)
        recent = [self.values[s] for s in later if s >= now_begin] or [self.values[later[-1]]]
        now_value = sum(recent) / len(recent)
        windows = [[self.values[t] for t in steps if s - w < t <= s] for s in later]
        peak = max([start_value, *(sum(v) / len(v) for v in windows)])
        z = (now_reward - start_reward) / spread
        # Fallen from the peak: by more than the noise floor and by more than half of what it had gained (a step's
        # rule accuracy is a few samples' worth: a small dip after a real rise is not gaming).
        fell = peak - now_value > max(self.min_gain, 0.5 * (peak - start_value))
        stalled = now_value - start_value <= self.min_gain or fell
        if z < self.z or not stalled:
            return None
        message = self.describe(z, start_reward, now_reward, start_value, now_value, peak)
        if self.advice:
            message += f"; {self.advice}"
        return Alert(self.name, message, metric=self.reward, value=z, threshold=self.z,
                     severity="critical" if self.action == "stop" else "warning", action=self.action)

    def describe(self, z: float, start_reward: float, now_reward: float, start_value: float, now_value: float,
                 peak: float) -> str:
        return (f"{self.reward} rose {z:.1f} times its starting spread ({start_reward:.3f} -> {now_reward:.3f}, mean "
                f"of {self.window} steps) while {self.task}, which the reward does not make, went {start_value:.3f} "
                f"-> {now_value:.3f} (peak {peak:.3f}): the policy may be gaming the reward; read the samples")


class RewardModelGaming(RewardDivergence):
    """``RewardDivergence`` of a reward model's score (``rollout/rm_score``) against the rule's accuracy on the same
    samples (``rollout/acc``, logged when the data has answers): on by default when a reward model gives the
    reward."""

    name = "reward_model_gaming"

    def __init__(self, window: int = 5, min_accuracy_gain: float = 0.05, z: float = RM_STALL_Z):
        super().__init__("rollout/rm_score", "rollout/acc", window, min_accuracy_gain, z)

    def describe(self, z: float, start_reward: float, now_reward: float, start_value: float, now_value: float,
                 peak: float) -> str:
        return (f"the reward model's score rose {z:.1f} times its starting spread ({start_reward:.3f} -> "
                f"{now_reward:.3f}, mean of {self.window} steps) while the rule's accuracy went {start_value:.3f} -> "
                f"{now_value:.3f} (peak {peak:.3f}): the policy may be gaming the reward model; read the "
                "samples, mix in the rule (reward.model.rule_weight) or retrain the reward model on the policy's "
                "newer answers")


def emit_alert(trainer: Any, alert: Alert, step: int) -> dict[str, Any]:
    """Record ``alert`` everywhere (JSONL row, console, trackers) and carry out its action."""
    fields = {k: v for k, v in asdict(alert).items() if v is not None}
    logger = getattr(trainer, "logger", None)
    if logger is not None:
        logger.event("alert", level="ERROR" if alert.severity == "critical" else "WARNING", step=step, **fields)
    trackers = list(getattr(trainer, "trackers", []))
    for tracker in trackers:
        tracker.log_alert(fields, step)

    # The console tracker prints alerts itself; without it, still warn on stderr (unless told to be quiet).
    if not any(isinstance(t, ConsoleTracker) for t in trackers) and not getattr(trainer, "quiet", False):
        print(f"ALERT step {step}: {alert.rule}: {alert.message}", file=sys.stderr)
    if alert.action == "stop":
        trainer.request_stop(f"{alert.rule}: {alert.message}")
    elif alert.action == "skip_step":
        trainer.request_skip_update(f"{alert.rule}: {alert.message}")
    elif alert.action == "checkpoint" and not _is_scheduled_save(trainer, step):
        trainer.checkpoint(step, {})
    return fields


class HealthMonitor(TrainerCallback):
    """Runs health rules: ``skip_step`` rules on the rollout metrics before the update (``on_rollout_end``), the
    others on every step's metrics (``on_step_end``). A rule that keeps holding acts again every
    ``cooldown_steps`` (its own, or the monitor's); ``stop`` acts once."""

    def __init__(self, rules: list[Rule], cooldown_steps: int = 10):
        self.rules = list(rules)
        self.cooldown_steps = cooldown_steps
        self.last_acted: dict[int, int] = {}  # id(rule) -> step
        self.fired: list[dict[str, Any]] = []

    @classmethod
    def from_config(cls, config: Any) -> HealthMonitor:
        return cls(build_health_rules(config), config.trainer.health.cooldown_steps)

    def _run(self, trainer: Any, step: int, metrics: dict[str, float], before_update: bool,
             evaluation: bool = False) -> None:
        due: dict[str, Alert] = {}
        for rule in self.rules:
            if bool(getattr(rule, "before_update", False)) != before_update:
                continue
            if evaluation and not getattr(rule, "reads_evaluation", False):
                continue  # a rule over step metrics: the validation row is not a step (its patience, cooldown)
            alert = rule.check(step, metrics)
            if alert is None:
                self.last_acted.pop(id(rule), None)  # the condition cleared: the next violation acts at once
                continue
            last = self.last_acted.get(id(rule))
            cooldown = getattr(rule, "cooldown_steps", None) or self.cooldown_steps
            if alert.action in ("stop", "skip_step") or last is None or step - last >= cooldown:
                self.last_acted[id(rule)] = step
                # Rules sharing a name (non_finite: warn every step, stop after a streak) report once per step,
                # with the strongest action.
                if alert.rule not in due or ACTION_RANK[alert.action] > ACTION_RANK[due[alert.rule].action]:
                    due[alert.rule] = alert
        for alert in due.values():
            self.fired.append(emit_alert(trainer, alert, step))

    def on_rollout_end(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        self._run(trainer, step, metrics, before_update=True)

    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        self._run(trainer, step, metrics, before_update=False)

    def on_evaluate(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        """Validation's ``eval/*`` metrics, for the rules that read held-out numbers (``reads_evaluation``)."""
        self._run(trainer, step, metrics, before_update=False, evaluation=True)


# ---------------------------------------------------------------------------------------------- defaults

KL_FACTOR = 5.0  # the KL warning fires at this multiple of the controller's target


def default_rules(config: Any) -> list[HealthRuleConfig]:
    """The shipped warn rules (and the stop after three non-finite steps in a row); the KL bound is 5x
    ``algorithm.kl_ctrl.target_kl``."""
    target = config.algorithm.kl_ctrl.target_kl
    rules: list[dict[str, Any]] = [
        dict(name="kl_far_above_target", metric="ppo/kl_div", when="above", threshold=KL_FACTOR * target,
             advice=f"{KL_FACTOR:g}x the KL target {target:g}: the policy is leaving the reference fast; "
                    "lower actor.optim.lr or raise actor.kl_loss_coef"),
        dict(name="reward_collapse", metric="rollout/reward_mean", when="drop_from_peak", threshold=0.5, window=5,
             advice="look at the latest samples for reward hacking or degenerate outputs"),
        dict(name="entropy_collapse", metric="ppo/entropy", when="below_start", threshold=0.1, window=5,
             advice="the policy is becoming deterministic (mode collapse): consider actor.entropy_coeff > 0 or "
                    "a lower learning rate"),
        dict(name="length_clip_high", metric="rollout/response_length_clip_ratio", when="above", threshold=0.5,
             advice="responses are being cut at data.max_response_length: raise it, or penalise length"),
        dict(name="repetition_collapse", metric="rollout/repetition_rate", when="above", threshold=0.5,
             advice="responses repeat themselves (degenerate loops): check the samples, lower the learning rate"),
        # The training reward against the held-out accuracy (reward-independent: the data's answers), when the run
        # validates: a reward that rises while the accuracy does not is being gamed.
        *([dict(name="reward_divergence", metric="rollout/reward_mean", when="diverges", against="eval/accuracy",
                threshold=RM_STALL_Z, window=5)] if config.trainer.test_freq > 0 else []),
        dict(name="non_finite", when="non_finite", cooldown_steps=1),  # every skipped update is reported
        dict(name="non_finite", when="non_finite", patience=3, action="stop",
             advice="lower actor.optim.lr, check the reward for NaN, or use float32"),
    ]
    return [HealthRuleConfig(**rule) for rule in rules]


def build_health_rules(config: Any) -> list[Rule]:
    """The rules ``trainer.health`` configures (``config`` is a ``VerlConfig``)."""
    health = config.trainer.health
    specs = default_rules(config) if health.rules is None else list(health.rules)
    rules: list[Rule] = [rule_of(spec) for spec in [*specs, *health.add_rules]]
    model = config.reward.model
    if health.rules is None and (model.path or model.url):
        rules.append(RewardModelGaming())  # a reward model gives the reward: watch it against the rule
    return rules


def rule_of(spec: HealthRuleConfig) -> Rule:
    """The rule a ``trainer.health.rules`` entry describes: ``when: diverges`` is a ``RewardDivergence`` of
    ``metric`` (a training reward) against ``against`` (a metric the reward does not make); the rest ``MetricRule``."""
    if spec.when == "diverges":
        return RewardDivergence(spec.metric, spec.against, spec.window, spec.min_gain, spec.threshold,
                                action=spec.action, advice=spec.advice, name=spec.name)
    return MetricRule(spec)


def early_stop_rules(patience: int = 5, kl_threshold: float | None = 0.2, reward_drop: float | None = 0.2,
                     reward_window: int = 5, min_response_length: float | None = 1.0,
                     max_repetition_rate: float | None = 0.9) -> list[Rule]:
    """The ``early_stop`` stop rules for Python code: ``trainer.add_callback(HealthMonitor(early_stop_rules(...)))``;
    a condition set to None is left out."""
    if patience < 1:
        raise ConfigError(f"EarlyStopper patience must be >= 1, got {patience}")
    conditions = [("ppo/kl_div", "above", kl_threshold, 1, ""),
                  ("rollout/reward_mean", "drop_from_peak", reward_drop, reward_window, ""),
                  ("rollout/response_length_mean", "below", min_response_length, 1,
                   "response collapse: responses shrink to nothing"),
                  ("rollout/repetition_rate", "above", max_repetition_rate, 1, "responses collapse into loops")]
    try:
        return [MetricRule(HealthRuleConfig(name="early_stop", metric=metric, when=when, threshold=threshold,
                                            window=window, patience=patience, action="stop", advice=advice))
                for metric, when, threshold, window, advice in conditions if threshold is not None]
    except ValueError as exc:
        raise ConfigError(f"early_stop_rules: {exc}") from None


class EarlyStopper(HealthMonitor):
    """A monitor holding only the early-stop rules: ``trainer.add_callback(EarlyStopper(patience=5, ...))``."""

    def __init__(self, patience: int = 5, **conditions: Any):
        super().__init__(early_stop_rules(patience, **conditions))


def callbacks_from_config(config: Any) -> list[TrainerCallback]:
    """The callbacks ``trainer.health`` and ``trainer.callbacks`` ask for, in the order they run: the health rules
    first (their rows precede a stop), then the best-checkpoint saver (which then knows whether this step ends the
    run and is checkpointed anyway), then custom callbacks."""
    trainer_cfg = getattr(config, "trainer", None)
    if trainer_cfg is None or not hasattr(trainer_cfg, "callbacks"):
        return []
    callbacks: list[TrainerCallback] = []
    if trainer_cfg.health.enable:
        monitor = HealthMonitor.from_config(config)
        if monitor.rules:
            callbacks.append(monitor)
    best = trainer_cfg.callbacks.best_checkpoint
    if best.enable:
        callbacks.append(BestCheckpointSaver(best.metric, best.mode, best.save_on_improve))
    for i, spec in enumerate(trainer_cfg.callbacks.custom):
        callbacks.append(load_callback(spec, f"trainer.callbacks.custom[{i}]"))
    return callbacks

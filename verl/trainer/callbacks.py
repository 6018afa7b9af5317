"""Trainer callbacks: hooks the driver loop calls, and the ``StopTraining`` signal.

Hooks: ``on_train_start(trainer)``, ``on_step_end(trainer, step, metrics)``, ``on_log(logs)``,
``on_evaluate(trainer, step, metrics)``, ``on_save(trainer, step, path)``, ``on_train_end(trainer, reason)``.
A callback stops the run by calling ``trainer.request_stop(reason)``; the loop then writes a final checkpoint,
logs the reason and returns normally (exit code 0).

Shipped: ``BestCheckpointSaver`` (keep and mark the best checkpoint by a metric), ``EarlyStopper`` (stop a run
that goes unstable) and ``verl.trainer.alerts.AlertMonitor`` (metric health alerts). All three can be attached
from YAML (``trainer.callbacks``, ``trainer.alerts``; see ``callbacks_from_config``) or from Python::

    trainer.add_callback(BestCheckpointSaver("eval/accuracy", mode="max"))
    trainer.add_callback(EarlyStopper(patience=5, kl_threshold=0.2))
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class TrainerCallback:
    """Base class with no-op hooks; override the ones you need."""

    def on_train_start(self, trainer: Any) -> None: ...

    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, float]) -> None: ...

    def on_log(self, logs: dict[str, Any], **kwargs: Any) -> None: ...

    def on_evaluate(self, trainer: Any, step: int, metrics: dict[str, float]) -> None: ...

    def on_save(self, trainer: Any, step: int, path: Path) -> None: ...

    def on_train_end(self, trainer: Any, reason: str) -> None: ...


HOOKS = tuple(name for name in vars(TrainerCallback) if name.startswith("on_"))


def check_callback(callback: Any) -> Any:
    """Accept any object with at least one hook method (the others are no-ops); refuse the rest at once, with the
    fix, instead of failing inside ``fit()``."""
    from verl.errors import ConfigError

    if isinstance(callback, type):
        raise ConfigError(f"add_callback got the class {callback.__name__}; pass an instance: "
                          f"add_callback({callback.__name__}(...))")
    if not any(callable(getattr(callback, hook, None)) for hook in HOOKS):
        raise ConfigError(
            f"add_callback got a {type(callback).__name__} with none of the hooks {', '.join(HOOKS)}; subclass "
            "verl.trainer.callbacks.TrainerCallback and override the hooks you need"
        )
    return callback


class CallbackList:
    def __init__(self, callbacks: list[TrainerCallback] | None = None):
        self.callbacks = [check_callback(c) for c in callbacks or []]

    def add(self, callback: TrainerCallback) -> None:
        self.callbacks.append(check_callback(callback))

    def __getattr__(self, hook: str):
        if hook not in HOOKS:
            raise AttributeError(hook)

        def dispatch(*args: Any, **kwargs: Any) -> None:
            for callback in self.callbacks:
                method = getattr(callback, hook, None)  # duck-typed callbacks may implement only some hooks
                if method is not None:
                    method(*args, **kwargs)

        return dispatch


# ---------------------------------------------------------------------------------------------- shipped callbacks


def _is_scheduled_save(trainer: Any, step: int) -> bool:
    """Whether the loop checkpoints ``step`` itself (mirrors ``PPOTrainer.fit``: every save_freq, the end, a stop)."""
    cfg = trainer.config.trainer
    final = step >= cfg.total_steps or trainer.stop_reason is not None
    return final or (cfg.save_freq > 0 and step % cfg.save_freq == 0)


class BestCheckpointSaver(TrainerCallback):
    """Keep and mark the best checkpoint by ``metric`` (``mode`` "max" or "min").

    When the metric improves, the step is checkpointed at once (unless the loop saves it anyway, or
    ``save_on_improve=False``, which ranks only the scheduled checkpoints). The best checkpoint is named by
    ``checkpoints/best`` (retention never deletes it) with ``checkpoints/best.json`` holding metric, value and step;
    a resumed run reads that file back, so it only replaces the best with a better one.

        trainer.add_callback(BestCheckpointSaver("eval/accuracy", mode="max"))
    """

    def __init__(self, metric: str = "eval/accuracy", mode: str = "max", save_on_improve: bool = True):
        if mode not in ("max", "min"):
            from verl.errors import ConfigError

            raise ConfigError(f"BestCheckpointSaver mode must be 'max' or 'min', got {mode!r}")
        self.metric = metric
        self.mode = mode
        self.save_on_improve = save_on_improve
        self.best_value: float | None = None
        self.best_step: int | None = None
        self.best_path: Path | None = None
        self.current: tuple[int, float] | None = None  # (step, value) of the latest observation

    def better(self, value: float) -> bool:
        if self.best_value is None:
            return True
        return value > self.best_value if self.mode == "max" else value < self.best_value

    def on_train_start(self, trainer: Any) -> None:
        import json

        from verl.trainer.checkpoint import checkpoint_root, read_pointer

        marker = checkpoint_root(trainer.run_dir) / "best.json"
        if read_pointer(trainer.run_dir, "best") is None or not marker.is_file():
            return
        try:
            saved = json.loads(marker.read_text())
        except ValueError:
            return
        if saved.get("metric") == self.metric and saved.get("mode") == self.mode:
            self.best_value, self.best_step = float(saved["value"]), int(saved["step"])
            self.best_path = read_pointer(trainer.run_dir, "best")

    def _observe(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        import math

        value = metrics.get(self.metric)
        if step <= 0 or not isinstance(value, (int, float)) or not math.isfinite(value):
            return  # step 0 is the untrained model (validation before training): nothing to save
        self.current = (step, float(value))
        if self.better(float(value)) and self.save_on_improve and not _is_scheduled_save(trainer, step):
            trainer._checkpoint(step, dict(metrics))  # on_save below marks it

    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        self._observe(trainer, step, metrics)

    def on_evaluate(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        self._observe(trainer, step, metrics)

    def on_save(self, trainer: Any, step: int, path: Path) -> None:
        from verl.trainer.checkpoint import checkpoint_root, write_pointer
        from verl.utils.fs import atomic_write_json

        if self.current is None or self.current[0] != step or not self.better(self.current[1]):
            return
        self.best_step, self.best_value, self.best_path = step, self.current[1], Path(path)
        write_pointer(trainer.run_dir, self.best_path, "best")
        atomic_write_json(checkpoint_root(trainer.run_dir) / "best.json",
                          {"metric": self.metric, "mode": self.mode, "value": self.best_value, "step": step,
                           "checkpoint": self.best_path.name})
        trainer.logger.event("train", step=step, best_checkpoint=str(self.best_path), best_metric=self.metric,
                             best_value=self.best_value)


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
        from verl.trainer.alerts import Alert, emit_alert

        detail = "; ".join(violations[name] for name in tripped)
        self.stopped_reason = f"{detail} for {self.patience} consecutive step(s), stopping at step {step}"
        # The alert's "stop" action records the reason (trainer.request_stop) after the row is written.
        emit_alert(trainer, Alert("early_stop", self.stopped_reason, severity="critical", action="stop"), step)


def load_callback(spec: str, where: str = "trainer.callbacks.custom") -> TrainerCallback:
    """Instantiate ``package.module:Class`` or ``path/to/file.py:Class`` (a TrainerCallback taking no arguments)."""
    import importlib
    import importlib.util

    from verl.errors import ConfigError

    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{where}: '{spec}' is not 'package.module:Class' or 'file.py:Class'")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise ConfigError(f"{where}: file '{path}' does not exist")
            module_spec = importlib.util.spec_from_file_location(f"verl_user_callback_{path.stem}", path)
            assert module_spec is not None and module_spec.loader is not None
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{where}: cannot import '{module_name}' ({exc})") from None
    factory = getattr(module, attr, None)
    if factory is None:
        raise ConfigError(f"{where}: '{module_name}' has no attribute '{attr}'")
    callback = factory()
    if not isinstance(callback, TrainerCallback):
        raise ConfigError(f"{where}: '{spec}' made a {type(callback).__name__}, not a verl TrainerCallback subclass")
    return callback


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
        from verl.trainer.alerts import AlertMonitor

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

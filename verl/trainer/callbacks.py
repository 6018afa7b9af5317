"""Trainer callbacks: hooks the driver loop calls, and the ``StopTraining`` signal.

Hooks: ``on_train_start(trainer)``, ``on_rollout_end(trainer, step, rollout_metrics)`` (before the update),
``on_step_end(trainer, step, metrics)``, ``on_log(logs)``, ``on_evaluate(trainer, step, metrics)``,
``on_save(trainer, step, path)``, ``on_train_end(trainer, reason)``. A callback stops the run by calling
``trainer.request_stop(reason)``; the loop then writes a final checkpoint, logs the reason and returns normally
(exit code 0). From ``on_rollout_end`` it may skip the step's update with ``trainer.request_skip_update(reason)``.

Shipped here: ``BestCheckpointSaver`` (keep and mark the best checkpoint by a metric). The health rules (alerts,
skipped updates, extra checkpoints, early stopping: ``HealthMonitor``, ``EarlyStopper``) live in
``verl.trainer.health``, which also builds the list from YAML (``trainer.health``, ``trainer.callbacks``;
``callbacks_from_config``). All can be attached from Python (``from verl.trainer import ...``)::

    trainer.add_callback(BestCheckpointSaver("eval/accuracy", mode="max"))
    trainer.add_callback(EarlyStopper(patience=5, kl_threshold=0.2))
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
from pathlib import Path
from typing import Any

from verl.errors import ConfigError
from verl.trainer.checkpoint import checkpoint_root, read_pointer, write_pointer
from verl.utils.fs import atomic_write_json


class TrainerCallback:
    """Base class with no-op hooks; override the ones you need."""

    def on_train_start(self, trainer: Any) -> None: ...

    def on_rollout_end(self, trainer: Any, step: int, metrics: dict[str, float]) -> None: ...

    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, float]) -> None: ...

    def on_log(self, logs: dict[str, Any], **kwargs: Any) -> None: ...

    def on_evaluate(self, trainer: Any, step: int, metrics: dict[str, float]) -> None: ...

    def on_save(self, trainer: Any, step: int, path: Path) -> None: ...

    def on_train_end(self, trainer: Any, reason: str) -> None: ...


HOOKS = tuple(name for name in vars(TrainerCallback) if name.startswith("on_"))


def check_callback(callback: Any) -> Any:
    """Accept any object with at least one hook method (the others are no-ops); refuse the rest at once, with the
    fix, instead of failing inside ``fit()``."""
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
        value = metrics.get(self.metric)
        if step <= 0 or not isinstance(value, (int, float)) or not math.isfinite(value):
            return  # step 0 is the untrained model (validation before training): nothing to save
        self.current = (step, float(value))
        if self.better(float(value)) and self.save_on_improve and not _is_scheduled_save(trainer, step):
            trainer.checkpoint(step, dict(metrics))  # on_save below marks it

    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        self._observe(trainer, step, metrics)

    def on_evaluate(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        self._observe(trainer, step, metrics)

    def on_save(self, trainer: Any, step: int, path: Path) -> None:
        if self.current is None or self.current[0] != step or not self.better(self.current[1]):
            return
        self.best_step, self.best_value, self.best_path = step, self.current[1], Path(path)
        write_pointer(trainer.run_dir, self.best_path, "best")
        atomic_write_json(checkpoint_root(trainer.run_dir) / "best.json",
                          {"metric": self.metric, "mode": self.mode, "value": self.best_value, "step": step,
                           "checkpoint": self.best_path.name})
        trainer.logger.event("train", step=step, best_checkpoint=str(self.best_path), best_metric=self.metric,
                             best_value=self.best_value)


def load_callback(spec: str, where: str = "trainer.callbacks.custom") -> TrainerCallback:
    """Instantiate ``package.module:Class`` or ``path/to/file.py:Class`` (a TrainerCallback taking no arguments)."""
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

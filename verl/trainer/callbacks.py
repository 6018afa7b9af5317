"""Trainer callbacks: hooks the driver loop calls, and the ``StopTraining`` signal.

Hooks: ``on_train_start(trainer)``, ``on_step_end(trainer, step, metrics)``, ``on_log(logs)``,
``on_evaluate(trainer, step, metrics)``, ``on_save(trainer, step, path)``, ``on_train_end(trainer, reason)``.
A callback stops the run by calling ``trainer.request_stop(reason)``; the loop then writes a final checkpoint,
logs the reason and returns normally (exit code 0).
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


class CallbackList:
    def __init__(self, callbacks: list[TrainerCallback] | None = None):
        self.callbacks = list(callbacks or [])

    def add(self, callback: TrainerCallback) -> None:
        self.callbacks.append(callback)

    def __getattr__(self, hook: str):
        if not hook.startswith("on_"):
            raise AttributeError(hook)

        def dispatch(*args: Any, **kwargs: Any) -> None:
            for callback in self.callbacks:
                getattr(callback, hook)(*args, **kwargs)

        return dispatch

"""Trainers: the PPO driver loop and its executors, SFT, callbacks, health rules, checkpoints."""

from __future__ import annotations

import importlib
from typing import Any

# `from verl.trainer import TrainerCallback` (as in the user's guides), imported on first use: `verl --help` and
# `verl.trainer.cli` import this package, and these names bring torch.
_EXPORTS = {"BestCheckpointSaver": "verl.trainer.callbacks", "TrainerCallback": "verl.trainer.callbacks",
            "EarlyStopper": "verl.trainer.health", "HealthMonitor": "verl.trainer.health"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'verl.trainer' has no attribute '{name}'")
    return getattr(importlib.import_module(_EXPORTS[name]), name)

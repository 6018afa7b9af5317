"""Trainers: the PPO driver loop and its executors, SFT, callbacks, health rules, checkpoints."""

# `from verl.trainer import TrainerCallback` (as in the user's guides).
from verl.trainer.callbacks import BestCheckpointSaver, TrainerCallback
from verl.trainer.health import EarlyStopper, HealthMonitor

__all__ = ["BestCheckpointSaver", "EarlyStopper", "HealthMonitor", "TrainerCallback"]

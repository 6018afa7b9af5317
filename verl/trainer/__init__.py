"""Trainers: the PPO driver loop and its executors, SFT, callbacks, checkpoints."""

# `from verl.trainer import TrainerCallback` (as in the user's guides); callbacks.py imports only the stdlib.
from verl.trainer.alerts import EarlyStopper
from verl.trainer.callbacks import BestCheckpointSaver, TrainerCallback

__all__ = ["BestCheckpointSaver", "EarlyStopper", "TrainerCallback"]

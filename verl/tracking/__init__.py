"""Experiment trackers behind one fan-out: jsonl (always), console, tensorboard, wandb, mlflow."""

from verl.tracking.base import TRACKERS, Tracker, check_trackers, create_trackers, register_tracker

__all__ = ["TRACKERS", "Tracker", "check_trackers", "create_trackers", "register_tracker"]

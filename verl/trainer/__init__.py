"""Trainers: the PPO driver loop and its executors, SFT, callbacks, checkpoints."""

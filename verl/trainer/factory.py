"""Pick the executor named by ``trainer.executor``: the same loop, different placement of roles."""

from __future__ import annotations

from verl.config import VerlConfig
from verl.trainer.local import LocalPPOTrainer
from verl.trainer.ppo import PPOTrainer
from verl.trainer.ray import RayPPOTrainer


def build_trainer(config: VerlConfig, quiet: bool = False) -> PPOTrainer:
    if config.trainer.executor == "ray":
        return RayPPOTrainer(config, quiet=quiet)

    return LocalPPOTrainer(config, quiet=quiet)

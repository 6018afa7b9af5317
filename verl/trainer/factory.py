"""Pick the executor named by ``trainer.executor``: the same loop, different placement of roles."""

from __future__ import annotations

from verl.config import VerlConfig
from verl.trainer.ppo import PPOTrainer


def build_trainer(config: VerlConfig, quiet: bool = False) -> PPOTrainer:
    if config.trainer.executor == "ray":
        from verl.trainer.ray import RayPPOTrainer

        return RayPPOTrainer(config, quiet=quiet)
    from verl.trainer.local import LocalPPOTrainer

    return LocalPPOTrainer(config, quiet=quiet)

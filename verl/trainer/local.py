"""``LocalPPOTrainer``: every role in this process (one ``RoleWorker``, the rollout sharing the actor's module).

    from verl.trainer.local import LocalPPOTrainer
    trainer = LocalPPOTrainer(config_path="configs/grpo_tiny.yaml")   # or config=VerlConfig(...)/dict
    trainer.fit()
"""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedTokenizerBase

from verl.config import VerlConfig, build_config, resolve_experiment_name
from verl.data.dataset import RLHFDataset
from verl.errors import ConfigError
from verl.trainer.overlap import LocalRolloutProcess
from verl.trainer.ppo import PPOTrainer, prepare_inputs
from verl.trainer.resume import load_train_config
from verl.workers.role_worker import RoleWorker, needed_roles


def coerce_config(config: VerlConfig | dict | str | Path | None, config_path: str | Path | None,
                  overrides: list[str] | None = None) -> VerlConfig:
    """Accept a VerlConfig, a dict, or a YAML path (``config_path=`` as in verl's examples)."""
    if config is not None and config_path is not None:
        raise ConfigError("give either config or config_path, not both")
    if isinstance(config, VerlConfig):
        if overrides:
            raise ConfigError("overrides apply to YAML configs; edit the VerlConfig object instead")
        resolve_experiment_name(config, "grpo_tiny")
        return config
    if isinstance(config, dict):
        built = build_config(config, "config dict")
        resolve_experiment_name(built, "grpo_tiny")
        return built

    return load_train_config(config_path or config, overrides)[0]


class LocalPPOTrainer(PPOTrainer):
    """Every role in this process: one ``RoleWorker`` is the roles object (the rollout shares the actor's
    module). Only construction differs from ``PPOTrainer``; the loop is the same object's."""

    def __init__(self, config: VerlConfig | dict | str | Path | None = None, train_dataset: RLHFDataset | None = None,
                 val_dataset: RLHFDataset | None = None, tokenizer: PreTrainedTokenizerBase | None = None,
                 config_path: str | Path | None = None, overrides: list[str] | None = None, quiet: bool = False):
        cfg = coerce_config(config, config_path, overrides)
        inputs = prepare_inputs(cfg, tokenizer, train_dataset, val_dataset)
        worker = RoleWorker(cfg.model_dump(mode="json"), needed_roles(cfg), tokenizer=inputs.tokenizer)
        super().__init__(cfg, worker, inputs, reward_manager=worker.reward, device=worker.device, quiet=quiet,
                         rollout_worker_factory=lambda: LocalRolloutProcess(cfg, worker.model))

    # The roles, for users and tests that want to reach them.
    worker = property(lambda self: self.roles)
    model = property(lambda self: self.roles.model)
    actor = property(lambda self: self.roles.actor)
    rollout = property(lambda self: self.roles.rollout)
    reference = property(lambda self: self.roles.reference)
    critic = property(lambda self: self.roles.critic)

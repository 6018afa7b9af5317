"""``LocalPPOTrainer``: every role in this process (one ``RoleWorker``, the rollout sharing the actor's module).

    from verl.trainer.local import LocalPPOTrainer
    trainer = LocalPPOTrainer(config_path="configs/grpo_tiny.yaml")   # or config=VerlConfig(...)/dict
    trainer.fit()
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from verl.config import VerlConfig, build_config, resolve_experiment_name
from verl.data.dataset import PromptSampler, RLHFDataset
from verl.errors import ConfigError
from verl.models.loader import load_tokenizer
from verl.protocol import DataProto
from verl.rollout.base import RolloutEngine, SamplingParams
from verl.trainer.ppo import PPOTrainer
from verl.utils.seeding import seed_everything, set_num_threads
from verl.workers.ray_worker import RoleWorker

ALL_ROLES = ["actor", "ref", "critic", "reward"]


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
    from verl.trainer.resume import load_train_config

    return load_train_config(config_path or config, overrides)[0]


def needed_roles(config: VerlConfig) -> list[str]:
    roles = ["actor", "reward"]
    if config.use_reference:
        roles.append("ref")
    if config.use_critic:
        roles.append("critic")
    return roles


class LocalPPOTrainer(PPOTrainer):
    def __init__(
        self,
        config: VerlConfig | dict | str | Path | None = None,
        train_dataset: RLHFDataset | None = None,
        val_dataset: RLHFDataset | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        config_path: str | Path | None = None,
        overrides: list[str] | None = None,
        quiet: bool = False,
    ):
        super().__init__(coerce_config(config, config_path, overrides), quiet=quiet)
        cfg = self.config
        set_num_threads(cfg.trainer.num_threads)
        seed_everything(cfg.trainer.seed)
        self.tokenizer = tokenizer or load_tokenizer(cfg.model.tokenizer_path or cfg.model.path,
                                                     cfg.model.trust_remote_code)
        self.train_dataset = train_dataset or RLHFDataset(cfg.data.train_files, self.tokenizer, cfg.data,
                                                          "data.train_files", cfg.needs_ground_truth)
        self.val_dataset = val_dataset or RLHFDataset(cfg.data.val_files, self.tokenizer, cfg.data, "data.val_files",
                                                      cfg.needs_ground_truth)
        self.sampler = PromptSampler(len(self.train_dataset), cfg.data.train_batch_size, cfg.data.shuffle,
                                     cfg.trainer.seed)
        cfg.resolve_total_steps(len(self.train_dataset))  # trainer.total_epochs, as verl counts them
        self.worker = RoleWorker(cfg.model_dump(mode="json"), needed_roles(cfg), tokenizer=self.tokenizer)
        self.device = self.worker.device

    # The roles, for users and tests that want to reach them.
    model = property(lambda self: self.worker.model)
    actor = property(lambda self: self.worker.actor)
    rollout = property(lambda self: self.worker.rollout)
    reference = property(lambda self: self.worker.reference)
    critic = property(lambda self: self.worker.critic)
    reward_manager = property(lambda self: self.worker.reward)

    # ------------------------------------------------------------------ role operations

    def generate(self, prompts: DataProto, params: SamplingParams) -> DataProto:
        return self.worker.generate(prompts, params)

    def compute_reward(self, batch: DataProto) -> tuple[torch.Tensor, dict[str, np.ndarray], list[str]]:
        return self.worker.compute_reward(batch)

    def compute_old_log_prob(self, batch: DataProto) -> torch.Tensor:
        return self.worker.compute_old_log_prob(batch)

    def compute_ref_log_prob(self, batch: DataProto) -> torch.Tensor:
        return self.worker.compute_ref_log_prob(batch)

    def compute_values(self, batch: DataProto) -> torch.Tensor:
        return self.worker.compute_values(batch)

    def compute_kl_terms(self, batch: DataProto) -> dict[str, torch.Tensor]:
        return self.worker.compute_kl_terms(batch)

    def update_actor(self, batch: DataProto, mini_batch_size: int) -> dict[str, float]:
        return self.worker.update_actor(batch, mini_batch_size)

    def update_critic(self, batch: DataProto, mini_batch_size: int) -> dict[str, float]:
        return self.worker.update_critic(batch, mini_batch_size)

    def rollout_engine_for_validation(self) -> RolloutEngine:
        return self.worker.rollout

    def save_role_states(self, directory: Path) -> None:
        self.worker.save(str(directory))

    def load_role_states(self, directory: Path) -> None:
        self.worker.load(str(directory))

    def shutdown(self) -> None:
        self.worker.shutdown()

"""``LocalPPOTrainer``: every role in this process, sharing one actor module with the rollout engine.

    from verl.trainer.local import LocalPPOTrainer
    trainer = LocalPPOTrainer(config_path="configs/grpo_tiny.yaml")   # or config=VerlConfig(...)/dict
    trainer.fit()
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from verl.config import VerlConfig, build_config, load_config, resolve_experiment_name
from verl.data.dataset import PromptSampler, RLHFDataset
from verl.errors import ConfigError
from verl.models.loader import load_causal_lm, load_tokenizer, pick_device
from verl.models.lora import apply_lora, is_lora
from verl.protocol import DataProto
from verl.rollout.base import RolloutEngine, SamplingParams, get_rollout_factory
from verl.trainer.checkpoint import load_model_weights, load_trainer_state, save_checkpoint
from verl.trainer.ppo import PPOTrainer
from verl.utils.seeding import seed_everything, set_num_threads
from verl.workers.actor import Actor
from verl.workers.critic import Critic, load_critic_model
from verl.workers.reference import Reference
from verl.workers.reward import RewardManager


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
    return load_config(config_path or config, overrides)


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
        self.device = pick_device(cfg.trainer.device)
        self.tokenizer = tokenizer or load_tokenizer(cfg.model.tokenizer_path or cfg.model.path,
                                                     cfg.model.trust_remote_code)
        self.train_dataset = train_dataset or RLHFDataset(cfg.data.train_files, self.tokenizer, cfg.data,
                                                          "data.train_files")
        self.val_dataset = val_dataset or RLHFDataset(cfg.data.val_files, self.tokenizer, cfg.data, "data.val_files")
        self.sampler = PromptSampler(len(self.train_dataset), cfg.data.train_batch_size, cfg.data.shuffle,
                                     cfg.trainer.seed)
        self.model = self._build_actor_model()
        self.actor = Actor(self.model, cfg.actor, cfg.trainer.total_steps, cfg.rollout.temperature,
                           cfg.data.max_response_length, group_size=cfg.rollout.n)
        self.rollout = self._build_rollout()
        self.reference = self._build_reference() if cfg.use_reference else None
        self.critic = self._build_critic() if cfg.use_critic else None
        self.reward_manager = RewardManager(self.tokenizer, cfg.reward, self.device)

    # ------------------------------------------------------------------ construction

    def _build_actor_model(self) -> torch.nn.Module:
        cfg = self.config
        model = load_causal_lm(cfg.model.path, cfg.model.dtype, self.device, cfg.model.trust_remote_code)
        if cfg.model.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.config.use_cache = False
        if cfg.model.lora.rank > 0:
            model = apply_lora(model, cfg.model.lora)
        model.train()
        return model

    def _build_rollout(self) -> RolloutEngine:
        cfg = self.config
        factory = get_rollout_factory(cfg.rollout.name)
        autocast = torch.bfloat16 if cfg.actor.autocast == "bf16" else None
        if cfg.rollout.name == "hf":
            return factory(self.model, self.tokenizer, cfg.rollout.micro_batch_size, autocast)
        return factory(model_path=cfg.model.path, tokenizer=self.tokenizer, config=cfg.rollout,
                       max_model_len=cfg.data.max_prompt_length + cfg.data.max_response_length,
                       seed=cfg.trainer.seed, actor_model=self.model)

    def _build_reference(self) -> Reference:
        cfg = self.config
        autocast = torch.bfloat16 if cfg.actor.autocast == "bf16" else None
        if is_lora(self.model):
            return Reference(self.model, cfg.rollout.temperature, cfg.actor.ppo_micro_batch_size,
                             adapters_disabled=True, autocast_dtype=autocast, group_size=cfg.rollout.n)
        ref_device = torch.device("cpu") if cfg.reference.offload_to_cpu else self.device
        ref_model = load_causal_lm(cfg.model.path, cfg.model.dtype, ref_device, cfg.model.trust_remote_code)
        return Reference(ref_model, cfg.rollout.temperature, cfg.actor.ppo_micro_batch_size, autocast_dtype=autocast,
                         group_size=cfg.rollout.n)

    def _build_critic(self) -> Critic:
        cfg = self.config
        model = load_critic_model(cfg.critic.model_path or cfg.model.path, cfg.model.dtype, self.device)
        return Critic(model, cfg.critic, cfg.actor.ppo_epochs, cfg.actor.ppo_micro_batch_size, cfg.trainer.total_steps)

    # ------------------------------------------------------------------ role operations

    def generate(self, prompts: DataProto, params: SamplingParams) -> DataProto:
        return self.rollout.generate(prompts, params)

    def compute_reward(self, batch: DataProto) -> tuple[torch.Tensor, dict[str, np.ndarray], list[str]]:
        return self.reward_manager.compute(batch)

    def compute_old_log_prob(self, batch: DataProto) -> torch.Tensor:
        return self.actor.compute_log_prob(batch)

    def compute_ref_log_prob(self, batch: DataProto) -> torch.Tensor:
        assert self.reference is not None
        return self.reference.compute_ref_log_prob(batch)

    def compute_values(self, batch: DataProto) -> torch.Tensor:
        assert self.critic is not None
        return self.critic.compute_values(batch)

    def update_actor(self, batch: DataProto, mini_batch_size: int) -> dict[str, float]:
        metrics = self.actor.update_policy(batch, mini_batch_size)
        self.rollout.sync_weights(self.model)
        return metrics

    def update_critic(self, batch: DataProto, mini_batch_size: int) -> dict[str, float]:
        assert self.critic is not None
        return self.critic.update(batch, mini_batch_size)

    def rollout_engine_for_validation(self) -> RolloutEngine:
        return self.rollout

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, step: int, metrics: dict[str, float]) -> Path:
        state: dict[str, Any] = {**self.trainer_state(), "actor": self.actor.state_dict()}
        if self.critic is not None:
            state["critic"] = self.critic.state_dict()
        return save_checkpoint(self.run_dir, step, self.model, self.tokenizer, state, metrics,
                               critic=self.critic.model if self.critic else None,
                               max_to_keep=self.config.trainer.max_ckpt_to_keep)

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        state = load_trainer_state(path)
        load_model_weights(self.model, path)
        self.actor.load_state_dict(state["actor"])
        if self.critic is not None:
            load_model_weights(self.critic.model, path / "critic")
            self.critic.load_state_dict(state["critic"])
        self.restore_trainer_state(state)
        self.rollout.sync_weights(self.model)
        return state

    def shutdown(self) -> None:
        self.rollout.shutdown()

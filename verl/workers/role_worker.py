"""``RoleWorker``: the roles (actor + rollout, reference, critic, reward) of one process.

The local executor uses one in the trainer's process as its roles object (``PPOTrainer(roles=...)``); the Ray
executor starts several as Ray actors in worker groups behind ``RayRoles``. The role code is the very same either
way (``Actor``, ``Critic``, ``Reference``, ``HFRollout``, ``RewardManager``); this class only builds the roles a
placement asks for, joins the group's ``torch.distributed`` process group, and exposes one method per role
operation. It imports nothing from Ray.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from verl.batch import TrainBatch
from verl.config import VerlConfig
from verl.evaluators.kl_terms import compute_kl_terms
from verl.models.loader import load_causal_lm, load_tokenizer, pick_device
from verl.models.lora import apply_lora, is_lora
from verl.models.weights import load_model_weights, read_model_weights
from verl.protocol import DataProto
from verl.rollout.agent_loop import AgentRollout
from verl.rollout.base import GATEWAY_ENGINES, EngineSpec, SamplingParams, build_rollout
from verl.utils.seeding import seed_everything, set_num_threads
from verl.utils.timing import StageTimer
from verl.workers.actor import Actor
from verl.workers.critic import Critic, load_critic_model
from verl.workers.dist import DistInfo, all_ranks, apply_fsdp, full_state_dict, init_process_group
from verl.workers.reference import Reference
from verl.workers.reward import RewardManager

ACTOR_STATE = "actor_state.pt"
CRITIC_STATE = "critic_state.pt"


def needed_roles(config: VerlConfig) -> list[str]:
    """The roles a run needs: actor (+ rollout) and reward always; the reference with a KL term; a critic for
    estimators that need values."""
    roles = ["actor", "reward"]
    if config.use_reference:
        roles.append("ref")
    if config.use_critic:
        roles.append("critic")
    return roles


def actor_state_file(rank: int, fsdp: bool) -> str:
    """Replicas hold identical optimizer state (rank 0's file serves all); FSDP shards it per rank."""
    return f"actor_state_rank{rank}.pt" if fsdp else ACTOR_STATE


class RoleWorker:
    def __init__(self, config: dict, roles: list[str], rank: int = 0, world_size: int = 1,
                 master_addr: str = "127.0.0.1", master_port: int = 0, tokenizer: Any = None):
        self.config = VerlConfig.model_validate(config)
        self.roles = set(roles)
        cfg = self.config
        set_num_threads(cfg.trainer.num_threads)
        seed_everything(cfg.trainer.seed)  # identical on every rank: replicas start identical
        self.device = pick_device(cfg.trainer.device)
        if self.device.type == "cuda" and torch.cuda.device_count() > 1:
            torch.cuda.set_device(rank % torch.cuda.device_count())
            self.device = torch.device("cuda", torch.cuda.current_device())
        trains = bool(self.roles & {"actor", "critic"})
        fsdp = cfg.actor.strategy == "fsdp"
        self.dist = DistInfo(rank, world_size, fsdp) if trains else DistInfo()
        if trains and (world_size > 1 or fsdp):
            init_process_group(rank, world_size, master_addr, master_port, self.device)
        self.tokenizer = tokenizer or load_tokenizer(cfg.model.tokenizer_path or cfg.model.path,
                                                     cfg.model.trust_remote_code)
        self.model = self.actor = self.rollout = self.reference = self.critic = self.reward = None
        if "actor" in self.roles:
            self._build_actor()
        if "ref" in self.roles:
            self._build_reference()
        if "critic" in self.roles:
            self._build_critic()
        if "reward" in self.roles:
            self.reward = RewardManager(self.tokenizer, cfg.reward, self.device)

    # ------------------------------------------------------------------ construction

    def _build_actor(self) -> None:
        cfg = self.config
        model = load_causal_lm(cfg.model.path, cfg.model.dtype, self.device, cfg.model.trust_remote_code)
        if cfg.model.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if cfg.model.lora.rank > 0:
            model = apply_lora(model, cfg.model.lora)
        if self.dist.fsdp:
            model = apply_fsdp(model, self.dist, self.device, offload=cfg.actor.fsdp_offload)
        model.train()
        self.model = model
        self.actor = Actor(model, cfg.actor, cfg.trainer.total_steps, cfg.rollout.temperature,
                           cfg.data.max_response_length, group_size=cfg.rollout.n, dist_info=self.dist,
                           seed=cfg.trainer.seed, remove_padding=cfg.model.use_remove_padding and not self.dist.fsdp,
                           rollout_correction=cfg.algorithm.rollout_correction)
        # rollout.dtype: the engine computes in its own dtype (a bf16 rollout against an fp32 trainer); None: the
        # trainer's (actor.autocast).
        autocast = torch.bfloat16 if cfg.actor.autocast == "bf16" else None
        if cfg.rollout.dtype is not None:
            autocast = torch.bfloat16 if cfg.rollout.dtype == "bfloat16" else None
        # Sharded models run collectives in every forward: ranks must agree on when decoding stops.
        stop_when = (lambda done: all_ranks(done, self.dist)) if self.dist.fsdp else None
        spec = EngineSpec(model, cfg.model.path, self.tokenizer, cfg.rollout, cfg.data.max_prompt_length +
                          cfg.data.max_response_length, cfg.trainer.seed, cfg.rollout.micro_batch_size,
                          cfg.rollout.max_num_seqs, autocast, stop_when)
        if cfg.rollout.gateway.enabled:  # the user's agent against the served policy (serve/gateway_rollout.py)
            self.rollout = GATEWAY_ENGINES["serve"].build(spec)
            return
        self.rollout = build_rollout(cfg.rollout.name, spec)
        if cfg.rollout.multi_turn.enable:  # tool-calling trajectories on the same engine (agent_loop.py)
            self.rollout = AgentRollout(self.rollout, cfg.rollout.multi_turn, cfg.data.max_response_length)

    def _build_reference(self) -> None:
        cfg = self.config
        autocast = torch.bfloat16 if cfg.actor.autocast == "bf16" else None
        shared = self.model is not None and is_lora(self.model)  # LoRA: the policy with its adapters off
        if shared:
            model = self.model
        else:
            device = torch.device("cpu") if cfg.reference.offload_to_cpu else self.device
            model = load_causal_lm(cfg.model.path, cfg.model.dtype, device, cfg.model.trust_remote_code)
        self.reference = Reference(model, cfg.rollout.temperature, cfg.actor.ppo_micro_batch_size,
                                   adapters_disabled=shared, autocast_dtype=autocast, group_size=cfg.rollout.n,
                                   remove_padding=cfg.model.use_remove_padding and not self.dist.fsdp)

    def _build_critic(self) -> None:
        cfg = self.config
        model = load_critic_model(cfg.critic.model_path or cfg.model.path, cfg.model.dtype, self.device)
        if self.dist.fsdp:
            model = apply_fsdp(model, self.dist, self.device, offload=cfg.actor.fsdp_offload)
        self.critic = Critic(model, cfg.critic, cfg.actor.ppo_epochs, cfg.actor.ppo_micro_batch_size,
                             cfg.trainer.total_steps, dist_info=self.dist, seed=cfg.trainer.seed)

    # ------------------------------------------------------------------ role operations

    def ping(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "roles": sorted(self.roles), "rank": self.dist.rank,
                "world_size": self.dist.world_size, "device": str(self.device), "threads": torch.get_num_threads()}

    def generate(self, prompts: DataProto, params: SamplingParams) -> DataProto:
        return self.rollout.generate(prompts, params)

    def compute_old_log_prob(self, data: DataProto) -> torch.Tensor:
        return self.actor.compute_log_prob(data)

    def compute_ref_log_prob(self, data: DataProto) -> torch.Tensor:
        return self.reference.compute_ref_log_prob(data)

    def compute_values(self, data: DataProto) -> torch.Tensor:
        return self.critic.compute_values(data)

    def compute_kl_terms(self, data: DataProto) -> dict[str, torch.Tensor]:
        """Exact per-token KL of the actor from the reference along ``data``'s responses (the ``kl`` evaluator's
        inputs, at temperature 1 as ``verl eval`` computes them); each field ``(batch, response_len)``."""
        return compute_kl_terms(self.model, self.reference.model, data, self.config.actor.ppo_micro_batch_size or 32,
                                reference_context=self.reference.weights)

    def compute_reward(self, data: DataProto):
        return self.reward.compute(data)

    def update_actor(self, data: DataProto, mini_batch_size: int) -> dict[str, float]:
        metrics = self.actor.update_policy(TrainBatch.from_proto(data), mini_batch_size)
        self.rollout.sync_weights(self.model)
        return metrics

    def update_critic(self, data: DataProto, mini_batch_size: int) -> dict[str, float]:
        return self.critic.update(TrainBatch.from_proto(data), mini_batch_size)

    def validation_engine(self) -> Any:
        """The engine validation generates with: the actor's rollout (it shares the actor's weights)."""
        return self.rollout

    # ------------------------------------------------------------------ one-step off-policy (verl.trainer.overlap)

    def trainable_weights(self) -> dict[str, torch.Tensor]:
        """The parameters the update changes (LoRA: only the adapters), by name, on CPU: what the rollout worker
        needs to generate with this policy."""
        if self.dist.fsdp:
            raise ValueError("trainer.one_step_off_policy needs full (not FSDP-sharded) actor weights")
        return {name: p.detach().cpu() for name, p in self.model.named_parameters() if p.requires_grad}

    def load_policy_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy the trainer's ``trainable_weights`` into this worker's model (names must match: same model
        and LoRA config), then let the engine pick them up."""
        params = dict(self.model.named_parameters())
        missing = sorted(set(weights) - set(params))
        if missing:
            raise ValueError(f"the rollout worker's model has no parameters named {missing[:3]}")
        with torch.no_grad():
            for name, value in weights.items():
                params[name].copy_(value)
        self.rollout.sync_weights(self.model)

    def behaviour_rollout(self, prompts: DataProto, params: SamplingParams,
                          weights: dict[str, torch.Tensor] | None = None,
                          version: int | None = None) -> tuple[DataProto, int | None, dict[str, float]]:
        """The overlapped rollout's call: load ``weights`` (policy ``version``) unless that version is loaded,
        generate with the behaviour log-probs (``rollout_log_probs``), and add ``ref_log_prob`` when this worker
        holds the reference. Returns the batch, the version and the stage times (gen, ref, load_weights, ...)."""
        timer = StageTimer()
        if weights is not None and version != getattr(self, "_policy_version", None):
            with timer("load_weights"):
                self.load_policy_weights(weights)
                self._policy_version = version
        with timer("gen"):
            batch = self.generate(prompts, replace(params, logprobs=True))
        if "rollout_log_probs" not in batch.batch:  # an engine that gives no log-probs: one forward pass instead
            with timer("behaviour_log_prob"):
                batch.batch["rollout_log_probs"] = self.compute_old_log_prob(batch)
        elif self.config.trainer.split_mismatch:  # the trainer's numerics at the behaviour weights
            with timer("behaviour_forward"):
                batch.batch["behaviour_trainer_log_probs"] = self.compute_old_log_prob(batch)
        if self.reference is not None:
            with timer("ref"):
                batch.batch["ref_log_prob"] = self.compute_ref_log_prob(batch)
        return batch, version, timer.seconds

    # ------------------------------------------------------------------ checkpoints

    def save(self, directory: str | Path) -> None:
        """Write this worker's part of a checkpoint into ``directory`` (a temp dir the driver renames).

        Rank 0 writes the HF model (+ ``critic/``); optimizer states go to ``actor_state*.pt`` /
        ``critic_state.pt``. Under FSDP every rank takes part in gathering the full weights.
        """
        path = Path(directory)
        if self.actor is not None:
            weights = full_state_dict(self.model, self.dist)
            if self.dist.rank == 0:
                self.model.save_pretrained(path, state_dict=weights, safe_serialization=True)
                self.tokenizer.save_pretrained(path)
            if self.dist.rank == 0 or self.dist.fsdp:
                torch.save(self.actor.state_dict(), path / actor_state_file(self.dist.rank, self.dist.fsdp))
        if self.critic is not None:
            weights = full_state_dict(self.critic.model, self.dist)
            if self.dist.rank == 0:
                self.critic.model.save_pretrained(path / "critic", state_dict=weights, safe_serialization=True)
                torch.save(self.critic.state_dict(), path / CRITIC_STATE)

    def load(self, directory: str | Path) -> None:
        path = Path(directory)
        if self.actor is not None:
            if self.dist.fsdp:
                from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

                set_model_state_dict(self.model, read_model_weights(path),
                                     options=StateDictOptions(full_state_dict=True))
            else:
                load_model_weights(self.model, path)
            state_file = path / actor_state_file(self.dist.rank, self.dist.fsdp)
            self.actor.load_state_dict(torch.load(state_file, map_location="cpu", weights_only=False))
            self.rollout.sync_weights(self.model)
        if self.critic is not None:
            load_model_weights(self.critic.model, path / "critic")
            self.critic.load_state_dict(torch.load(path / CRITIC_STATE, map_location="cpu", weights_only=False))

    def shutdown(self) -> None:
        if self.rollout is not None:
            self.rollout.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()

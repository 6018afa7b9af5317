"""The actor role: log-probs of rollouts and the PPO policy update (mini-batches, micro-batches, clipping).

The update reads a ``verl.batch.TrainBatch`` (all ``(batch, response_len)`` unless noted): ``responses``,
``response_mask``, ``advantages``, ``old_log_probs`` (whose: ``anchor``, see below), ``ref_log_prob`` (when a KL loss
is used), and the sequence fields ``input_ids``/``attention_mask``/``position_ids`` ``(batch, seq_len)``.

An ``Anchor.CURRENT`` batch is on-policy (one epoch, one mini-batch): the rollout policy *is* the current policy,
so the old log-probs equal the current ones detached and the extra forward pass that would compute them is skipped.

When the batch carries the engine's own log-probs (``rollout_log_probs``), the first epoch's forwards measure how far
the trainer's log-probs of the same tokens are from them (``rollout_corr/*``, ``training/rollout_probs_diff_*``,
``sampling/*``; verl/algos/rollout_correction.py): on-policy, at the very weights that sampled them, that is the
engine's numerics alone; in bypass or one-step off-policy mode it includes the policy lag. Optional:
``rollout_is_weights`` (decoupled rollout correction, multiplied into the per-token loss), and in bypass mode with
``loss_type: reinforce`` the weights pi_theta / pi_rollout of each micro-batch (no clipping).
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict

import numpy as np
import torch

from verl.algos.kl import kl_penalty
from verl.algos.losses import agg_loss, get_policy_loss, global_agg_denominators
from verl.algos.masked import masked_mean
from verl.algos.rollout_correction import MismatchStats, rejection_mask
from verl.batch import Anchor, TrainBatch
from verl.config import ActorConfig, RolloutCorrectionConfig
from verl.models.packed_linear import packed_weights
from verl.protocol import DataProto
from verl.workers.dist import (
    DistInfo,
    all_reduce_gradients,
    all_reduce_maxima,
    all_reduce_sums,
    grad_norm_value,
    local_shard,
)
from verl.workers.forward import response_log_probs
from verl.workers.optim import build_optimizer, build_scheduler

MODEL_KEYS = ("input_ids", "attention_mask", "position_ids", "responses", "prompts")


def group_shuffle(size: int, group_size: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """A random order of ``size`` rows that keeps each run of ``group_size`` rows (one prompt's responses)
    together, so mini-batches stay grouped and the shared-prefix forward applies."""
    if group_size <= 1 or size % group_size:
        return torch.randperm(size, generator=generator)
    groups = torch.randperm(size // group_size, generator=generator)
    return (groups.unsqueeze(1) * group_size + torch.arange(group_size)).reshape(-1)


def micro_batches(data: DataProto | TrainBatch, size: int | None) -> list[DataProto | TrainBatch]:
    return data.split(size) if size else [data]


class Actor:
    def __init__(self, model: torch.nn.Module, config: ActorConfig, total_steps: int, temperature: float,
                 max_response_length: int, group_size: int = 1, dist_info: DistInfo | None = None, seed: int = 0,
                 remove_padding: bool = False, rollout_correction: RolloutCorrectionConfig | None = None):
        self.model = model
        self.rollout_correction = rollout_correction or RolloutCorrectionConfig()
        self.dist = dist_info or DistInfo()
        # Mini-batch order comes from a private generator seeded alike on every rank, so data-parallel
        # ranks agree on the order without communicating (and resume restores it from the checkpoint).
        self.shuffle_generator = torch.Generator().manual_seed(seed)
        self.group_size = group_size  # responses per prompt, adjacent: enables the shared-prefix forward
        # Packed sequences (verl/models/packed_sequences.py); not under FSDP, whose ranks must run alike forwards.
        self.remove_padding = remove_padding and not self.dist.fsdp
        self.config = config
        self.temperature = temperature
        self.max_response_length = max_response_length
        self.policy_loss_fn = get_policy_loss(config.policy_loss)
        correction = self.rollout_correction
        if correction.bypass_mode and correction.loss_type == "reinforce":  # verl's bypass loss, as a policy loss
            self.policy_loss_fn = functools.partial(get_policy_loss("bypass_mode"), rollout_is=correction.rollout_is,
                                                    rollout_is_threshold=correction.rollout_is_threshold,
                                                    rollout_is_batch_normalize=correction.rollout_is_batch_normalize)
        self.autocast_dtype = torch.bfloat16 if config.autocast == "bf16" else None
        self.optimizer = build_optimizer(model.parameters(), config.optim)
        # The schedule counts training steps (one scheduler.step() per update_policy), not optimizer steps.
        self.scheduler = build_scheduler(self.optimizer, config.optim, total_steps)
        self.device = next(model.parameters()).device
        self.nan_skipped = 0

    @torch.no_grad()
    @packed_weights(gradients=True)  # frozen layers (LoRA's base) by packed weights; trainable ones stay F.linear
    def compute_log_prob(self, data: DataProto, micro_batch_size: int | None = None) -> torch.Tensor:
        """Log-probs of the responses under the current policy, ``(batch, response_len)``."""
        self.model.eval()
        parts = []
        for micro in micro_batches(data, micro_batch_size or self.config.ppo_micro_batch_size):
            batch = {k: micro.batch[k].to(self.device) for k in MODEL_KEYS}
            log_probs, _ = response_log_probs(self.model, batch, self.temperature, autocast_dtype=self.autocast_dtype,
                                              group_size=1 if self.dist.fsdp else self.group_size,
                                              remove_padding=self.remove_padding)
            parts.append(log_probs.cpu())
        self.model.train()
        return torch.cat(parts)

    @packed_weights(gradients=True)  # the frozen base's products forward and backward (packed_linear.py)
    def update_policy(self, data: TrainBatch, mini_batch_size: int) -> dict[str, float]:
        """PPO epochs over shuffled mini-batches of ``mini_batch_size`` responses; returns mean metrics."""
        cfg = self.config
        self.model.train()
        on_policy = data.anchor is Anchor.CURRENT
        if on_policy and (cfg.ppo_epochs > 1 or mini_batch_size < len(data)):
            raise ValueError("old_log_probs are required for more than one PPO epoch or mini-batch")
        metrics: dict[str, list[float]] = defaultdict(list)
        # The mismatch, measured on the first epoch's forwards (each micro-batch before its own optimizer step).
        self.mismatch = MismatchStats() if data.rollout_log_probs is not None else None
        # trainer.split_mismatch: the policy lag alone, the trainer now against the trainer at the behaviour weights.
        self.lag = MismatchStats() if data.behaviour_trainer_log_probs is not None else None
        for epoch in range(cfg.ppo_epochs):
            shuffle = len(data) > mini_batch_size
            order = (group_shuffle(len(data), self.group_size, self.shuffle_generator) if shuffle
                     else torch.arange(len(data)))
            for start in range(0, len(data), mini_batch_size):
                mini = data.index(order[start : start + mini_batch_size])
                self._update_mini_batch(mini, on_policy, metrics, measure=epoch == 0)
        self.scheduler.step()
        out = {k: float(np.mean(v)) for k, v in metrics.items()}
        if self.mismatch is not None:
            self.mismatch.sums = all_reduce_sums(self.mismatch.sums, self.dist)
            self.mismatch.maxima = all_reduce_maxima(self.mismatch.maxima, self.dist)
            out.update(self.mismatch.metrics())
        if self.lag is not None:
            self.lag.sums = all_reduce_sums(self.lag.sums, self.dist)
            self.lag.maxima = all_reduce_maxima(self.lag.maxima, self.dist)
            out.update({k.replace("rollout_corr/", "rollout_corr/lag_"): v for k, v in self.lag.metrics().items()
                        if k.startswith("rollout_corr/")})
        out["lr"] = self.scheduler.get_last_lr()[0]
        out["nan_skipped_total"] = float(self.nan_skipped)
        return out

    def _update_mini_batch(self, mini: TrainBatch, on_policy: bool, metrics: dict[str, list[float]],
                           measure: bool = False) -> None:
        cfg = self.config
        mask_all = mini.response_mask
        agg_kwargs = global_agg_denominators(mask_all, self.max_response_length)
        need_entropy_grad = cfg.entropy_coeff != 0.0
        # Loss terms are exact partial sums over micro-batches (and ranks: counts above are global);
        # mean-type metrics are token-weighted by the same global counts.
        sums: dict[str, float] = defaultdict(float)
        group = 1 if self.dist.fsdp else self.group_size  # sharded forwards must match across ranks: plain path
        self.optimizer.zero_grad(set_to_none=True)
        for micro in micro_batches(local_shard(mini, self.dist), cfg.ppo_micro_batch_size):
            micro = micro.to(self.device)
            mask = micro.response_mask.float()
            weight = float(mask.sum()) / agg_kwargs["num_tokens"]
            log_prob, entropy = response_log_probs(self.model, micro.tensors(MODEL_KEYS), self.temperature,
                                                   with_entropy=True, autocast_dtype=self.autocast_dtype,
                                                   group_size=group, entropy_grad=need_entropy_grad,
                                                   remove_padding=self.remove_padding)
            old_log_prob = log_prob.detach() if on_policy else micro.old_log_probs
            rollout_log_prob = micro.rollout_log_probs
            if measure and self.mismatch is not None:
                self.mismatch.add(log_prob.detach(), rollout_log_prob, mask)
            if measure and self.lag is not None:
                self.lag.add(log_prob.detach(), micro.behaviour_trainer_log_probs, mask)
            correction = self.rollout_correction
            if correction.bypass_mode and correction.rollout_rs is not None:
                mask = self._bypass_rejection(log_prob, rollout_log_prob, mask, sums, weight)
            # By keyword: verl's ported losses take (old_log_prob, log_prob); a positional call would invert the ratio.
            # In bypass mode old_log_prob is the rollout engine's.
            pg_loss, pg_metrics = self.policy_loss_fn(
                log_prob=log_prob, old_log_prob=old_log_prob, advantages=micro.advantages, mask=mask,
                clip_low=cfg.clip_low, clip_high=cfg.clip_high, clip_c=cfg.clip_ratio_c,
                loss_agg_mode=cfg.loss_agg_mode, rollout_is_weights=micro.rollout_is_weights, **agg_kwargs,
            )
            loss = pg_loss
            if need_entropy_grad:
                loss = loss - cfg.entropy_coeff * agg_loss(entropy, mask, cfg.loss_agg_mode, **agg_kwargs)
            if cfg.use_kl_loss:
                kl = kl_penalty(log_prob, micro.ref_log_prob, cfg.kl_loss_type)
                kl_loss = agg_loss(kl, mask, cfg.loss_agg_mode, **agg_kwargs)
                loss = loss + cfg.kl_loss_coef * kl_loss
                sums["kl_loss"] += kl_loss.item()
            if micro.ref_log_prob is not None:
                sums["kl_div"] += weight * masked_mean(kl_penalty(log_prob.detach(), micro.ref_log_prob, "k3"),
                                                       mask).item()
            (loss * self.dist.loss_scale).backward()
            sums["policy_loss"] += pg_loss.item()
            sums["entropy"] += weight * masked_mean(entropy.detach(), mask).item()
            for key, value in pg_metrics.items():
                sums[key] += weight * value.item()
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        all_reduce_gradients(trainable, self.dist)
        for key, value in all_reduce_sums(dict(sums), self.dist).items():
            metrics[key].append(value)
        grad_norm = grad_norm_value(torch.nn.utils.clip_grad_norm_(trainable, cfg.optim.grad_clip))
        if not math.isfinite(grad_norm):
            # A NaN/Inf gradient would poison the weights: skip this optimizer step and count it.
            self.optimizer.zero_grad(set_to_none=True)
            self.nan_skipped += 1
            metrics["nan_skipped"].append(1.0)
        else:
            self.optimizer.step()
            metrics["nan_skipped"].append(0.0)
        metrics["grad_norm"].append(float(grad_norm))

    def _bypass_rejection(self, log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor,
                          sums: dict[str, float], weight: float) -> torch.Tensor:
        """Bypass-mode rejection (verl's bypass_pg_geo_rs & co.): the micro-batch's mask ``(rows, response_len)``
        with the tokens or sequences whose pi_theta / pi_rollout (detached) breaks a bound set to 0. Every option is
        per token or per sequence, so a micro-batch holds what it needs and no extra forward runs; the mini-batch's
        token count stays the loss denominator (computed before any forward, as verl normalises)."""
        correction = self.rollout_correction
        kept, found = rejection_mask(log_prob.detach() - rollout_log_prob, mask, correction.rollout_rs,
                                     correction.rollout_rs_threshold)
        for key, value in found.items():
            sums[f"rollout_corr/{key}"] += weight * value
        return kept

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "nan_skipped": self.nan_skipped, "shuffle_generator": self.shuffle_generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.nan_skipped = int(state.get("nan_skipped", 0))
        if "shuffle_generator" in state:
            self.shuffle_generator.set_state(state["shuffle_generator"])

"""The stages of a training step between the rollout and the update (``PPOTrainer.train_step``), each a function
of the typed batch (``verl.batch.TrainBatch``) and the config section it reads.

A stage sets the fields it computes on the batch and returns it, with its ``scope/name`` metrics where it has any.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from verl.algos.advantages import AdvantageFn, estimator_facts
from verl.algos.kl import kl_penalty
from verl.algos.masked import masked_mean
from verl.algos.rollout_correction import correct, mismatch_metrics
from verl.batch import Anchor, TrainBatch
from verl.config import AlgorithmConfig, RewardConfig, RolloutCorrectionConfig
from verl.errors import ConfigError
from verl.trainer.missing_rewards import Dropped, mask_missing_rewards


def varied_group_rows(group: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Row indices of the groups (ids ``group``, ``(batch,)``, rows adjacent) whose samples differ in ``values``
    ``(batch,)``, or that hold a single sample — DAPO's filter, as verl keeps them."""
    keep = [np.flatnonzero(group == u) for u in dict.fromkeys(group.tolist())]
    return np.concatenate([rows for rows in keep if len(rows) == 1 or np.ptp(values[rows]) > 0] or [np.arange(0)])


def filter_values(extras: dict[str, np.ndarray], scores: torch.Tensor, metric: str | None) -> np.ndarray:
    """``algorithm.filter_groups.metric`` of each sample, ``(batch,)``: the rule's correctness (``acc`` of the
    reward's ``extras``, the default where the reward gives it) or the sequence reward (``scores``, token-level)."""
    if metric in (None, "acc") and "acc" in extras:
        return np.asarray(extras["acc"], dtype=np.float64)
    if metric == "acc":
        raise ConfigError("algorithm.filter_groups.metric=acc: this reward gives no acc; use score")
    return scores.sum(-1).double().numpy()


def mask_missing(batch: TrainBatch, reward: RewardConfig, estimator: str) -> tuple[TrainBatch, Dropped]:
    """Samples without a reward masked out of the step, with their groups for group estimators
    (``verl.trainer.missing_rewards``); a ReMax baseline that is missing counts as its group's reward missing."""
    scores = batch.token_level_scores
    if batch.reward_baselines is not None and bool(batch.reward_baselines.isnan().any()):
        scores = scores.clone()
        scores[batch.reward_baselines.isnan()] = float("nan")
    model = reward.model
    source = f"{'judge' if model.kind == 'judge' else 'reward model'} {model.url or model.path}"
    batch.token_level_scores, batch.response_mask, dropped = mask_missing_rewards(
        scores, batch.response_mask, batch.group, estimator_facts(estimator).needs_groups, model.max_failed_share,
        source)
    return batch, dropped


def correct_rollout(batch: TrainBatch, rc: RolloutCorrectionConfig, engine: str, trainer_old: bool
                    ) -> tuple[TrainBatch, dict[str, float]]:
    """The rollout/trainer mismatch where the batch's old log-probs came from the trainer's own forward (measured
    here, exactly, at the weights that sampled; the actor measures it otherwise), and verl's rollout correction:
    decoupled mode adds ``rollout_is_weights`` and the rejection's ``update_mask``; bypass mode anchors the ratio on
    the rollout's log-probs."""
    rollout = batch.rollout_log_probs
    if rollout is None:
        if rc.corrects:
            raise ConfigError(f"algorithm.rollout_correction needs the engine's log-probs, and rollout.name={engine} "
                              "gave none for this batch: turn the correction off for this engine")
        return batch, {}
    split: dict[str, float] = {}
    if batch.behaviour_trainer_log_probs is not None:  # trainer.split_mismatch: the engine's part alone
        engine_part = mismatch_metrics(batch.behaviour_trainer_log_probs, rollout, batch.response_mask)
        split = {k.replace("rollout_corr/", "rollout_corr/engine_"): v for k, v in engine_part.items()
                 if k.startswith("rollout_corr/")}
    if rc.bypass_mode:
        batch.anchor, batch.old_log_probs = Anchor.ROLLOUT, rollout
        return batch, split
    if not trainer_old:
        return batch, split  # on-policy, or anchored on the behaviour's log-probs: the actor's forwards measure it
    metrics = mismatch_metrics(batch.old_log_probs, rollout, batch.response_mask)
    weights, kept, found = correct(batch.old_log_probs, rollout, batch.response_mask, rc.rollout_is,
                                   rc.rollout_is_threshold, rc.rollout_is_batch_normalize, rc.rollout_rs,
                                   rc.rollout_rs_threshold)
    batch.rollout_is_weights = weights
    if rc.rollout_rs is not None:
        batch.update_mask = kept
    batch.rollout_log_probs = None  # measured: the actor need not measure it again
    return batch, {**metrics, **found, **split}


def kl_in_reward(batch: TrainBatch, algorithm: AlgorithmConfig, kl_ctrl: Any) -> tuple[TrainBatch, dict[str, float]]:
    """``token_level_rewards``: the scores, less beta x KL(old || ref) per token with ``algorithm.use_kl_in_reward``
    (beta from the KL controller, which this step's KL updates)."""
    scores = batch.token_level_scores
    if not algorithm.use_kl_in_reward:
        batch.token_level_rewards = scores
        return batch, {}
    mask = batch.response_mask.float()
    kl = kl_penalty(batch.old_log_probs, batch.ref_log_prob, algorithm.kl_penalty) * mask
    beta = kl_ctrl.value
    batch.token_level_rewards = scores - beta * kl
    current_kl = float(masked_mean(kl, mask, dim=-1).mean())
    kl_ctrl.update(current_kl, n_steps=len(batch))
    return batch, {"reward_kl_penalty": current_kl, "kl_coef": beta}


def compute_advantages(batch: TrainBatch, algorithm: AlgorithmConfig, adv_fn: AdvantageFn) -> TrainBatch:
    """``advantages`` and ``returns`` from the registered estimator (``verl.algos.advantages``)."""
    batch.advantages, batch.returns = adv_fn(
        token_level_rewards=batch.token_level_rewards, response_mask=batch.response_mask.float(),
        values=batch.values, index=batch.group, reward_baselines=batch.reward_baselines,
        gamma=algorithm.gamma, lam=algorithm.lam, norm_adv_by_std_in_grpo=algorithm.norm_adv_by_std_in_grpo,
    )
    return batch


def apply_update_mask(batch: TrainBatch) -> TrainBatch:
    """Tokens rollout correction rejected leave the update (after the rewards and the groups were computed)."""
    if batch.update_mask is not None:
        batch.response_mask, batch.update_mask = batch.update_mask, None
    return batch

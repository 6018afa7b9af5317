"""Advantage estimators: pure functions of tensors, registered by name.

Every estimator takes keyword arguments and returns ``(advantages, returns)``, both ``(batch, response_len)``
and zero outside ``response_mask``:

- ``token_level_rewards`` (batch, response_len): per-token rewards (scores at the last token, minus any KL).
- ``response_mask``       (batch, response_len): 1 on generated tokens.
- ``index``               (batch,): group id per response (responses to the same prompt share one).
- ``values``              (batch, response_len): critic values (``gae`` only).
- ``reward_baselines``    (batch,): reward of the greedy response to the same prompt (``remax`` only).

Estimators ignore arguments they do not use, so the trainer passes what it has.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from verl.algos.masked import masked_whiten
from verl.registry import Registry

AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
ADV_ESTIMATORS: Registry[AdvantageFn] = Registry("advantage estimator", key="algorithm.adv_estimator")


@dataclass(frozen=True)
class EstimatorFacts:
    """What an estimator needs from the rest of the step; config validation and the trainer read these instead of
    lists of names, so a newly registered estimator gets the same checks."""

    needs_critic: bool = False  # values from a critic (the trainer builds and trains one)
    needs_groups: bool = False  # several responses per prompt (rollout.n >= 2): it compares within a group
    needs_greedy_baseline: bool = False  # the reward of a greedy response per prompt (one extra rollout)


ESTIMATOR_FACTS: Registry[EstimatorFacts] = Registry("advantage estimator's facts")


def register_adv_est(name: str, *, needs_critic: bool = False, needs_groups: bool = False,
                     needs_greedy_baseline: bool = False) -> Callable[[AdvantageFn], AdvantageFn]:
    """Register ``fn`` under ``name`` with its facts (another function under a taken name raises)."""
    facts = EstimatorFacts(needs_critic, needs_groups, needs_greedy_baseline)

    def decorator(fn: AdvantageFn) -> AdvantageFn:
        ADV_ESTIMATORS.register(name, fn)
        ESTIMATOR_FACTS.register(name, facts)
        return fn

    return decorator


def estimator_facts(name: str) -> EstimatorFacts:
    get_adv_estimator(name)  # the unknown-name error
    return ESTIMATOR_FACTS[name]


def get_adv_estimator(name: str) -> AdvantageFn:
    return ADV_ESTIMATORS[name]


def _groups(index: Sequence) -> dict[object, list[int]]:
    groups: dict[object, list[int]] = defaultdict(list)
    for i, key in enumerate(index):
        groups[key].append(i)
    return groups


def per_group(index: Sequence, statistic: Callable[[list[int]], torch.Tensor | float],
              fill: torch.Tensor) -> torch.Tensor:
    """``(batch,)``: ``statistic(members)`` for the rows of every group of two or more (``members``: their row
    numbers; a scalar for the whole group or one value per member), ``fill`` for rows alone in their group."""
    out = fill.clone()
    for members in _groups(index).values():
        if len(members) > 1:
            out[members] = statistic(members)
    return out


def outcome_advantages(scores: torch.Tensor, response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence-level advantage ``(batch,)`` broadcast over each response's tokens, as advantages and returns."""
    advantages = scores.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est("gae", needs_critic=True)
def gae(token_level_rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 1.0, **_) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016); advantages whitened over valid tokens.

    delta_t = r_t + gamma * V_{t+1} - V_t (V after the last valid token is 0);
    A_t = delta_t + gamma * lam * A_{t+1}; returns = A + V (before whitening).
    """
    with torch.no_grad():
        values = values * response_mask
        rewards = token_level_rewards * response_mask
        length = rewards.shape[-1]
        next_advantage = torch.zeros_like(rewards[:, 0])
        next_value = torch.zeros_like(rewards[:, 0])
        reversed_adv = []
        for t in reversed(range(length)):
            mask_t = response_mask[:, t]
            delta = rewards[:, t] + gamma * next_value - values[:, t]
            advantage = delta + gamma * lam * next_advantage
            # Padding positions carry the next valid values through unchanged.
            next_advantage = torch.where(mask_t.bool(), advantage, next_advantage)
            next_value = torch.where(mask_t.bool(), values[:, t], next_value)
            reversed_adv.append(advantage * mask_t)
        advantages = torch.stack(reversed_adv[::-1], dim=1)
        returns = (advantages + values) * response_mask
        advantages = masked_whiten(advantages, response_mask) * response_mask
    return advantages, returns


@register_adv_est("grpo", needs_groups=True)
def grpo(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Sequence,
         norm_adv_by_std_in_grpo: bool = True, epsilon: float = 1e-6, **_) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage: (score - group mean) / (group std + eps), broadcast over the response.

    ``norm_adv_by_std_in_grpo=False`` gives Dr.GRPO (no std division). A group of one has mean 0 and std 1.
    The std is the Bessel-corrected sample std, as ``torch.std``.
    """
    with torch.no_grad():
        scores = token_level_rewards.sum(-1)
        mean = per_group(index, lambda m: scores[m].mean(), torch.zeros_like(scores))
        centred = scores - mean
        if norm_adv_by_std_in_grpo:
            centred = centred / (per_group(index, lambda m: scores[m].std(), torch.ones_like(scores)) + epsilon)
        return outcome_advantages(centred, response_mask)


@register_adv_est("rloo", needs_groups=True)
def rloo(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Sequence,
         **_) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE leave-one-out (Ahmadian et al. 2024): score minus the mean of the group's *other* scores."""
    with torch.no_grad():
        scores = token_level_rewards.sum(-1)
        baseline = per_group(index, lambda m: (scores[m].sum() - scores[m]) / (len(m) - 1), torch.zeros_like(scores))
        return outcome_advantages(scores - baseline, response_mask)


@register_adv_est("reinforce_plus_plus")
def reinforce_plus_plus(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0,
                        **_) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): discounted reward-to-go per token, whitened over the batch's valid tokens."""
    with torch.no_grad():
        returns = torch.zeros_like(token_level_rewards)
        running = torch.zeros_like(token_level_rewards[:, 0])
        for t in reversed(range(token_level_rewards.shape[1])):
            running = token_level_rewards[:, t] + gamma * running
            returns[:, t] = running
            running = running * response_mask[:, t]  # nothing flows back from padding
        returns = returns * response_mask
        advantages = masked_whiten(returns, response_mask) * response_mask
    return advantages, returns


@register_adv_est("reinforce_plus_plus_baseline", needs_groups=True)
def reinforce_plus_plus_baseline(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Sequence,
                                 **_) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group-mean baseline: (score - group mean), broadcast, then whitened over the batch."""
    with torch.no_grad():
        scores = token_level_rewards.sum(-1)
        mean = per_group(index, lambda m: scores[m].mean(), torch.zeros_like(scores))
        centred = (scores - mean).unsqueeze(-1) * response_mask
        advantages = masked_whiten(centred, response_mask) * response_mask
    return advantages, advantages


@register_adv_est("remax", needs_greedy_baseline=True)
def remax(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, reward_baselines: torch.Tensor,
          **_) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023): reward-to-go minus the reward of the greedy response to the same prompt."""
    with torch.no_grad():
        returns = (token_level_rewards * response_mask).flip(-1).cumsum(-1).flip(-1)
        advantages = (returns - reward_baselines.unsqueeze(-1)) * response_mask
    return advantages, returns


@register_adv_est("opo", needs_groups=True)
def opo(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Sequence,
        **_) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (Hao et al. 2025): baseline = length-weighted mean of the group's scores."""
    with torch.no_grad():
        scores = token_level_rewards.sum(-1)
        lengths = response_mask.sum(-1).to(scores.dtype)
        baseline = per_group(index, lambda m: (lengths[m] * scores[m]).sum() / lengths[m].sum().clamp(min=1e-8),
                             torch.zeros_like(scores))
        return outcome_advantages(scores - baseline, response_mask)

"""Metrics of one training step's rollout, computed before the update (health rules can act on them then)."""

from __future__ import annotations

import numpy as np
import torch

from verl.algos.masked import masked_mean
from verl.protocol import DataProto


def rollout_metrics(batch: DataProto, extras: dict[str, np.ndarray], max_response_length: int,
                    pad_token_id: int) -> dict[str, float]:
    """The ``rollout/*`` metrics (without the scope): rewards, lengths, advantages, reward extras, repetition."""
    scores = batch.batch["token_level_scores"].sum(-1)
    rewards = batch.batch["token_level_rewards"].sum(-1)
    mask = batch.batch["response_mask"]
    lengths = mask.sum(-1).float()
    rollout = {
        "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
        "score_mean": float(scores.mean()),
        "response_length_mean": float(lengths.mean()), "response_length_max": float(lengths.max()),
        "response_length_clip_ratio": float((lengths >= max_response_length).float().mean()),
        "prompt_length_mean": float(batch.batch["prompts"].ne(pad_token_id).sum(-1).float().mean()),
        "advantages_mean": float(masked_mean(batch.batch["advantages"], mask.float())),
        "num_responses": len(batch),
    }
    for key, value in extras.items():
        rollout[key] = float(np.nanmean(value))
    rollout["repetition_rate"] = ngram_repetition_rate(batch.batch["responses"], mask)  # loop collapse rule
    rollout.update(tool_metrics(batch))
    return rollout


def group_metrics(batch: DataProto, extras: dict[str, np.ndarray]) -> dict[str, float]:
    """The ``batch/*`` metrics of a step's groups (a prompt's samples, ``uid``): ``solve_all`` / ``solve_none``, the
    share of groups whose every sample the rule marks right / wrong (``acc``, when the reward gives it), and
    ``same_reward`` (groups whose samples all got one reward: a group-relative advantage of 0, nothing learnt)."""
    uid = np.asarray(batch.non_tensor["uid"])
    rewards = batch.batch["token_level_scores"].sum(-1).double().numpy()
    groups = [np.flatnonzero(uid == u) for u in dict.fromkeys(uid.tolist())]
    out = {"same_reward": float(np.mean([np.ptp(rewards[g]) == 0 for g in groups]))}
    acc = extras.get("acc")
    if acc is not None and len(acc) == len(uid):
        acc = np.asarray(acc, dtype=np.float64)
        out["solve_all"] = float(np.mean([bool(np.all(acc[g] == 1)) for g in groups]))
        out["solve_none"] = float(np.mean([bool(np.all(acc[g] == 0)) for g in groups]))
    return out


def tool_metrics(batch: DataProto) -> dict[str, float]:
    """Multi-turn rollouts (``agent_loop.py``): how often trajectories call tools, how many calls parse and fit a
    configured tool's schema, how many fail, turns per trajectory and its length with the tool turns."""
    non = batch.non_tensor
    if "num_tool_calls" not in non:
        return {}
    calls = np.asarray(non["num_tool_calls"], dtype=np.float64)
    width = batch.batch["responses"].shape[1]
    metrics = {
        "tool_call_rate": float((calls > 0).mean()),
        "tool_calls_mean": float(calls.mean()),
        "turns_mean": float(np.mean(np.asarray(non["num_turns"], dtype=np.float64))),
        "trajectory_length_mean": float(batch.batch["attention_mask"][:, -width:].sum(-1).float().mean()),
    }
    if calls.sum() > 0:  # shares of calls: not defined for a batch that made none
        metrics["valid_call_rate"] = float(np.sum(np.asarray(non["num_valid_calls"], dtype=np.float64)) / calls.sum())
        metrics["tool_error_rate"] = float(np.sum(np.asarray(non["num_tool_errors"], dtype=np.float64)) / calls.sum())
    return metrics


def ngram_repetition_rate(responses: torch.Tensor, mask: torch.Tensor, n: int = 4) -> float:
    """Mean over responses of seq-rep-n (Welleck et al. 2019) on token ids: 1 - unique n-grams / n-grams.

    ``responses`` and ``mask`` are ``(batch, response_len)``; only n-grams entirely inside the mask count, and a
    response with no complete n-gram counts as 0 (no repetition). Token ids rather than words make the rate
    language-independent. 0 for varied text; close to 1 for a response stuck in a loop.
    """
    if responses.dim() != 2 or responses.shape != mask.shape:
        raise ValueError(f"responses {tuple(responses.shape)} and mask {tuple(mask.shape)} must be equal 2-D shapes")
    batch, length = responses.shape
    if batch == 0 or length < n:
        return 0.0
    windows = responses.long().unfold(1, n, 1)  # (batch, length - n + 1, n)
    valid = mask.bool().unfold(1, n, 1).all(-1)  # (batch, length - n + 1)
    weights = torch.ones(n, dtype=torch.long)
    for k in range(1, n):
        weights[k] = weights[k - 1] * 1_000_003  # int64 wrap-around is fine for a hash
    hashes = (windows * weights).sum(-1)
    sentinel = torch.iinfo(torch.long).min
    hashes = torch.where(valid, hashes, torch.full_like(hashes, sentinel)).sort(-1).values
    distinct = 1 + (hashes[:, 1:] != hashes[:, :-1]).sum(-1)
    total = valid.sum(-1)
    distinct = distinct - (total < hashes.shape[1]).long()  # the sentinel group is not an n-gram
    rate = torch.where(total > 0, 1.0 - distinct.double() / total.clamp(min=1).double(), torch.zeros(batch).double())
    return float(rate.mean())

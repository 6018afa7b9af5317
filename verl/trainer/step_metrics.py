"""Metrics of one training step's rollout, computed before the update (health rules can act on them then)."""

from __future__ import annotations

import numpy as np
import torch

from verl.algos.masked import masked_mean
from verl.batch import TrainBatch
from verl.trainer.validation import sample_rows
from verl.utils import log

MISMATCH_SCOPES = ("rollout_corr/", "training/", "sampling/")  # verl/algos/rollout_correction.py
PPO_METRICS = {  # ppo/<name> <- the actor's update metric of that name
    "policy_loss": "policy_loss", "entropy": "entropy", "kl_div": "kl_div", "approx_kl": "ppo_kl",
    "clip_ratio": "clipfrac", "clip_ratio_lower": "clipfrac_lower", "kl_loss": "kl_loss", "grad_norm": "grad_norm",
    "lr": "lr", "nan_skipped": "nan_skipped",
}


def step_metrics(batch: TrainBatch, rollout: dict[str, float], actor: dict[str, float], critic: dict[str, float],
                 ppo: dict[str, float | None], timings: dict[str, float], train: dict[str, float],
                 system: dict[str, float]) -> dict[str, float]:
    """The step's ``scope/name`` metrics (docs/architecture.md §5): rollout, ppo (the actor's update metrics, then
    ``ppo``'s), critic, timing, throughput, train, system."""
    lengths = batch.response_mask.sum(-1).float()
    ppo = {**{name: actor.get(key) for name, key in PPO_METRICS.items()}, **ppo}
    tokens = int(batch.attention_mask.sum())
    throughput = {"tokens_per_second": tokens / max(timings.get("total", 1e-9), 1e-9),
                  "response_tokens_per_second": float(lengths.sum()) / max(timings.get("gen", 1e-9), 1e-9)}
    scopes = {"rollout": rollout, "ppo": {k: v for k, v in ppo.items() if v is not None}, "critic": critic,
              "timing": timings, "throughput": throughput, "train": train, "system": system}
    return {key: value for scope, fields in scopes.items() for key, value in log.scoped(scope, fields).items()}


def log_samples(logger: log.RunLogger, trackers: list, step: int, batch: TrainBatch, limit: int, n: int) -> None:
    """Sample rows (prompt, response, score; one per prompt, up to ``limit``) and the histograms of rewards, lengths
    and advantages."""
    mask = batch.response_mask
    for tracker in trackers:
        tracker.log_histograms({"rollout/rewards": batch.token_level_rewards.sum(-1).tolist(),
                                "rollout/response_lengths": mask.sum(-1).float().tolist(),
                                "rollout/advantages": batch.advantages[mask.bool()].tolist()}, step)
    samples = []
    for row in sample_rows(batch.rows, batch.texts, batch.token_level_scores.sum(-1), limit, n):
        logger.event("sample", step=step, split="train", **row)
        samples.append({**row, "split": "train"})
    if samples:
        for tracker in trackers:
            tracker.log_samples(samples, step)


def rollout_metrics(batch: TrainBatch, max_response_length: int, pad_token_id: int) -> dict[str, float]:
    """The ``rollout/*`` metrics (without the scope): rewards, lengths, advantages, reward extras, repetition."""
    scores = batch.token_level_scores.sum(-1)
    rewards = batch.token_level_rewards.sum(-1)
    mask = batch.response_mask
    lengths = mask.sum(-1).float()
    rollout = {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
               "score_mean": float(scores.mean()), "response_length_mean": float(lengths.mean()),
               "response_length_max": float(lengths.max()),
               "response_length_clip_ratio": float((lengths >= max_response_length).float().mean()),
               "prompt_length_mean": float(batch.prompts.ne(pad_token_id).sum(-1).float().mean()),
               "advantages_mean": float(masked_mean(batch.advantages, mask.float())), "num_responses": len(batch)}
    for key, value in batch.reward_extras.items():
        rollout[key] = float(np.nanmean(value))
    rollout["repetition_rate"] = ngram_repetition_rate(batch.responses, mask)  # loop collapse rule
    rollout.update(tool_metrics(batch))
    return rollout


def group_metrics(group: np.ndarray, rewards: np.ndarray, acc: np.ndarray | None) -> dict[str, float]:
    """The ``batch/*`` metrics of a step's groups (a prompt's samples: ids ``group``, ``(batch,)``): ``solve_all`` /
    ``solve_none``, the share of groups whose every sample the rule marks right / wrong (``acc``, when the reward
    gives it), and ``same_reward`` (groups whose samples all got one sequence reward, ``rewards``: a group-relative
    advantage of 0, nothing learnt)."""
    groups = [np.flatnonzero(group == u) for u in dict.fromkeys(group.tolist())]
    out = {"same_reward": float(np.mean([np.ptp(rewards[g]) == 0 for g in groups]))}
    if acc is not None and len(acc) == len(group):
        acc = np.asarray(acc, dtype=np.float64)
        out["solve_all"] = float(np.mean([bool(np.all(acc[g] == 1)) for g in groups]))
        out["solve_none"] = float(np.mean([bool(np.all(acc[g] == 0)) for g in groups]))
    return out


def batch_groups(batch: TrainBatch) -> dict[str, float]:
    """``group_metrics`` of a scored batch."""
    return group_metrics(batch.group, batch.token_level_scores.sum(-1).double().numpy(), batch.reward_extras.get("acc"))


def tool_metrics(batch: TrainBatch) -> dict[str, float]:
    """Multi-turn rollouts (``agent_loop.py``): how often trajectories call tools, how many calls parse and fit a
    configured tool's schema, how many fail, turns per trajectory and its length with the tool turns."""
    if batch.turns is None:
        return {}
    calls = batch.turns.tool_calls.astype(np.float64)
    width = batch.responses.shape[1]
    metrics = {"tool_call_rate": float((calls > 0).mean()), "tool_calls_mean": float(calls.mean()),
               "turns_mean": float(np.mean(batch.turns.turns.astype(np.float64))),
               "trajectory_length_mean": float(batch.attention_mask[:, -width:].sum(-1).float().mean())}
    if calls.sum() > 0:  # shares of calls: not defined for a batch that made none
        metrics["valid_call_rate"] = float(np.sum(batch.turns.valid_calls.astype(np.float64)) / calls.sum())
        metrics["tool_error_rate"] = float(np.sum(batch.turns.tool_errors.astype(np.float64)) / calls.sum())
    metrics.update(environment_metrics(batch))
    # A gateway rollout's counts (serve/gateway_rollout.py): calls, failed episodes, rewritten and re-rendered calls.
    metrics.update({f"gateway/{name}": value for name, value in batch.meta.get("gateway", {}).items()})
    return metrics


def environment_metrics(batch: TrainBatch) -> dict[str, float]:
    """Per environment (``env/<name>/...``): its reward (sum over turns), turns, trajectory length (tool turns
    and replies included), failed share and the seconds a start or reply took (mean over them)."""
    names = batch.turns.env
    out: dict[str, float] = {}
    for name in sorted({n for n in names if n is not None}):
        rows = np.flatnonzero(names == name)
        failed = np.array([batch.turns.env_error[i] is not None for i in rows])
        rewards = [sum(r for _, r in batch.turns.turn_rewards[i]) for i in rows[~failed]]
        out[f"env/{name}/error_rate"] = float(failed.mean())
        out[f"env/{name}/turns_mean"] = float(batch.turns.turns[rows].astype(np.float64).mean())
        width = batch.responses.shape[1]
        out[f"env/{name}/length_mean"] = float(batch.attention_mask[rows, -width:].sum(-1).float().mean())
        steps = int(batch.turns.env_steps[rows].sum())
        if steps:
            out[f"env/{name}/step_seconds_mean"] = float(batch.turns.env_seconds[rows].sum() / steps)
        if rewards:
            out[f"env/{name}/reward_mean"] = float(np.mean(rewards))
    return out


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

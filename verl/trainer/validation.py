"""Validation: generate on the validation prompts (greedy by default) and score with the run's reward.

The same function serves the PPO trainer and the SFT trainer, so ``eval/accuracy`` means the same thing in
both: the strict-format accuracy (``acc`` of the reward function), with ``accuracy_flexible`` beside it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from verl.data.dataset import RLHFDataset
from verl.protocol import DataProto
from verl.rollout.base import RolloutEngine, SamplingParams, pad_responses
from verl.workers.reward import RewardManager


def generate_and_score(
    engine: RolloutEngine,
    dataset: RLHFDataset,
    reward: RewardManager,
    params: SamplingParams,
    batch_size: int,
    max_samples: int | None = None,
) -> tuple[DataProto, np.ndarray, dict[str, np.ndarray], list[str]]:
    """Generate for the first ``max_samples`` prompts; return (batch, scores, extras, response texts)."""
    count = min(len(dataset), max_samples or len(dataset))
    outputs, scores, texts = [], [], []
    extras: dict[str, list[np.ndarray]] = {}
    for start in range(0, count, batch_size):
        prompts = dataset.collate(list(range(start, min(start + batch_size, count))))
        out = engine.generate(prompts, params)
        token_scores, ex, txt = reward.compute(out)
        outputs.append(out)
        scores.append(token_scores.sum(-1).numpy())
        texts.extend(txt)
        for key, value in ex.items():
            extras.setdefault(key, []).append(value)
    batch = DataProto.concat(pad_responses(outputs, dataset.tokenizer.pad_token_id))
    return batch, np.concatenate(scores), {k: np.concatenate(v) for k, v in extras.items()}, texts


def validation_metrics(
    batch: DataProto, scores: np.ndarray, extras: dict[str, np.ndarray]
) -> dict[str, float]:
    """``eval`` scope fields: accuracy (strict), accuracy_flexible, reward_mean, response length."""
    metrics: dict[str, float] = {"reward_mean": float(scores.mean()), "num_samples": float(len(scores))}
    acc = extras.get("acc")
    metrics["accuracy"] = float(np.nanmean(acc)) if acc is not None else float((scores > 0).mean())
    if "acc_flexible" in extras:
        metrics["accuracy_flexible"] = float(np.nanmean(extras["acc_flexible"]))
    lengths = batch.batch["response_mask"].sum(-1).float()
    metrics["response_length_mean"] = float(lengths.mean())
    return metrics


def sample_rows(batch: DataProto, texts: list[str], scores, limit: int, stride: int = 1) -> list[dict[str, Any]]:
    """Up to ``limit`` generations, every ``stride``-th, as ``sample`` rows (prompt, response, ground truth, score).

    With ``stride = n`` (a prompt's n responses are adjacent) the rows show different prompts.
    """
    rows = []
    for i in list(range(0, len(texts), stride))[:limit]:
        rows.append({
            "prompt": str(batch.non_tensor["raw_prompt"][i]),
            "response": texts[i],
            "ground_truth": str(batch.non_tensor["ground_truth"][i]),
            "score": float(scores[i]),
        })
    return rows

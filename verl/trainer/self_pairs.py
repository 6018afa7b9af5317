"""Preference pairs from a model's own samples on a rule-scored task: ``verl data pairs``.

For each prompt the model samples ``n`` answers; the task's rule reward marks each correct (its strict accuracy
``acc`` where the rule reports one, else a positive score) or not; a prompt with at least one correct and one
incorrect answer gives up to ``pairs_per_prompt`` pairs (a correct answer chosen over an incorrect one, each pair
distinct). A reward model trained on them is an **outcome reward model** for that model's own answers: it learns to
tell the answers the model actually gives apart, which is what it scores during RL. Prompts whose answers were all
correct or all wrong give no pair and are counted.

Rows keep the task's columns (``prompt``, ``data_source``, ``reward_model``, ``extra_info``) and add ``chosen`` and
``rejected`` (TRL's layout, as ``verl rm`` reads it), with the two answers' rule scores in ``extra_info``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from verl.config import DataConfig, RewardConfig
from verl.data.builtin import write_parquet
from verl.data.dataset import RLHFDataset
from verl.errors import DataError
from verl.models.loader import load_causal_lm, load_tokenizer, pick_device
from verl.rollout.base import SamplingParams
from verl.rollout.hf import HFRollout
from verl.utils.seeding import seed_everything
from verl.workers.reward import RewardManager


@dataclass
class PairStats:
    """What sampling gave: prompts, answers, the share correct, pairs, and prompts without a pair."""

    prompts: int = 0
    answers: int = 0
    correct: int = 0
    pairs: int = 0
    all_correct: int = 0
    all_wrong: int = 0

    def line(self) -> str:
        share = self.correct / max(self.answers, 1)
        return (f"{self.prompts} prompts, {self.answers} answers ({share:.1%} correct): {self.pairs} pairs; "
                f"no pair from {self.all_correct} prompts all correct and {self.all_wrong} all wrong")


def _correct(scores: np.ndarray, extras: dict[str, np.ndarray]) -> np.ndarray:
    acc = extras.get("acc")
    return acc > 0.5 if acc is not None else scores > 0


def sample_pairs(model: str, data_files: list[str], n: int = 4, temperature: float = 1.0,
                 max_prompts: int | None = 1000, max_new_tokens: int = 16, max_prompt_length: int = 64,
                 pairs_per_prompt: int = 1, batch_size: int = 64, seed: int = 0,
                 device: str = "auto") -> tuple[list[dict], PairStats]:
    """Sample, score by rule and pair (see the module docstring); the rows and the counts."""
    if n < 2:
        raise DataError(f"--n {n}: a pair needs at least two answers per prompt; use --n 4 or more")
    seed_everything(seed)
    tokenizer = load_tokenizer(model)
    engine = HFRollout(load_causal_lm(model, "float32", pick_device(device)), tokenizer)
    dataset = RLHFDataset(data_files, tokenizer, DataConfig(max_prompt_length=max_prompt_length,
                                                            truncation="filter"), "--data")
    reward = RewardManager(tokenizer, RewardConfig())
    params = SamplingParams(n=n, temperature=temperature, max_new_tokens=max_new_tokens)
    rng = random.Random(seed)
    stats, out = PairStats(), []
    count = min(len(dataset), max_prompts or len(dataset))
    try:
        for start in range(0, count, batch_size):
            indices = list(range(start, min(start + batch_size, count)))
            batch = engine.generate(dataset.collate(indices), params)  # a prompt's n answers are adjacent
            token_scores, extras, texts = reward.compute(batch)
            scores = token_scores.sum(-1).numpy()
            correct = _correct(scores, extras)
            for k, index in enumerate(indices):
                span = range(k * n, (k + 1) * n)
                good = [i for i in span if correct[i]]
                bad = [i for i in span if not correct[i]]
                stats.prompts += 1
                stats.answers += n
                stats.correct += len(good)
                if not bad:
                    stats.all_correct += 1
                    continue
                if not good:
                    stats.all_wrong += 1
                    continue
                combos = [(g, b) for g in good for b in bad]
                for g, b in rng.sample(combos, min(pairs_per_prompt, len(combos))):
                    row = {k: v for k, v in dataset.rows[index].items() if not k.startswith("__")}
                    info = dict(row.get("extra_info") or {})
                    info.update(chosen_score=float(scores[g]), rejected_score=float(scores[b]), sampled_from=model)
                    out.append({**row, "chosen": texts[g], "rejected": texts[b], "extra_info": info})
                    stats.pairs += 1
    finally:
        engine.shutdown()
    return out, stats


def write_pairs(rows: list[dict], out_dir: Path, val_fraction: float, seed: int = 0) -> dict[str, Path]:
    """``train.parquet`` and ``val.parquet`` in ``out_dir``, split by prompt (a prompt's pairs stay together, so
    held-out accuracy is on prompts the reward model never saw)."""
    if not rows:
        raise DataError("no pairs: every prompt's answers were all correct or all wrong; sample more answers per "
                        "prompt (--n), at a higher --temperature, or from a weaker model")
    prompts = sorted({str(r["prompt"]) for r in rows})
    random.Random(seed).shuffle(prompts)
    held = set(prompts[: max(1, round(val_fraction * len(prompts)))]) if val_fraction > 0 else set()
    train = [r for r in rows if str(r["prompt"]) not in held]
    val = [r for r in rows if str(r["prompt"]) in held]
    if not train:
        raise DataError(f"--val-fraction {val_fraction} leaves no training pairs ({len(rows)} pairs in all)")
    written = {"train": write_parquet(train, out_dir / "train.parquet")}
    if val:
        written["val"] = write_parquet(val, out_dir / "val.parquet")
    return written

"""The reward role: rule functions, a user's function, or a reward model (in process, ``reward.model.path``, or
behind a URL, ``reward.model.url``), producing token-level scores.

Output of ``compute(batch)``: ``token_level_scores`` of shape ``(batch, response_len)``, zero except at each
response's last valid token, which holds the sequence score; plus per-sample extras (``acc``,
``acc_flexible`` ...) as numpy arrays for logging.

With a reward model the score is ``weight * rm + rule_weight * rule`` (``reward.model``; the rule term only where
every row has an answer), the reward model's own score is the extra ``rm_score``, and where rows have answers the
rule's extras (``acc``: the strict accuracy) are computed too, so the log shows the reward the policy is trained on
beside the accuracy a checker gives. A sample whose reward model score could not be obtained (a remote model that
timed out or answered garbage after its retries) scores NaN: missing, never 0 — the trainer masks it.
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, PreTrainedTokenizerBase

from verl.config import RewardConfig
from verl.errors import ConfigError, ModelError, VerlError
from verl.models.loader import resolve_model_path
from verl.models.sequence_scores import sequence_scores
from verl.protocol import DataProto
from verl.rewards.judge import PointwiseRubric, RemoteJudge, load_rubric
from verl.rewards.registry import get_reward_fn, load_custom_reward, reward_for_data_source
from verl.rewards.remote import RemoteRewardModel
from verl.rollout.recorded_episodes import episode_last_rows
from verl.sandbox.client import configure as configure_sandbox
from verl.utils import log


def response_lengths(batch: DataProto) -> torch.Tensor:
    """Response ids per row, ``(batch,)``: generated and (multi-turn) tool-turn ids, the response part of
    ``attention_mask`` (equal to ``response_mask``'s count for single-turn rollouts)."""
    width = batch.batch["responses"].shape[1]
    if width and "attention_mask" in batch.batch:
        return batch.batch["attention_mask"][:, -width:].sum(-1)
    return batch.batch["response_mask"].sum(-1)  # no attention mask: a single-turn batch, the masks agree


def decode_responses(tokenizer: PreTrainedTokenizerBase, batch: DataProto) -> list[str]:
    """Response texts, special tokens dropped: everything after the prompt (a multi-turn trajectory's tool
    results included: the reward scores the whole trajectory)."""
    responses = batch.batch["responses"]
    lengths = response_lengths(batch).tolist()
    return tokenizer.batch_decode([row[:n].tolist() for row, n in zip(responses, lengths, strict=True)],
                                  skip_special_tokens=True)


def environment_rewards(token_scores: torch.Tensor, batch: DataProto, extras: dict[str, np.ndarray]) -> torch.Tensor:
    """Rows an environment rewarded (source ``env:<name>``) take its rewards instead of the rule's: each turn's at
    that turn's last generated token, so outcome estimators sum them and gae sees where each was earned. A row whose
    environment failed, or that ran in an environment which gave it no reward at all, scores NaN (missing: the
    trainer masks and counts it), never 0. The rule's score stays an extra (``rule_score``); ``env_reward`` is the
    environment's sum (NaN where it gave none), and the row's ``acc`` too (the rule's verdict on a row an
    environment scores is not its accuracy: an env: row's data source may have none)."""
    non = batch.non_tensor
    turn_rewards, errors, names = non["turn_rewards"], non["env_error"], non["env_name"]
    rewarded = np.array([bool(r) or e is not None or n is not None for r, e, n in zip(turn_rewards, errors, names,
                                                                                      strict=True)])
    if not rewarded.any():
        return token_scores
    extras["rule_score"] = token_scores.sum(-1).numpy().astype(np.float32)
    extras["env_reward"] = np.full(len(turn_rewards), np.nan, dtype=np.float32)
    out = token_scores.clone()
    for i in np.flatnonzero(rewarded).tolist():
        out[i] = 0.0
        if errors[i] is not None or not turn_rewards[i]:
            out[i, -1] = float("nan")
            continue
        for position, reward in turn_rewards[i]:
            out[i, int(position)] += float(reward)
        extras["env_reward"][i] = float(sum(r for _, r in turn_rewards[i]))
    if "acc" in extras:
        extras["acc"] = np.where(rewarded, extras["env_reward"], extras["acc"]).astype(np.float32)
    return out


def episode_outcomes(scores: torch.Tensor, extras: dict[str, np.ndarray], episodes: np.ndarray) -> torch.Tensor:
    """Samples of one episode (a gateway agent that rewrote its history: ``verl.rollout.recorded_episodes``) share
    the episode's outcome: the score and extras of its last sample, the one that holds the final answer (``scores``
    and each extra ``(batch,)``; an episode's samples are adjacent rows, in the order they were started)."""
    source = episode_last_rows(episodes)
    for name, values in extras.items():
        extras[name] = np.asarray(values)[source]
    return scores[torch.from_numpy(source)]


def place_at_last_token(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``scores`` (batch,) -> (batch, response_len) with each score at the last token of ``response_mask`` (the
    last generated token; a multi-turn trajectory's mask has gaps at its tool turns)."""
    token_scores = torch.zeros(response_mask.shape, dtype=torch.float32)
    if response_mask.shape[1] == 0:
        return token_scores
    positions = torch.arange(1, response_mask.shape[1] + 1, device=response_mask.device)
    last = ((response_mask > 0) * positions).argmax(-1)  # the last 1 (position 0 when there is none)
    token_scores[torch.arange(len(scores)), last] = scores.float()
    return token_scores


class RewardManager:
    """Scores responses with rule/custom functions or a reward model."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, config: RewardConfig | None = None,
                 device: torch.device | str = "cpu"):
        self.tokenizer = tokenizer
        self.config = config or RewardConfig()
        self.fn: Callable[..., Any] | None = None
        self.model = None
        self.remote: RemoteRewardModel | None = None
        self.judge: RemoteJudge | None = None
        sandbox = self.config.sandbox  # where the code reward runs programs (built at its first use)
        configure_sandbox(sandbox.url, sandbox.max_concurrent, sandbox.memory_limit_mb)
        rm = self.config.model
        if rm.path:
            self._load_reward_model(rm.path, device)
        elif rm.url:
            key = os.environ.get(rm.api_key_env) if rm.api_key_env else None
            if rm.api_key_env and not key:
                raise ConfigError(f"reward.model.api_key_env={rm.api_key_env}: that environment variable is not set")
            if rm.kind == "judge":
                rubric = PointwiseRubric(load_rubric(rm.rubric, "pointwise", "reward.model"), *rm.scale,
                                         rm.judge_max_tokens)
                self.judge = RemoteJudge(rm.url, rm.name, rubric, key, rm.timeout_s, rm.max_retries, rm.max_concurrency)
            else:
                self.remote = RemoteRewardModel(rm.url, rm.name, rm.score, batch_size=rm.micro_batch_size,
                                                max_concurrency=rm.max_concurrency, timeout_s=rm.timeout_s,
                                                max_retries=rm.max_retries, backoff_s=rm.backoff_s,
                                                rate_limit=rm.rate_limit, api_key=key)
        elif self.config.custom_reward.path:
            self.fn = load_custom_reward(self.config.custom_reward.path, self.config.custom_reward.name)
        elif self.config.name != "auto":
            self.fn = get_reward_fn(self.config.name)

    def _load_reward_model(self, path: str, device: torch.device | str) -> None:
        local = resolve_model_path(path)
        try:
            self.model = AutoModelForSequenceClassification.from_pretrained(local, use_safetensors=True).to(device)
            self.rm_tokenizer = AutoTokenizer.from_pretrained(local)
        except (OSError, ValueError) as exc:
            raise ModelError(
                f"reward.model.path: cannot load a sequence-classification model from '{path}': {exc}"
            ) from None
        self.model.eval()
        if self.rm_tokenizer.pad_token is None:
            self.rm_tokenizer.pad_token = self.rm_tokenizer.eos_token
        self.rm_tokenizer.padding_side = "right"

    def compute(self, batch: DataProto) -> tuple[torch.Tensor, dict[str, np.ndarray], list[str]]:
        """Return ``(token_level_scores (batch, response_len), extras {name: (batch,)}, response texts)``."""
        texts = decode_responses(self.tokenizer, batch)
        if self.model is not None or self.remote is not None or self.judge is not None:
            scores, extras = self._score_with_reward_model(batch, texts)
        else:
            scores, extras = self._score_with_rules(batch, texts)
        if "episode" in batch.non_tensor:  # a gateway batch: one episode may be several samples
            scores = episode_outcomes(scores, extras, batch.non_tensor["episode"])
        token_scores = place_at_last_token(scores, batch.batch["response_mask"])
        if "turn_rewards" in batch.non_tensor:
            token_scores = environment_rewards(token_scores, batch, extras)
        return token_scores, extras, texts

    def _score_with_reward_model(self, batch: DataProto,
                                 texts: list[str]) -> tuple[torch.Tensor, dict[str, np.ndarray]]:
        """The reward model's score (weighted, plus the weighted rule where rows have answers); NaN where missing."""
        rm = self.config.model
        full = [f"{p}{r}" for p, r in zip(batch.non_tensor["raw_prompt"], texts, strict=True)]
        if self.judge is not None:  # the question as text (no template tokens), the answer between its markers
            prompts = [str(p) for p in batch.non_tensor["raw_prompt"]]
            questions = self.tokenizer.batch_decode(self.tokenizer(prompts, add_special_tokens=False)["input_ids"],
                                                    skip_special_tokens=True)
            values, missing = self.judge.score([q.strip() for q in questions], texts)
            log.info("reward", judged=len(texts), missing=missing)
            rm_scores = torch.from_numpy(values).float()
        elif self.remote is not None:
            values, stats = self.remote.score(full)
            log.info("reward", requests=stats.requests, retries=stats.retries, failed_batches=stats.failed_batches,
                     **({"failure": "; ".join(stats.reasons)} if stats.reasons else {}))
            rm_scores = torch.from_numpy(values).float()
        else:
            logits = self._score_with_model(full)
            rm_scores = torch.sigmoid(logits) if rm.score == "probability" else logits
        extras: dict[str, np.ndarray] = {"rm_score": rm_scores.numpy().astype(np.float32)}
        scores = rm.weight * rm_scores
        truths = batch.non_tensor.get("ground_truth")
        if truths is not None and all(t is not None for t in truths):
            rule_scores, rule_extras = self._score_with_rules(batch, texts)
            extras.update(rule_extras)
            extras["rule_score"] = rule_scores.numpy()
            if rm.rule_weight:
                scores = scores + rm.rule_weight * rule_scores
        return scores, extras

    def _score_with_rules(self, batch: DataProto, texts: list[str]) -> tuple[torch.Tensor, dict[str, np.ndarray]]:
        sources = batch.non_tensor["data_source"]
        truths = batch.non_tensor["ground_truth"]
        infos = batch.non_tensor.get("extra_info", np.array([{}] * len(texts), dtype=object))
        scores = np.zeros(len(texts), dtype=np.float32)
        extras: dict[str, list[float]] = {}
        fns = [self.fn or reward_for_data_source(str(source)) for source in sources]

        def score(i: int) -> Any:
            try:
                return fns[i](str(sources[i]), texts[i], truths[i], infos[i], **self.config.kwargs)
            except Exception as exc:
                raise VerlError(
                    f"reward function {getattr(fns[i], '__name__', fns[i])} failed on sample {i} "
                    f"(data_source={sources[i]!r}): {type(exc).__name__}: {exc}"
                ) from exc

        # Functions that wait on something else (the code reward on its sandbox: `concurrent = True`) score rows
        # in threads, as many as the sandbox runs at once; the rest in order, in this thread.
        if any(getattr(fn, "concurrent", False) for fn in fns) and len(texts) > 1:
            with concurrent.futures.ThreadPoolExecutor(self.config.sandbox.max_concurrent) as pool:
                results = list(pool.map(score, range(len(texts))))
        else:
            results = [score(i) for i in range(len(texts))]
        for i, result in enumerate(results):
            if isinstance(result, dict):
                scores[i] = float(result["score"])
                for key, value in result.items():
                    if key != "score" and isinstance(value, (int, float, bool)):
                        extras.setdefault(key, [float("nan")] * len(texts))[i] = float(value)
            else:
                scores[i] = float(result)
        return torch.from_numpy(scores), {k: np.asarray(v, dtype=np.float32) for k, v in extras.items()}

    @torch.no_grad()
    def _score_with_model(self, full: list[str]) -> torch.Tensor:
        """The in-process reward model's logits, (batch,), of prompt + response texts (right-padded, read at each
        text's last token as ``verl rm`` trained it)."""
        device = next(self.model.parameters()).device
        out = []
        for start in range(0, len(full), self.config.model.micro_batch_size):
            enc = self.rm_tokenizer(full[start : start + self.config.model.micro_batch_size], return_tensors="pt",
                                    padding=True, add_special_tokens=False).to(device)
            logits = sequence_scores(self.model, enc["input_ids"], enc["attention_mask"])
            out.append(logits[:, 0].float().cpu())
        return torch.cat(out)

"""The reward role: rule functions, a user's function, or a reward model, producing token-level scores.

Output of ``compute(batch)``: ``token_level_scores`` of shape ``(batch, response_len)``, zero except at each
response's last valid token, which holds the sequence score; plus per-sample extras (``acc``,
``acc_flexible`` ...) as numpy arrays for logging.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, PreTrainedTokenizerBase

from verl.config import RewardConfig
from verl.errors import ModelError, VerlError
from verl.models.loader import resolve_model_path
from verl.protocol import DataProto
from verl.rewards.registry import get_reward_fn, load_custom_reward, reward_for_data_source


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
    return tokenizer.batch_decode(
        [row[:n].tolist() for row, n in zip(responses, lengths, strict=True)], skip_special_tokens=True
    )


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
        if self.config.model.path:
            self._load_reward_model(self.config.model.path, device)
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
        if self.model is not None:
            scores = self._score_with_model(batch, texts)
            extras: dict[str, np.ndarray] = {}
        else:
            scores, extras = self._score_with_rules(batch, texts)
        return place_at_last_token(scores, batch.batch["response_mask"]), extras, texts

    def _score_with_rules(self, batch: DataProto, texts: list[str]) -> tuple[torch.Tensor, dict[str, np.ndarray]]:
        sources = batch.non_tensor["data_source"]
        truths = batch.non_tensor["ground_truth"]
        infos = batch.non_tensor.get("extra_info", np.array([{}] * len(texts), dtype=object))
        scores = np.zeros(len(texts), dtype=np.float32)
        extras: dict[str, list[float]] = {}
        for i, text in enumerate(texts):
            fn = self.fn or reward_for_data_source(str(sources[i]))
            try:
                result = fn(str(sources[i]), text, truths[i], infos[i], **self.config.kwargs)
            except Exception as exc:
                raise VerlError(
                    f"reward function {getattr(fn, '__name__', fn)} failed on sample {i} "
                    f"(data_source={sources[i]!r}): {type(exc).__name__}: {exc}"
                ) from exc
            if isinstance(result, dict):
                scores[i] = float(result["score"])
                for key, value in result.items():
                    if key != "score" and isinstance(value, (int, float, bool)):
                        extras.setdefault(key, [float("nan")] * len(texts))[i] = float(value)
            else:
                scores[i] = float(result)
        return torch.from_numpy(scores), {k: np.asarray(v, dtype=np.float32) for k, v in extras.items()}

    @torch.no_grad()
    def _score_with_model(self, batch: DataProto, texts: list[str]) -> torch.Tensor:
        prompts = batch.non_tensor["raw_prompt"]
        full = [f"{p}{r}" for p, r in zip(prompts, texts, strict=True)]
        device = next(self.model.parameters()).device
        out = []
        for start in range(0, len(full), self.config.model.micro_batch_size):
            enc = self.rm_tokenizer(full[start : start + self.config.model.micro_batch_size], return_tensors="pt",
                                    padding=True, add_special_tokens=False).to(device)
            logits = self.model(**enc).logits
            out.append(logits[:, 0].float().cpu())
        return torch.cat(out)

"""Reward models served for scoring: a ``kind: reward`` model entry behind ``/classify`` and ``/pooling``.

A reward model is an ``AutoModelForSequenceClassification`` checkpoint (what ``verl rm`` writes): one forward over
a text gives one logit per class at its last token. Scoring has no decode loop and no KV cache, so it does not use
a generation engine: one thread owns the model, requests take turns on it (a lock) and each request's inputs run
in micro-batches. Scores are the logits, or with the activation vLLM applies by default for classification
(``use_activation``): a sigmoid for one class (a probability in [0, 1]), a softmax for several.

Texts are scored as given (``add_special_tokens`` as the request says; vLLM's default is to add them). A chat
request's messages are rendered the way ``verl rm`` and the trainer build what a reward model scores: the
conversation up to the last assistant message through the chat template with the generation prompt, followed by
that message's text (vLLM renders the whole conversation through the template instead; our form is the one the
reward model was trained on).
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import torch
from transformers import AutoModelForSequenceClassification, PreTrainedTokenizerBase

from serve.lineage import Lineage
from verl.data.dataset import prompt_text
from verl.errors import ConfigError, DataError
from verl.models.loader import load_tokenizer, resolve_model_path
from verl.models.sequence_scores import sequence_scores
from verl.protocol import pad_tokens

MICRO_BATCH = 32


@dataclass
class Scored:
    """One request's scores: ``values`` (inputs, classes) as requested (logits or activated), and token counts."""

    values: list[list[float]]
    prompt_tokens: int
    labels: list[str]


class RewardScorer:
    """A served reward model (see the module docstring)."""

    kind = "reward"

    def __init__(self, path: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        self.source = path  # as configured (the admin API's state file keeps it)
        self.lineage = Lineage()
        self.created = int(time.time())
        self.path = resolve_model_path(path)
        self.tokenizer: PreTrainedTokenizerBase = load_tokenizer(self.path)
        try:
            self.model = AutoModelForSequenceClassification.from_pretrained(self.path, dtype=dtype).to(device)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"'{path}' is not a sequence-classification (reward) model: {exc}") from None
        self.model.eval()
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.device = device
        self.num_labels = int(self.model.config.num_labels)
        self.max_model_len = int(getattr(self.model.config, "max_position_embeddings", 0) or 2048)
        self.id2label = {int(k): v for k, v in (self.model.config.id2label or {}).items()}
        self._lock = threading.Lock()
        self.alive = True

    def render(self, messages: list[dict]) -> str:
        """The text a reward model scores for a conversation (see the module docstring)."""
        if messages and messages[-1].get("role") == "assistant":
            prompt, answer = messages[:-1], str(messages[-1].get("content") or "")
            if not prompt:
                return answer
            return prompt_text(prompt, self.tokenizer, True, "messages") + answer
        return prompt_text(messages, self.tokenizer, True, "messages")

    def encode(self, inputs: list[str] | list[list[int]], add_special_tokens: bool,
               truncate: int | None) -> list[list[int]]:
        """Token ids per input; ``truncate`` keeps the last N tokens (vLLM's ``truncate_prompt_tokens``)."""
        if inputs and isinstance(inputs[0], str):
            ids = self.tokenizer(list(inputs), add_special_tokens=add_special_tokens)["input_ids"]
        else:
            ids = [list(x) for x in inputs]
        if truncate is not None and truncate > 0:
            ids = [x[-truncate:] for x in ids]
        for i, x in enumerate(ids):
            if not x:
                raise DataError(f"input[{i}] is empty")
            if len(x) > self.max_model_len:
                raise DataError(f"input[{i}] has {len(x)} tokens, more than this model's {self.max_model_len}; set "
                                "truncate_prompt_tokens")
        return ids

    def _forward(self, ids: list[list[int]]) -> torch.Tensor:
        """Logits (inputs, classes): right-padded micro-batches, the head read at each input's last token."""
        out = []
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        with self._lock, torch.no_grad():
            for start in range(0, len(ids), MICRO_BATCH):
                input_ids, mask = pad_tokens(ids[start:start + MICRO_BATCH], pad, left=False)
                logits = sequence_scores(self.model, input_ids.to(self.device), mask.to(self.device))
                out.append(logits.float().cpu())
        return torch.cat(out)

    def activate(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(logits) if self.num_labels == 1 else torch.softmax(logits, dim=-1)

    async def score(self, ids: list[list[int]], use_activation: bool | None) -> Scored:
        logits = await asyncio.to_thread(self._forward, ids)
        values = self.activate(logits) if use_activation is not False else logits
        labels = [self.id2label.get(int(i), f"LABEL_{int(i)}") for i in logits.argmax(-1)]
        return Scored(values.tolist(), sum(len(x) for x in ids), labels)

    async def shutdown(self, timeout_s: float = 0.0) -> None:
        self.alive = False

    def is_healthy(self) -> bool:
        return self.alive

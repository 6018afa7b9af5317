"""A sequence classifier's output at each sequence's last real token (reward models).

transformers' ``*ForSequenceClassification`` finds the last token as the last one that is not the pad id, so a text
that ends in a token equal to the pad id (models whose pad token is their end-of-sequence token) is read one token
early. Reading the position from the attention mask has no such case; ``verl rm``, the trainer's reward role and the
service's reward scorer all score through here, so a reward model gives the same number wherever it runs.
"""

from __future__ import annotations

import torch


def sequence_scores(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Logits (batch, num_labels) of right-padded ``input_ids`` / ``attention_mask`` (batch, len), read at each row's
    last attended position. ``model``: a decoder ``*ForSequenceClassification`` (a ``score`` head over its base
    model), bare or wrapped by PEFT."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = getattr(inner, "score", None)
    if head is None:  # not a decoder classifier with a `score` head: its own forward decides
        return model(input_ids=input_ids, attention_mask=attention_mask).logits
    hidden = inner.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    last = attention_mask.sum(-1) - 1
    return head(hidden[torch.arange(hidden.shape[0], device=hidden.device), last])

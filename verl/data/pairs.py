"""Preference pairs for reward-model training, in the layouts TRL's ``RewardTrainer`` reads.

A row is one comparison: a ``chosen`` answer preferred to a ``rejected`` one for the same prompt. Accepted:

- **explicit prompt**: ``prompt`` (a string or chat messages) plus ``chosen`` and ``rejected`` completions, each a
  string or a list with the assistant message(s);
- **implicit prompt**: no ``prompt`` column; ``chosen`` and ``rejected`` are whole conversations (message lists)
  whose shared leading messages are the prompt, or whole texts (scored as they are).

Each side becomes the exact text a reward model scores: the prompt through the tokenizer's chat template (as the
RL trainer renders it, ``prompt_text``) followed by the answer, so a model trained here scores rollouts the way the
trainer's reward role presents them (``RewardManager``: rendered prompt + response text).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from verl.data.dataset import prompt_text
from verl.errors import DataError


@dataclass(frozen=True)
class Pair:
    """One comparison as the texts a reward model scores; ``where`` names its file and row for errors."""

    prompt: str
    chosen: str
    rejected: str
    where: str


def _messages(value: Any, where: str, column: str) -> Any:
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value  # a text that happens to start with "["
    if isinstance(value, (list, tuple)) and not all(isinstance(m, dict) and "content" in m for m in value):
        raise DataError(f"{where}: '{column}' must be a string or a list of {{role, content}} messages")
    return list(value) if isinstance(value, tuple) else value


def _answer_text(value: Any, where: str, column: str) -> str:
    """A completion: a string, or the content of its assistant message(s)."""
    value = _messages(value, where, column)
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(str(m["content"]) for m in value if m.get("role", "assistant") == "assistant")
    raise DataError(f"{where}: '{column}' must be a string or a list of messages, got {type(value).__name__}")


def _split_conversations(chosen: list[dict], rejected: list[dict], where: str) -> tuple[list[dict], str, str]:
    """Implicit prompt: the shared leading messages, then each side's assistant answer."""
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if shared == 0:
        raise DataError(f"{where}: 'chosen' and 'rejected' share no leading message, so there is no prompt; give a "
                        "'prompt' column or conversations that start with the same user turn")
    prompt = chosen[:shared]
    if prompt[-1].get("role") == "assistant":  # both answers start the same: the prompt ends at the last user turn
        while prompt and prompt[-1].get("role") == "assistant":
            prompt = prompt[:-1]
    return prompt, _answer_text(chosen[len(prompt):], where, "chosen"), _answer_text(rejected[len(prompt):], where,
                                                                                      "rejected")


def read_pair(row: dict, tokenizer, prompt_key: str, chosen_key: str, rejected_key: str) -> Pair:
    """The texts of one row (see the module docstring)."""
    where = f"{row.get('__source_file__', '?')} row {row.get('__row__', '?')}"
    missing = [k for k in (chosen_key, rejected_key) if k not in row]
    if missing:
        columns = [c for c in row if not c.startswith("__")]
        raise DataError(f"{where}: preference pairs need columns '{chosen_key}' and '{rejected_key}' "
                        f"(data.chosen_key, data.rejected_key; TRL's layout); missing {missing}, columns are "
                        f"{columns}")
    if prompt_key in row and row[prompt_key] is not None:
        prompt = prompt_text(_messages(row[prompt_key], where, prompt_key), tokenizer, True, where)
        return Pair(prompt, _answer_text(row[chosen_key], where, chosen_key),
                    _answer_text(row[rejected_key], where, rejected_key), where)
    chosen = _messages(row[chosen_key], where, chosen_key)
    rejected = _messages(row[rejected_key], where, rejected_key)
    if isinstance(chosen, str) and isinstance(rejected, str):
        return Pair("", chosen, rejected, where)
    if isinstance(chosen, list) and isinstance(rejected, list):
        messages, chosen_text, rejected_text = _split_conversations(chosen, rejected, where)
        return Pair(prompt_text(messages, tokenizer, True, where), chosen_text, rejected_text, where)
    raise DataError(f"{where}: '{chosen_key}' and '{rejected_key}' must both be texts or both conversations")

"""Engine log-probs (``TokenLogprob`` per position) -> the two OpenAI response shapes.

- Completions (legacy): ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, parallel lists; each
  ``top_logprobs`` entry maps token text -> log-prob for the k best *and* the chosen token (vLLM's behaviour), and
  is ``null`` where there is no log-prob (the first prompt token under ``echo``).
- Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``.

Token texts are single-token decodes with special tokens kept, as vLLM reports them; a token that is only part of
a UTF-8 character decodes to U+FFFD, and ``bytes`` is then the UTF-8 of that text, not the raw byte.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from serve.engines.base import TokenLogprob


def token_texts(decode: Callable[[list[int]], str]) -> Callable[[int], str]:
    """A cached single-token decoder (alternatives repeat a lot across positions)."""
    return functools.cache(lambda token_id: decode([token_id]))


class CompletionLogprobs:
    """Accumulates one choice's legacy ``logprobs`` object across chunks (text offsets continue)."""

    def __init__(self, text: Callable[[int], str]):
        self.text = text
        self.offset = 0

    def block(self, token_ids: Sequence[int], entries: Sequence[TokenLogprob | None]) -> dict:
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, entry in zip(token_ids, entries, strict=True):
            token = self.text(token_id)
            out["tokens"].append(token)
            out["text_offset"].append(self.offset)
            self.offset += len(token)
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(entry.logprob)
            top = {self.text(i): lp for i, lp in entry.top}
            top.setdefault(token, entry.logprob)
            out["top_logprobs"].append(top)
        return out


def chat_logprobs(entries: Sequence[TokenLogprob], text: Callable[[int], str]) -> dict:
    def item(token_id: int, logprob: float) -> dict:
        token = text(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(i, lp) for i, lp in e.top]}
                        for e in entries], "refusal": None}  # OpenAI's schema requires the key

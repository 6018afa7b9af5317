"""Constrained decoding on the transformers engine: a grammar decides which tokens may come next (llguidance).

What the service guarantees with it (``docs/serving.md``): ``tool_choice: required`` or a named function gives
Hermes tool-call blocks whose JSON fits the tools' schemas, and ``response_format`` ``json_object`` /
``json_schema`` gives JSON that parses (and fits the schema). Grammars are Lark text with embedded JSON schemas,
llguidance's format, which vLLM's ``guidance`` backend reads too, so both engines take the same grammar.

llguidance rather than hand-written masks: it computes a token mask in tens of microseconds from any tokenizer's
vocabulary (multi-character BPE tokens that cross a grammar boundary included), which no regex over text does.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from verl.tools.calls import CALL_CLOSE, CALL_OPEN

# JSON written the way Python's json.dumps and Hugging Face chat templates write it (", " and ": ", no other
# whitespace): the layout the models saw in training, and no room for a small model to wander into endless spaces.
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _lark_json(schema: dict[str, Any]) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": COMPACT_JSON})


def json_grammar(schema: dict[str, Any] | None) -> str:
    """Any JSON object (``schema`` None: ``json_object``) or one that fits ``schema`` (``json_schema``)."""
    return "start: value\nvalue: " + _lark_json(schema if schema is not None else {"type": "object"})


def tool_call_grammar(tools: list[dict[str, Any]], name: str | None = None, parallel: bool = True) -> str:
    """One Hermes block (``parallel``: one or more) calling ``name`` or any of ``tools`` (OpenAI function
    definitions), the arguments fitting the function's ``parameters`` schema."""
    chosen = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    options = [{"type": "object",
                "properties": {"name": {"const": f["name"]}, "arguments": f.get("parameters") or {"type": "object"}},
                "required": ["name", "arguments"], "additionalProperties": False} for f in chosen]
    call = options[0] if len(options) == 1 else {"anyOf": options}
    repeat = "+" if parallel else ""
    return (f"start: call{repeat}\n"
            f"call: {json.dumps(CALL_OPEN + chr(10))} body {json.dumps(chr(10) + CALL_CLOSE)}\n"
            f"body: {_lark_json(call)}")


def check_grammar(grammar: str) -> str | None:
    """Why llguidance cannot compile ``grammar`` (e.g. a JSON schema feature it lacks), or None."""
    import llguidance  # noqa: PLC0415  (serve extra; only requests that constrain need it)

    problem = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(grammar))
    return problem or None


class GrammarTokenizer:
    """llguidance's view of one Hugging Face tokenizer, built once (about a second for a 50k vocabulary)."""

    def __init__(self, tokenizer: Any, eos_ids: list[int]):
        import llguidance  # noqa: PLC0415
        import llguidance.hf  # noqa: PLC0415

        self.vocab_size = len(tokenizer)
        try:
            self.ll = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.vocab_size, eos_token=eos_ids)
        except ValueError:  # a decoder llguidance does not read (e.g. the tiny models' Fuse): one text per token
            from llguidance._tokenizer import TokenizerWrapper  # noqa: PLC0415

            self.ll = llguidance.LLTokenizer(TokenizerWrapper(_TokenTable(tokenizer, eos_ids)), n_vocab=self.vocab_size)

    def matcher(self, grammar: str) -> GrammarMatcher:
        import llguidance  # noqa: PLC0415

        return GrammarMatcher(llguidance.LLMatcher(self.ll, llguidance.LLMatcher.grammar_from_lark(grammar)),
                              self.vocab_size)


class _TokenTable:
    """What llguidance's ``TokenizerWrapper`` reads: each id's bytes (special tokens marked with 0xFF, as
    llguidance spells them) and an encoder."""

    def __init__(self, tokenizer: Any, eos_ids: list[int]):
        special = set(tokenizer.all_special_ids)
        self.eos_token_id = eos_ids[0]
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(special)
        self.tokens = [b"\xff" + tokenizer.convert_ids_to_tokens(i).encode() if i in special
                       else tokenizer.decode([i]).encode() for i in range(len(tokenizer))]
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer(text, add_special_tokens=False)["input_ids"]


class GrammarMatcher:
    """One sequence's grammar state: the mask of allowed next tokens, advanced token by token."""

    def __init__(self, matcher: Any, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size
        if matcher.is_error():
            raise ValueError(matcher.get_error())

    def mask_logits(self, row: torch.Tensor) -> None:
        """Set the logits of tokens the grammar forbids next to -inf, in place (``row``: (vocab,) float32)."""
        import llguidance.torch as llt  # noqa: PLC0415

        bitmask = llt.allocate_token_bitmask(1, self.vocab_size)
        llt.fill_next_token_bitmask(self.matcher, bitmask, 0)
        llt.apply_token_bitmask_inplace(row[: self.vocab_size].unsqueeze(0), bitmask)
        if row.shape[0] > self.vocab_size:  # padded embedding rows are never tokens
            row[self.vocab_size:] = float("-inf")

    def advance(self, token: int) -> None:
        self.matcher.consume_token(token)

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing but the end."""
        return self.matcher.is_stopped()

"""Checks of a multi-turn rollout's layout shared by the transformers and vLLM agent-loop tests."""

from __future__ import annotations

from typing import Any

from verl.config import MultiTurnConfig
from verl.protocol import DataProto
from verl.tools.templates import ConversationTokens, ToolPrompting


def segments(mask: list[int]) -> list[tuple[int, int, int]]:
    """Runs of equal mask values: (value, start, end)."""
    runs, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((mask[start], start, i))
            start = i
    return runs


def check_trajectory_layout(batch: DataProto, tokenizer: Any, config: MultiTurnConfig) -> None:
    """Per trajectory: generated ids (loss mask 1) alternate with tool turns (mask 0, attention 1); each tool turn is
    exactly the chat template's ids for that turn's tool messages (not re-tokenized text), after an assistant turn
    that ended in eos; turns within ``max_assistant_turns``; a trajectory that stopped ends in a generated eos."""
    prompting = ToolPrompting.from_config(config, tokenizer)
    tokens = ConversationTokens(tokenizer, prompting.template, prompting.tool_set.schemas())
    non = batch.non_tensor
    width = batch.batch["responses"].shape[1]
    for i in range(len(batch)):
        length = int(batch.batch["attention_mask"][i, -width:].sum())
        ids = batch.batch["responses"][i, :length].tolist()
        mask = batch.batch["response_mask"][i, :length].tolist()
        assert batch.batch["response_mask"][i, length:].sum() == 0
        runs = segments(mask)
        assert runs[0][0] == 1  # the model speaks first
        tool_runs = [r for r in runs if r[0] == 0]
        ran = [call for call in non["tool_trace"][i] if call["result"] is not None]
        results = [call["result"] for call in ran]
        # One tool turn per assistant turn whose calls ran; it holds every result of that turn, in order.
        turns_with_calls = sorted({call["turn"] for call in ran})
        assert len(tool_runs) == len(turns_with_calls)
        for (_, start, end), turn in zip(tool_runs, turns_with_calls, strict=True):
            messages = [{"role": "tool", "content": c["result"], "name": c["name"]} for c in ran if c["turn"] == turn]
            expected = tokens.turn_ids(messages)  # the template's ids, not re-tokenized text
            if end == length and non["finish_reason"][i] == "length":
                expected = expected[: end - start]  # the budget cut the tool turn: no room left to answer
            assert ids[start:end] == expected
            assert ids[start - 1] == tokenizer.eos_token_id  # the assistant turn before it ended with eos
        if non["finish_reason"][i] != "length":
            assert all(r in tokenizer.decode(ids) for r in results)
        generated_turns = [r for r in runs if r[0] == 1]
        assert len(generated_turns) == non["num_turns"][i] <= config.max_assistant_turns
        finish = non["finish_reason"][i]
        assert finish in ("stop", "length", "turns")
        if finish == "stop":
            assert ids[-1] == tokenizer.eos_token_id and mask[-1] == 1

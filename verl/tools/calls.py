"""Tool calls in Hermes format: how a model writes them, how they are read back, one parser for training and serving.

The assistant writes each call as a JSON object inside tags (NousResearch Hermes 2 Pro, Qwen2.5; vLLM's
``--tool-call-parser hermes`` reads the same)::

    I will compute it.<tool_call>
    {"name": "calculator", "arguments": {"expression": "37*412"}}
    </tool_call>

Text outside the tags is the message's content. A block that is not a JSON object with a string ``name`` and an
object ``arguments`` (or a JSON string holding one) is kept as a call with an ``error``: the agent loop answers it
with an error message as the tool result, the service returns it as content, and neither raises.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
# A closed block, or an unclosed one at the very end (a model that ran out of tokens mid-call).
_BLOCK = re.compile(re.escape(CALL_OPEN) + r"(.*?)(?:" + re.escape(CALL_CLOSE) + r"|$)", re.S)


@dataclass
class ToolCall:
    """One call as the model wrote it. ``arguments`` is None and ``error`` says why when the block is malformed."""

    name: str
    arguments: dict[str, Any] | None
    raw: str
    error: str | None = None
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    @property
    def valid(self) -> bool:
        return self.error is None

    def arguments_json(self) -> str:
        """The arguments as OpenAI sends them: a JSON string."""
        return json.dumps(self.arguments if self.arguments is not None else {}, ensure_ascii=False)


@dataclass
class ParsedTurn:
    """An assistant turn split into its content (text outside the call blocks, stripped) and its calls."""

    content: str
    calls: list[ToolCall]

    @property
    def has_calls(self) -> bool:
        return bool(self.calls)


def parse_tool_calls(text: str) -> ParsedTurn:
    """Split ``text`` (one assistant turn, special tokens removed) into content and Hermes tool calls."""
    calls = [_parse_block(match.group(1)) for match in _BLOCK.finditer(text)]
    content = _BLOCK.sub("", text).strip()
    return ParsedTurn(content, calls)


def _parse_block(body: str) -> ToolCall:
    raw = body.strip()
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        return ToolCall("", None, raw, f"the tool call is not valid JSON ({exc.msg} at character {exc.pos})")
    if not isinstance(value, dict):
        return ToolCall("", None, raw, "the tool call must be a JSON object with 'name' and 'arguments'")
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall("", None, raw, "the tool call has no 'name' string")
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string, as OpenAI transports them
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            return ToolCall(name, None, raw, f"the arguments of '{name}' are not valid JSON ({exc.msg})")
    if not isinstance(arguments, dict):
        return ToolCall(name, None, raw, f"the arguments of '{name}' must be a JSON object")
    return ToolCall(name, arguments, raw)


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """One call as the model should write it (the inverse of ``parse_tool_calls``)."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}"


def format_assistant_turn(content: str, calls: list[tuple[str, dict[str, Any]]]) -> str:
    """An assistant turn's text: its content, then each call's block."""
    return content + "".join(format_tool_call(name, arguments) for name, arguments in calls)

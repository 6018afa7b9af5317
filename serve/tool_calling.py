"""OpenAI tool calling and structured output in ``/v1/chat/completions``.

The request side: ``tools`` (OpenAI function definitions, schemas checked), ``tool_choice``,
``parallel_tool_calls`` and ``response_format`` become a ``ToolPlan``; the history (assistant ``tool_calls``,
``tool`` messages with ``tool_call_id``) becomes the messages a tool-aware chat template renders (the model's own,
or the project's Hermes template, as training uses: ``verl.tools.templates``). The response side: the generated
text is split by the parser training uses (``verl.tools.calls``) into content and ``tool_calls``; a stream emits
content deltas until a call begins and one ``tool_calls`` delta per finished call. The service never runs tools.

Guarantees come from constrained decoding (``serve.constrained``), not from hoping: ``tool_choice: required`` and a
named function, and the JSON ``response_format`` types.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from serve.constrained import check_grammar, json_grammar, tool_call_grammar
from serve.errors import ApiError
from serve.schemas import ChatCompletionRequest, ChatMessage
from verl.tools.calls import CALL_CLOSE, CALL_OPEN, ToolCall, parse_tool_calls


@dataclass
class ToolPlan:
    """What a chat request asks of tools and output structure (``grammar``: Lark text for the engine)."""

    tools: list[dict[str, Any]] = field(default_factory=list)  # OpenAI function definitions, as templates read
    choice: str = "none"  # none | auto | required | the named function
    parallel: bool = True
    grammar: str | None = None

    @property
    def parses_calls(self) -> bool:
        """Whether the response is read for tool calls."""
        return bool(self.tools) and self.choice != "none"


def plan_request(body: ChatCompletionRequest) -> ToolPlan:
    """Check ``tools`` / ``tool_choice`` / ``response_format`` (400 in OpenAI's shape, naming the field) and
    decide what is rendered, parsed and enforced."""
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    _check_tool_schemas(tools)
    choice = body.tool_choice
    if choice is not None and not tools and choice != "none":
        raise ApiError(400, "'tool_choice' is only allowed when 'tools' are given", param="tool_choice")
    names = [t["function"]["name"] for t in tools]
    if choice is None:
        choice_name = "auto" if tools else "none"
    elif isinstance(choice, str):
        choice_name = choice
    else:
        choice_name = choice.function.name
        if choice_name not in names:
            raise ApiError(400, f"tool_choice names '{choice_name}', which is not among the tools "
                           f"({', '.join(names)})", param="tool_choice")
    plan = ToolPlan(tools=tools, choice=choice_name, parallel=body.parallel_tool_calls is not False)
    structured = _response_format_grammar(body)
    if structured is not None and choice_name in ("required", *names):
        raise ApiError(400, "'response_format' and a forced 'tool_choice' cannot both shape the same answer; drop "
                       "one", param="response_format")
    if choice_name == "required" or choice_name in names:
        forced = None if choice_name == "required" else choice_name
        # A named choice makes one call, whatever parallel_tool_calls says (OpenAI's behaviour).
        plan.grammar = tool_call_grammar(tools, forced, plan.parallel and forced is None)
    else:
        plan.grammar = structured
    if plan.grammar is not None:
        problem = check_grammar(plan.grammar)
        if problem:
            param = "response_format" if structured is not None and plan.grammar == structured else "tools"
            raise ApiError(400, f"this schema cannot be enforced: {problem}", param=param)
    return plan


# A schema is compiled into a grammar and checked by recursive code (jsonschema, llguidance): bound its shape first,
# so a hostile one is a 400 naming the limit, not a RecursionError deep in a library.
MAX_SCHEMA_DEPTH = 32
MAX_SCHEMA_NODES = 10_000


def check_schema_shape(schema: Any, param: str) -> None:
    """Refuse (400) a JSON schema nested deeper than ``MAX_SCHEMA_DEPTH`` or with more than ``MAX_SCHEMA_NODES``
    values; walked with an explicit stack (no recursion of our own)."""
    stack, nodes = [(schema, 1)], 0
    while stack:
        value, depth = stack.pop()
        nodes += 1
        if depth > MAX_SCHEMA_DEPTH:
            raise ApiError(400, f"{param} is nested more than {MAX_SCHEMA_DEPTH} levels deep; flatten it (the limit "
                           "keeps grammar compilation bounded)", param=param)
        if nodes > MAX_SCHEMA_NODES:
            raise ApiError(400, f"{param} has more than {MAX_SCHEMA_NODES} values; shorten it", param=param)
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        stack.extend((child, depth + 1) for child in children)


def _check_tool_schemas(tools: list[dict[str, Any]]) -> None:
    from jsonschema import SchemaError  # noqa: PLC0415  (a request with tools pays for it, no other)
    from jsonschema.validators import validator_for  # noqa: PLC0415

    seen: set[str] = set()
    for i, tool in enumerate(tools):
        function = tool["function"]
        if function["name"] in seen:
            raise ApiError(400, f"two tools are named '{function['name']}'; names must be unique",
                           param=f"tools[{i}].function.name")
        seen.add(function["name"])
        parameters = function.get("parameters")
        if parameters is None:
            continue
        check_schema_shape(parameters, f"tools[{i}].function.parameters")
        try:
            validator_for(parameters).check_schema(parameters)
        except SchemaError as exc:
            where = "/".join(str(p) for p in exc.path) or "parameters"
            raise ApiError(400, f"tools[{i}].function.parameters is not a valid JSON Schema ({where}: "
                           f"{exc.message})", param=f"tools[{i}].function.parameters") from None
        if parameters.get("type", "object") != "object":
            raise ApiError(400, f"tools[{i}].function.parameters must describe an object (type: object), got "
                           f"type {parameters.get('type')!r}", param=f"tools[{i}].function.parameters")


def _response_format_grammar(body: ChatCompletionRequest) -> str | None:
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return json_grammar(None)
    schema = fmt.json_schema.schema_
    if schema is not None:
        check_schema_shape(schema, "response_format.json_schema.schema")
        from jsonschema import SchemaError  # noqa: PLC0415
        from jsonschema.validators import validator_for  # noqa: PLC0415

        try:
            validator_for(schema).check_schema(schema)
        except SchemaError as exc:
            raise ApiError(400, f"response_format.json_schema.schema is not a valid JSON Schema ({exc.message})",
                           param="response_format.json_schema.schema") from None
    return json_grammar(schema or {"type": "object"})


# ---------------------------------------------------------------------------------------------- history


def template_messages(messages: list[ChatMessage], answering: bool = True) -> list[dict[str, Any]]:
    """The history as chat templates read it: assistant ``tool_calls`` with their arguments parsed, ``tool``
    messages with their ``tool_call_id`` and the function's name. A broken history is a 400 naming the message;
    so are calls left unanswered before the next user or assistant turn, or before the end when the model is to
    answer (``answering``: a generation prompt follows; rendering a finished turn, ``/tokenize``, may end on calls)."""
    out: list[dict[str, Any]] = []
    calls: dict[str, str] = {}  # id -> function name, of every call made so far
    unanswered: dict[str, int] = {}  # call id -> the assistant message that made it, until a tool message answers
    for i, message in enumerate(messages):
        role = "system" if message.role == "developer" else message.role
        if role in ("user", "assistant") and unanswered:
            raise_unanswered(unanswered, f"messages[{i}]")
        entry: dict[str, Any] = {"role": role, "content": message.text()}
        if message.tool_calls:
            if role != "assistant":
                raise ApiError(400, f"messages[{i}] has tool_calls but role '{message.role}'; only assistant "
                               "messages carry them", param=f"messages[{i}].tool_calls")
            entry["tool_calls"] = []
            for j, call in enumerate(message.tool_calls):
                try:
                    arguments = json.loads(call.function.arguments) if call.function.arguments.strip() else {}
                except json.JSONDecodeError as exc:
                    raise ApiError(400, f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON "
                                   f"({exc.msg})", param=f"messages[{i}].tool_calls[{j}].function.arguments") from None
                if not isinstance(arguments, dict):
                    raise ApiError(400, f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON object",
                                   param=f"messages[{i}].tool_calls[{j}].function.arguments")
                calls[call.id] = call.function.name
                unanswered[call.id] = i
                entry["tool_calls"].append({"id": call.id, "type": "function",
                                            "function": {"name": call.function.name, "arguments": arguments}})
        if role == "tool":
            if not message.tool_call_id:
                raise ApiError(400, f"messages[{i}] is a tool message without 'tool_call_id'",
                               param=f"messages[{i}].tool_call_id")
            if message.tool_call_id not in calls:
                raise ApiError(400, f"messages[{i}].tool_call_id '{message.tool_call_id}' answers no tool call of an "
                               "earlier assistant message", param=f"messages[{i}].tool_call_id")
            entry.update(tool_call_id=message.tool_call_id, name=calls[message.tool_call_id])
            unanswered.pop(message.tool_call_id, None)
        elif message.tool_call_id is not None:
            raise ApiError(400, f"messages[{i}] has tool_call_id but role '{message.role}'; only tool messages "
                           "carry it", param=f"messages[{i}].tool_call_id")
        out.append(entry)
    if unanswered and answering:
        raise_unanswered(unanswered, "the end of the messages")
    return out


def raise_unanswered(unanswered: dict[str, int], where: str) -> None:
    """OpenAI's rule: every call of an assistant message is answered by a tool message (its ``tool_call_id``)
    before the next user or assistant message; a 400 naming the calls that were not."""
    ids = ", ".join(repr(call_id) for call_id in unanswered)
    first = min(unanswered.values())
    raise ApiError(400, f"messages[{first}] is an assistant message with 'tool_calls' that must be followed by a "
                   f"tool message answering each 'tool_call_id'; {ids} had no answer before {where}",
                   param=f"messages[{first}].tool_calls")


def uses_tools(messages: list[ChatMessage], plan: ToolPlan) -> bool:
    """Whether the prompt needs a template that renders tools (tools given, or calls in the history)."""
    return bool(plan.tools) or any(m.role == "tool" or m.tool_calls for m in messages)


# ---------------------------------------------------------------------------------------------- responses


def openai_call(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments_json()}}


def response_message(text: str, finish_reason: str | None, plan: ToolPlan) -> tuple[dict[str, Any], str | None]:
    """The assistant message for ``text`` and the finish reason: tool calls split out (``tool_calls`` finish)
    when the request's tools may be called and the model called one of them with valid JSON."""
    message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
    if not plan.parses_calls:
        return message, finish_reason
    turn = parse_tool_calls(text)
    names = {t["function"]["name"] for t in plan.tools}
    calls = [c for c in turn.calls if c.valid and c.name in names]
    if not calls:
        return message, finish_reason
    message.update(content=turn.content or None, tool_calls=[openai_call(c) for c in calls])
    return message, "tool_calls" if finish_reason == "stop" else finish_reason


class ToolCallStream:
    """Splits one choice's streamed text into content deltas and ``tool_calls`` deltas (one per finished call:
    id, type, name and the whole arguments string), holding back text that may be the start of a call tag."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.names = {t["function"]["name"] for t in plan.tools}
        self.buffer = ""
        self.in_call = False
        self.calls = 0

    def feed(self, text: str, final: bool = False) -> list[dict[str, Any]]:
        """Deltas (``{"content": ...}`` / ``{"tool_calls": [...]}``) for ``text``; ``final`` flushes."""
        self.buffer += text
        deltas: list[dict[str, Any]] = []
        while True:
            if not self.in_call:
                start = self.buffer.find(CALL_OPEN)
                if start < 0:
                    keep = 0 if final else _partial_suffix(self.buffer, CALL_OPEN)
                    emit, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                    if emit:
                        deltas.append({"content": emit})
                    return deltas
                if start:
                    deltas.append({"content": self.buffer[:start]})
                self.buffer, self.in_call = self.buffer[start:], True
            end = self.buffer.find(CALL_CLOSE)
            if end < 0 and not final:
                return deltas
            block = self.buffer if end < 0 else self.buffer[: end + len(CALL_CLOSE)]
            self.buffer, self.in_call = ("" if end < 0 else self.buffer[end + len(CALL_CLOSE):]), False
            deltas.extend(self._block(block))
            if end < 0:
                return deltas

    def _block(self, block: str) -> list[dict[str, Any]]:
        calls = [c for c in parse_tool_calls(block).calls if c.valid and c.name in self.names]
        if not calls:  # not a call of these tools: it stays text, as the non-streamed response keeps it
            return [{"content": block}]
        out = []
        for call in calls:
            out.append({"tool_calls": [{"index": self.calls, **openai_call(call)}]})
            self.calls += 1
        return out


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag`` (text to hold back)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0

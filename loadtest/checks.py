"""Response checks and LLM timings for the load-test users: pure functions, so they are unit-tested without Locust.

A response counts as a success only when its status is 200, its JSON has the endpoint's shape, the generated text
is not blank and the token counts add up. Anything else raises ``BadResponse`` with a short message; the user
marks the request failed with it, so it shows in Locust's failures table and ``_failures.csv``.

Streaming timings follow ``vllm bench serve``: time to first token (TTFT) = request start -> first chunk that
carries generated text; inter-token latency (ITL) = the gaps between the chunks after it (the finishing chunk
included, since its token -- usually end-of-text -- is generated too). The server streams one chunk per engine
step, as its own ``verl:inter_token_latency_seconds`` histogram counts them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


class BadResponse(Exception):
    """The response does not look like a correct answer (message goes into Locust's failure table)."""


@dataclass
class Completion:
    """What a validated response produced."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str = "stop"  # "length": cut at max_tokens


# A test whose first requests all fail measures nothing: the locustfile stops it after this many failures with no
# success, logs the first error after ABORT_MARKER and exits with ABORT_EXIT_CODE; `verl loadtest` reports it.
ABORT_AFTER_FAILURES = 10
ABORT_EXIT_CODE = 3
ABORT_MARKER = "loadtest aborted:"


def abort_reason(log_text: str) -> str | None:
    """The reason the locustfile logged when it aborted the test, from Locust's log (None if it did not)."""
    for line in log_text.splitlines():
        if ABORT_MARKER in line:
            return line.split(ABORT_MARKER, 1)[1].strip()
    return None


def error_message(status: int, body: bytes | str | None, error: BaseException | str | None = None) -> str:
    """``HTTP 429: the server is at capacity ...`` from an OpenAI-shaped error body (or the raw text). Status 0 is
    no response at all (the connection failed, was reset, or timed out): then ``error``, the client's exception,
    says which (``HTTP 0: no response: ConnectionResetError(...)``)."""
    if status == 0:
        return f"HTTP 0: no response: {error!r}" if error is not None else "HTTP 0: no response"
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else (body or "")
    try:
        detail = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        detail = text.strip()[:200]
    return f"HTTP {status}: {detail}" if detail else f"HTTP {status}"


def _parse(body: bytes | str | None) -> dict:
    try:
        data = json.loads(body or b"")
    except ValueError:
        raise BadResponse(f"the body is not JSON: {str(body)[:120]!r}") from None
    if not isinstance(data, dict):
        raise BadResponse(f"the body is JSON but not an object: {str(body)[:120]!r}")
    return data


def _count(value: Any, name: str, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise BadResponse(f"'{name}' must be an integer >= {minimum}; got {value!r}")
    return value


def _usage(usage: Any) -> tuple[int, int]:
    if not isinstance(usage, dict):
        raise BadResponse(f"'usage' missing or not an object: {usage!r}")
    prompt = _count(usage.get("prompt_tokens"), "usage.prompt_tokens", 1)
    completion = _count(usage.get("completion_tokens"), "usage.completion_tokens", 1)
    total = _count(usage.get("total_tokens"), "usage.total_tokens", 2)
    if total != prompt + completion:
        raise BadResponse(f"usage.total_tokens {total} != prompt_tokens {prompt} + completion_tokens {completion}")
    return prompt, completion


def _text(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise BadResponse(f"'{name}' must be text; got {value!r}")
    if not value.strip():
        raise BadResponse(f"'{name}' is empty: the model generated no text")
    return value


def check_generate(body: bytes | str | None) -> Completion:
    """``/generate``: ``{"response": text, "finish_reason", "prompt_tokens", "completion_tokens"}``."""
    data = _parse(body)
    text = _text(data.get("response"), "response")
    if data.get("finish_reason") not in ("stop", "length"):
        raise BadResponse(f"'finish_reason' must be stop or length; got {data.get('finish_reason')!r}")
    return Completion(text, _count(data.get("prompt_tokens"), "prompt_tokens", 1),
                      _count(data.get("completion_tokens"), "completion_tokens", 1), data["finish_reason"])


def _single_choice(data: dict, obj: str) -> dict:
    """The one choice of a non-streamed response whose ``object`` must be ``obj``."""
    if data.get("object") != obj:
        raise BadResponse(f"'object' must be '{obj}'; got {data.get('object')!r}")
    choices = data.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        raise BadResponse(f"'choices' must hold exactly one choice; got {str(choices)[:120]}")
    return choices[0]


def check_completion(body: bytes | str | None) -> Completion:
    """``/v1/completions`` (not streamed): one choice with text and a finish reason, and usage counts."""
    data = _parse(body)
    choice = _single_choice(data, "text_completion")
    text = _text(choice.get("text"), "choices[0].text")
    if choice.get("finish_reason") not in ("stop", "length"):
        raise BadResponse(f"'choices[0].finish_reason' must be stop or length; got {choice.get('finish_reason')!r}")
    prompt, completion = _usage(data.get("usage"))
    return Completion(text, prompt, completion, choice["finish_reason"])


@dataclass
class ChatTurn:
    """One validated chat response of an agent session: the assistant message and its usage."""

    message: dict[str, Any]
    tool_calls: list[dict[str, Any]]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    id: str = ""  # the completion's id (what feedback names)


def check_chat_turn(body: bytes | str | None) -> ChatTurn:
    """``/v1/chat/completions`` (not streamed) with tools: one choice whose message has text, or tool calls
    (each with an id, a function name and arguments that are a JSON object) and ``finish_reason: tool_calls``."""
    data = _parse(body)
    choice = _single_choice(data, "chat.completion")
    message, finish = choice.get("message"), choice.get("finish_reason")
    if not isinstance(message, dict) or message.get("role") != "assistant":
        raise BadResponse(f"'choices[0].message' must be an assistant message; got {str(message)[:120]}")
    calls = message.get("tool_calls") or []
    if calls:
        if finish not in ("tool_calls", "length"):  # length: the budget ended after (or in) the last call
            raise BadResponse(f"a message with tool_calls must finish with 'tool_calls' (or 'length'); got "
                              f"{finish!r}")
        for i, call in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not call.get("id") or not function.get("name"):
                raise BadResponse(f"tool_calls[{i}] needs an id and a function name; got {str(call)[:120]}")
            try:
                arguments = json.loads(function.get("arguments", ""))
            except (TypeError, ValueError):
                raise BadResponse(f"tool_calls[{i}].function.arguments is not JSON: "
                                  f"{str(function.get('arguments'))[:80]!r}") from None
            if not isinstance(arguments, dict):
                raise BadResponse(f"tool_calls[{i}].function.arguments must be a JSON object")
    else:
        _text(message.get("content"), "choices[0].message.content")
        if finish not in ("stop", "length"):
            raise BadResponse(f"'choices[0].finish_reason' must be stop or length; got {finish!r}")
    prompt, completion = _usage(data.get("usage"))
    return ChatTurn(message, calls, finish, prompt, completion, str(data.get("id") or ""))


class SSEReader:
    """Splits a byte stream into server-sent-event ``data:`` payloads (events end with a blank line).

    Works on bytes so a multi-byte character split across two network reads is never decoded in halves.
    """

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += chunk.replace(b"\r\n", b"\n")
        *events, self._buffer = self._buffer.split(b"\n\n")
        payloads = []
        for event in events:
            data = [line[5:].lstrip() for line in event.split(b"\n") if line.startswith(b"data:")]
            if data:
                payloads.append(b"\n".join(data).decode("utf-8", "replace"))
        return payloads

    @property
    def leftover(self) -> bytes:
        """Bytes after the last complete event (non-empty means the stream was cut mid-event)."""
        return self._buffer


@dataclass
class StreamResult:
    """A validated chat stream with its client-side timings (seconds from the request start)."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float
    end_s: float
    chunk_times_s: list[float] = field(default_factory=list)  # every generated chunk, the first one included
    finish_reason: str = "stop"

    @property
    def itl_s(self) -> list[float]:
        """Gaps between consecutive generated chunks (empty for a one-chunk answer)."""
        times = self.chunk_times_s
        return [b - a for a, b in zip(times, times[1:], strict=False)]

    @property
    def mean_itl_s(self) -> float | None:
        gaps = self.itl_s
        return sum(gaps) / len(gaps) if gaps else None


def check_chat_stream(events: list[tuple[float, str]]) -> StreamResult:
    """Validate ``/v1/chat/completions`` SSE payloads ``(arrival seconds, data)`` (sent with include_usage).

    Expects chunks of ``chat.completion.chunk`` with one choice each, a finish reason, a final usage chunk with
    empty ``choices`` and ``data: [DONE]`` last. An ``{"error": ...}`` payload (timeout, engine failure) fails.
    """
    if not events:
        raise BadResponse("the stream ended before any event")
    if events[-1][1].strip() != "[DONE]":
        raise BadResponse("the stream did not end with 'data: [DONE]' (cut off?)")
    text, chunk_times, finish, usage = [], [], None, None
    for arrival, payload in events[:-1]:
        data = _parse(payload)
        if "error" in data:
            error = data["error"]
            message = error.get("message") if isinstance(error, dict) else error
            raise BadResponse(f"error in stream: {message}")
        if data.get("object") != "chat.completion.chunk":
            raise BadResponse(f"chunk 'object' must be 'chat.completion.chunk'; got {data.get('object')!r}")
        choices = data.get("choices")
        if not isinstance(choices, list):
            raise BadResponse(f"chunk 'choices' must be a list; got {choices!r}")
        if not choices:  # the usage chunk
            usage = data.get("usage")
            continue
        choice = choices[0]
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if not isinstance(delta, dict):
            raise BadResponse(f"chunk choice without a 'delta' object: {str(choice)[:120]}")
        content = delta.get("content") or ""
        if not isinstance(content, str):
            raise BadResponse(f"delta 'content' must be text; got {content!r}")
        reason = choice.get("finish_reason")
        # The role preamble (empty content, no finish) carries no token; everything after the first text does.
        if content or (reason and chunk_times):
            chunk_times.append(arrival)
        text.append(content)
        if reason:
            finish = reason
    joined = _text("".join(text), "streamed content")
    if finish not in ("stop", "length"):
        raise BadResponse(f"no chunk finished with stop or length (last finish_reason {finish!r})")
    if usage is None:
        raise BadResponse("no usage chunk although stream_options.include_usage was sent")
    prompt, completion = _usage(usage)
    text_chunks = sum(1 for t in text if t)
    if completion < text_chunks:
        raise BadResponse(f"usage.completion_tokens {completion} is below the {text_chunks} chunks with text")
    return StreamResult(joined, prompt, completion, ttft_s=chunk_times[0], end_s=events[-1][0],
                        chunk_times_s=chunk_times, finish_reason=finish)

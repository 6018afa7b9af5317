"""Running sequences: to completion (504 past the deadline, abort on disconnect) or as an SSE stream; usage blocks."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from serve import log
from serve.admission import Responder
from serve.engines.base import EngineDeadError, EngineError, EngineOutput, RequestFailedError
from serve.errors import ApiError, error_body
from serve.pumps import TIMEOUT_CANCEL, SequenceResult, SequenceSpec
from serve.schemas import StreamOptions
from serve.service import Service


async def _wait_disconnect(request: Request) -> None:
    """Return when the client goes away (the body was already read, so the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_to_completion(service: Service, request: Request, request_id: str,
                            specs: list[SequenceSpec], target: Responder) -> list[SequenceResult]:
    """Run every sequence to its end; 504 past the timeout; abort everything if the client disconnects."""
    results = [SequenceResult() for _ in specs]

    def sink(index: int, out: EngineOutput | BaseException) -> None:
        result = results[index]
        if isinstance(out, BaseException):
            result.error = out
            return
        result.text.append(out.text)
        result.tokens = out.num_generated_tokens
        result.token_ids.extend(out.token_ids)
        result.logprobs.extend(out.logprobs or [])
        if out.prompt_logprobs is not None:
            result.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            result.finish_reason, result.stop_reason = out.finish_reason, out.stop_reason

    pending = set(service.pumps.start(request_id, specs, sink, stream=False, target=target))
    label = target.name
    watcher = asyncio.create_task(_wait_disconnect(request))
    deadline = time.monotonic() + service.settings.request_timeout_s
    cancel_reason = None  # TIMEOUT_CANCEL: the unfinished sequences are recorded as timed out
    try:
        while pending:
            done, _ = await asyncio.wait(pending | {watcher}, timeout=deadline - time.monotonic(),
                                         return_when=asyncio.FIRST_COMPLETED)
            if watcher in done:
                service.metrics.rejected.labels(label, "client_disconnected").inc()
                raise ApiError(499, "the client closed the connection", code="client_closed")
            if not done:
                service.metrics.rejected.labels(label, "timeout").inc()
                cancel_reason = TIMEOUT_CANCEL
                raise ApiError(504, f"the request did not finish within {service.settings.request_timeout_s:g} s",
                               type="timeout_error", code="timeout")
            pending -= done
    finally:
        watcher.cancel()
        for task in pending:
            task.cancel(cancel_reason)
    for result in results:
        if result.error is not None:
            raise engine_failure(result.error)
    return results


def engine_failure(exc: BaseException) -> ApiError:
    if isinstance(exc, EngineDeadError):
        return ApiError(503, f"the engine is down: {exc}", type="service_unavailable", code="engine_dead")
    if isinstance(exc, RequestFailedError):
        return ApiError(500, str(exc), type="internal_error", code="request_failed")
    if isinstance(exc, EngineError):
        return ApiError(503, str(exc), type="service_unavailable", code="engine_error")
    log.exception("generation failed", exc_info=exc)
    return ApiError(500, f"generation failed: {type(exc).__name__}: {exc}", type="internal_error")


class _SSEResponse(StreamingResponse):
    """A stream that always cleans up: if the client vanishes before or during streaming, ``on_close`` runs."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None],
                 headers: dict[str, str] | None = None):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def stream_response(service: Service, request_id: str, specs: list[SequenceSpec], prompt_tokens: int,
                    chunk: Callable[[int, str, EngineOutput | None], dict | None], preamble: list[dict],
                    options: StreamOptions | None, base: dict, target: Responder) -> StreamingResponse:
    """SSE: ``preamble`` chunks, then one chunk per delta with text or a finish, optional usage, ``[DONE]``.

    ``options`` (``stream_options``, vLLM's rule): ``include_usage`` adds a last chunk (``base``: its id, object,
    created and model) with the request's usage; ``continuous_usage_stats``, only with it, puts ``usage`` on every
    chunk for its choice so far — the choice's prompt tokens and the tokens it has generated.
    """
    include_usage = bool(options is not None and options.include_usage)
    continuous_usage = include_usage and bool(options.continuous_usage_stats)
    queue: asyncio.Queue = asyncio.Queue()
    tasks = service.pumps.start(request_id, specs, lambda index, out: queue.put_nowait((index, out)), stream=True,
                                target=target)
    label = target.name
    deadline = time.monotonic() + service.settings.request_timeout_s
    state: dict[str, str | None] = {"cancel_reason": None}  # TIMEOUT_CANCEL: unfinished sequences timed out

    async def events() -> AsyncIterator[str]:
        remaining, completion_tokens = len(specs), [0] * len(specs)
        def with_usage(payload: dict, index: int) -> dict:
            if not continuous_usage:
                return payload
            return {**payload, "usage": usage_counts(len(specs[index].prompt_ids), completion_tokens[index])}

        for position, item in enumerate(preamble):
            yield sse(with_usage(item, position))
        while remaining:
            try:
                index, out = await asyncio.wait_for(queue.get(), timeout=max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                service.metrics.rejected.labels(label, "timeout").inc()
                state["cancel_reason"] = TIMEOUT_CANCEL
                err = ApiError(504, f"the request did not finish within {service.settings.request_timeout_s:g} s",
                               type="timeout_error", code="timeout")
                yield sse(error_body(err.message, err.type, code=err.code))
                break
            if isinstance(out, BaseException):
                err = engine_failure(out)
                yield sse(error_body(err.message, err.type, code=err.code))
                break
            completion_tokens[index] = out.num_generated_tokens
            if out.finished:
                remaining -= 1
            payload = chunk(index, out.text, out)
            if payload is not None:
                yield sse(with_usage(payload, index))
        else:
            if include_usage:
                yield sse({**base, "choices": [], "usage": usage_counts(prompt_tokens, sum(completion_tokens))})
        yield "data: [DONE]\n\n"

    def close() -> None:
        for task in tasks:  # no-op for finished pumps; aborts the rest (client gone, timeout, error)
            task.cancel(state["cancel_reason"])

    return _SSEResponse(events(), close, target.headers())


def usage_counts(prompt_tokens: int, completion_tokens: int) -> dict:
    """OpenAI's ``usage`` object."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def usage_block(prompt_tokens: int, results: list[SequenceResult]) -> dict:
    return usage_counts(prompt_tokens, sum(r.tokens for r in results))

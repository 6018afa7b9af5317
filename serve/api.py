"""The inference service: ``uvicorn serve.api:app --host 127.0.0.1 --port 8000``.

Serves ``VERL_SERVE_MODEL`` (default ``builtin:tiny-arith``) with an OpenAI-compatible API, a simple
``/generate``, Prometheus ``/metrics`` and ``/health``. Settings: ``serve/settings.py`` (env ``VERL_SERVE_*`` and
an optional ``serve.yaml``).

Request path: validate (pydantic; 400 in OpenAI's error shape) -> tokenize and check limits (400) -> admit
(bounded: more than ``max_batch_size + max_queue_size`` sequences in flight gives 429 + Retry-After) -> one pump
task per sequence reads the engine's delta stream (metrics are taken there) -> the handler assembles a JSON
response or an SSE stream. A timeout, a client that disconnects or a shutdown deadline cancels the pump tasks,
which aborts the sequences in the engine and frees their batch slots at once.

Shutdown: SIGTERM (under uvicorn's main thread) puts the service into draining: ``/health`` and new requests
answer 503, in-flight requests go on for up to ``drain_grace_s + shutdown_timeout_s`` and are then aborted, and
uvicorn stops once they are done.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve import __version__
from serve.engines import create_engine
from serve.engines.base import (
    Engine,
    EngineDeadError,
    EngineError,
    EngineOutput,
    EngineRequest,
    RequestFailedError,
    SamplingOptions,
)
from serve.logprobs import CompletionLogprobs, chat_logprobs, token_texts
from serve.metrics import CONTENT_TYPE, SequenceTimer, ServeMetrics
from serve.schemas import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    GenerateRequest,
    GenerateResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from serve.settings import ServeSettings, load_settings

# A child of uvicorn's logger: our lines appear in the server log with its format and level.
log = logging.getLogger("uvicorn.error.serve")
SEED_MODULUS = 2**63  # torch generators take 64-bit seeds; seed + i for n > 1 must stay in range


# ---------------------------------------------------------------- errors


class ApiError(Exception):
    """An error answered in OpenAI's shape; ``status`` 4xx for the client's fault, 5xx for ours."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}


def error_body(message: str, type: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse(error_body(exc.message, exc.type, exc.param, exc.code), status_code=exc.status,
                        headers=exc.headers)


# Documented on every generation route so clients (and the schema fuzzer) know the error shape.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": text}
    for code, text in {400: "Invalid request (malformed body, wrong types, limits, unsupported parameters)",
                       401: "Missing or wrong API key", 404: "Unknown model", 429: "Queue full (see Retry-After)",
                       503: "Loading, draining or engine down", 504: "Request timed out"}.items()
}
SSE_DOC = {"description": "JSON, or with `stream: true` server-sent events ending in `data: [DONE]`",
           "content": {"text/event-stream": {}}}


# ---------------------------------------------------------------- service state


@dataclass
class SequenceResult:
    """What one sequence produced, assembled from its deltas."""

    text: list[str] = field(default_factory=list)
    tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: BaseException | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # TokenLogprob per generated token, when asked for
    prompt_logprobs: list | None = None  # TokenLogprob | None per prompt token, when asked for


@dataclass
class SequenceSpec:
    index: int  # the choice index in the response
    prompt_index: int
    prompt_ids: list[int]
    sampling: SamplingOptions


class Service:
    """Engine lifecycle, admission control and the sequence pumps shared by every endpoint."""

    def __init__(self, settings: ServeSettings):
        self.settings = settings
        self.model_name = settings.model_name()
        self.metrics = ServeMetrics(self.model_name, version=__version__)
        self.engine: Engine | None = None
        self.status = "loading"
        self.detail: str | None = "the model is loading"
        self.capacity = settings.max_batch_size + settings.max_queue_size
        self.in_flight = 0
        self.created = int(time.time())
        self.pumps: set[asyncio.Task] = set()
        self._abort_timer: asyncio.TimerHandle | None = None
        self.metrics.bind_gauges(
            running=lambda: self.engine.num_running if self.engine else 0,
            waiting=lambda: self.engine.num_waiting if self.engine else 0,
            healthy=lambda: 1.0 if self.health()[0] == "ok" else 0.0,
        )

    # ------------------------------------------------------------ lifecycle

    def announce(self) -> None:
        """One prominent line naming the model and who chose it, so the built-in default is never served silently."""
        source = self.settings.model_source
        if self.settings.config_file is not None:
            log.warning("verl serve: settings from %s (then VERL_SERVE_* env vars)", self.settings.config_file)
        if source == "default":
            log.warning("verl serve: no model configured; serving the built-in %s (set VERL_SERVE_MODEL=<export dir> "
                        "or model: in serve.yaml to serve yours)", self.settings.model)
        else:
            log.warning("verl serve: serving %s (from %s) as '%s'", self.settings.model, source, self.model_name)

    async def load(self) -> None:
        self.announce()
        try:
            engine = await asyncio.to_thread(create_engine, self.settings)
            await engine.start()
        except Exception as exc:
            self.status, self.detail = "dead", f"the model failed to load: {exc}"
            log.error("verl serve: %s", self.detail)
            raise
        self.engine = engine
        self.metrics.set_engine(engine.name, __version__)
        if self.status == "loading":
            self.status, self.detail = "ok", None
        log.info("verl serve: %s ready on the %s engine (context %d tokens)", self.model_name, engine.name,
                 engine.max_model_len)

    def health(self) -> tuple[str, str | None]:
        if self.status == "ok" and self.engine is not None and not self.engine.is_healthy():
            self.status, self.detail = "dead", "the engine worker stopped"
        return self.status, self.detail

    def begin_drain(self) -> None:
        """Refuse new work; abort what is still running after ``drain_grace_s + shutdown_timeout_s``."""
        if self.status == "draining":
            return
        if self.status in ("ok", "loading"):
            self.status, self.detail = "draining", "the server is shutting down"
        deadline = self.settings.drain_grace_s + self.settings.shutdown_timeout_s
        with contextlib.suppress(RuntimeError):
            self._abort_timer = asyncio.get_running_loop().call_later(deadline, self.abort_all)

    def abort_all(self) -> None:
        for task in list(self.pumps):
            task.cancel()

    async def shutdown(self) -> None:
        self.begin_drain()
        if self.engine is not None:
            await self.engine.shutdown(self.settings.shutdown_timeout_s)
        self.abort_all()

    # ------------------------------------------------------------ admission

    def ready_engine(self) -> Engine:
        status, detail = self.health()
        if status != "ok" or self.engine is None:
            self.metrics.rejected.labels(self.model_name, status).inc()
            raise ApiError(503, f"service unavailable: {detail}", type="service_unavailable", code=status,
                           headers={"Retry-After": str(self.settings.retry_after_s)})
        return self.engine

    def admit(self, sequences: int) -> None:
        """Reserve ``sequences`` slots or refuse: the queue never grows past ``max_queue_size``."""
        if sequences > self.capacity:
            raise ApiError(400, f"the request needs {sequences} sequences (prompts x n) but this server holds at "
                           f"most {self.capacity}; split it", param="n")
        if self.in_flight + sequences > self.capacity:
            self.metrics.rejected.labels(self.model_name, "queue_full").inc()
            raise ApiError(429, f"the server is at capacity ({self.in_flight} sequences in flight, limit "
                           f"{self.capacity}); retry later", type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(self.settings.retry_after_s)})
        self.in_flight += sequences

    def start_pumps(self, request_id: str, specs: list[SequenceSpec],
                    sink: Callable[[int, EngineOutput | BaseException], None], stream: bool) -> list[asyncio.Task]:
        """One task per sequence, reading the engine stream and passing each output to ``sink``."""
        engine = self.engine
        arrival = time.perf_counter()
        tasks = []
        for spec in specs:
            timer = SequenceTimer(self.metrics, arrival, len(spec.prompt_ids))
            req = EngineRequest(f"{request_id}-{spec.index}", spec.prompt_ids, spec.sampling, arrival, stream)
            task = asyncio.create_task(self._pump(engine, req, spec.index, timer, sink))
            self.pumps.add(task)
            task.add_done_callback(self.pumps.discard)
            tasks.append(task)
        return tasks

    async def _pump(self, engine: Engine, req: EngineRequest, index: int, timer: SequenceTimer,
                    sink: Callable[[int, EngineOutput | BaseException], None]) -> None:
        finish, produced = "abort", 0
        try:
            stream = engine.generate(req)
            try:
                async for out in stream:
                    timer.on_output(time.perf_counter(), len(out.token_ids), out.scheduled_time, out.token_times)
                    produced = out.num_generated_tokens
                    sink(index, out)
                    if out.finished:
                        finish = out.finish_reason
            finally:
                await stream.aclose()  # aborts the sequence in the engine if it is still running
        except asyncio.CancelledError:
            # Timeout, disconnect or shutdown deadline: the consumer (if any) sees an aborted sequence.
            sink(index, EngineOutput("", [], produced, finish_reason="abort"))
            raise
        except Exception as exc:
            sink(index, exc)
        finally:
            self.in_flight -= 1
            timer.on_finish(time.perf_counter(), finish)


def _service(request: Request) -> Service:
    return request.app.state.service


# ---------------------------------------------------------------- auth

_bearer = HTTPBearer(auto_error=False, description="Needed only when the server sets VERL_SERVE_API_KEY.")


def check_bearer(settings: ServeSettings, given: str) -> None:
    """Raise the 401 unless ``given`` (the bearer token, "" when absent) is the configured key (constant time)."""
    key = settings.api_key
    if key is not None and not secrets.compare_digest(given.encode(), key.get_secret_value().encode()):
        raise ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                       type="authentication_error", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


async def require_api_key(request: Request,
                          credentials: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> None:
    # EdgeGuard already checked the key before the body was read; this keeps the OpenAPI security scheme.
    check_bearer(_service(request).settings, credentials.credentials if credentials is not None else "")


# ---------------------------------------------------------------- request preparation


def _check_unsupported(body: CompletionRequest | ChatCompletionRequest) -> None:
    """Parameters of the OpenAI API we accept only at their neutral value: say so instead of ignoring them."""
    problems: dict[str, bool] = {}
    if isinstance(body, CompletionRequest):
        problems.update(best_of=(body.best_of or 1) > 1, suffix=body.suffix is not None)
    else:
        if body.top_logprobs and not body.logprobs:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        problems.update(
            tools=bool(body.tools),
            response_format=body.response_format not in (None, {"type": "text"}),
            tool_choice=body.tool_choice not in (None, "none", "auto"),
        )
    for name, bad in problems.items():
        if bad:
            raise ApiError(400, f"'{name}' is not supported by this server; leave it unset", param=name,
                           code="unsupported_parameter")
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "'stream_options' is only allowed together with 'stream': true", param="stream_options")


def _check_model(service: Service, model: str | None) -> None:
    if model is not None and model != service.model_name:
        raise ApiError(404, f"the model '{model}' does not exist; this server serves '{service.model_name}' "
                       "(see /v1/models)", type="invalid_request_error", param="model", code="model_not_found")


# No tokenizer packs more characters than this into one token on ordinary text: a prompt longer than the context
# times this is rejected by its length alone, before the tokenizer spends seconds on it.
MAX_CHARS_PER_TOKEN = 32


def _encode_texts(engine: Engine, texts: list[str], add_special_tokens: bool = True,
                  param: str = "prompt") -> list[list[int]]:
    """Token ids of ``texts``. Runs in a worker thread (``asyncio.to_thread``): never on the event loop."""
    if not texts:
        return []
    limit = engine.max_model_len * MAX_CHARS_PER_TOKEN
    longest = max(len(t) for t in texts)
    if longest > limit:
        raise ApiError(400, f"the prompt has {longest} characters; this model's context is {engine.max_model_len} "
                       f"tokens, so at most {limit} characters are looked at", param=param,
                       code="context_length_exceeded")
    return [list(ids) for ids in engine.tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]]


def _completion_prompts(engine: Engine, prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        return _encode_texts(engine, [prompt])
    if not prompt:
        raise ApiError(400, "'prompt' must not be empty", param="prompt")
    if all(isinstance(p, str) for p in prompt):
        return _encode_texts(engine, list(prompt))
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return [list(p) for p in prompt]


def _echo_texts(engine: Engine, prompt: Any, prompts: list[list[int]]) -> list[str]:
    """What ``echo`` repeats for each prompt: the text as sent, or the decoded ids (special tokens included) when
    ids were sent."""
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    # Special tokens stay: logprobs.tokens lists them, and text_offset must index into this text.
    return [engine.tokenizer.decode(ids, skip_special_tokens=False) for ids in prompts]


def _chat_prompt(engine: Engine, messages: list, add_generation_prompt: bool) -> list[int]:
    tokenizer = engine.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, "this model has no chat template; use /v1/completions with a plain prompt",
                       param="messages")
    conversation = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]
    try:
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                             tokenize=False)
    except Exception as exc:  # jinja TemplateError / raise_exception in the template: the messages are at fault
        raise ApiError(400, f"the chat template rejected the messages: {exc}", param="messages") from None
    # The template already contains the special tokens (bos, role markers); do not add them twice.
    return _encode_texts(engine, [text], add_special_tokens=False, param="messages")[0]


def _plan_tokens(service: Service, engine: Engine, prompts: list[list[int]], requested: int | None,
                 param: str, prompt_param: str) -> int:
    """Check prompt lengths and token ids; return the ``max_tokens`` every sequence gets."""
    settings, context = service.settings, engine.max_model_len
    prompt_limit = min(settings.max_prompt_tokens or context - 1, context - 1)
    vocab = len(engine.tokenizer)
    for ids in prompts:
        if not ids:
            raise ApiError(400, "the prompt is empty after tokenization", param=prompt_param)
        if len(ids) > prompt_limit:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; this server accepts at most {prompt_limit}",
                           param=prompt_param, code="context_length_exceeded")
        bad = [t for t in ids if t >= vocab]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is outside the vocabulary (size {vocab})", param=prompt_param)
    longest = max(len(ids) for ids in prompts)
    if requested is None:
        return max(1, min(settings.default_max_tokens, settings.max_output_tokens, context - longest))
    if requested > settings.max_output_tokens:
        raise ApiError(400, f"'{param}' is {requested}; this server allows at most {settings.max_output_tokens}",
                       param=param)
    if longest + requested > context:
        raise ApiError(400, f"this model's context is {context} tokens, but the request needs {longest + requested} "
                       f"({longest} in the prompt, {requested} in the completion); lower '{param}' or shorten the "
                       "prompt", param=param, code="context_length_exceeded")
    return requested


def _logit_bias(engine: Engine, given: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's ``{"token id": bias}`` -> ``{id: bias}``, each id in the vocabulary and each bias in [-100, 100]."""
    out: dict[int, float] = {}
    vocab = len(engine.tokenizer)
    # ASCII digits only: '²' passes str.isdigit() but not int(). Every bad key is named, not just the first.
    bad = [key for key in (given or {}) if not (key.isascii() and key.isdigit()) or int(key) >= vocab]
    if bad:
        named = ", ".join(repr(k) for k in bad[:10]) + (f" and {len(bad) - 10} more" if len(bad) > 10 else "")
        raise ApiError(400, f"logit_bias key(s) {named} are not token ids of this model (0..{vocab - 1})",
                       param="logit_bias")
    for key, bias in (given or {}).items():
        if not -100.0 <= bias <= 100.0:
            raise ApiError(400, f"logit_bias for token {key} is {bias}; biases must be within [-100, 100]",
                           param="logit_bias")
        out[int(key)] = float(bias)
    return out


def _sampling(body: Any, max_tokens: int, seed: int | None, logit_bias: dict[int, float]) -> SamplingOptions:
    temperature = body.temperature if body.temperature > 1e-5 else 0.0
    if isinstance(body, CompletionRequest):
        logprobs = body.logprobs
        prompt_logprobs = body.logprobs if body.echo else None
    else:
        logprobs, prompt_logprobs = (body.top_logprobs or 0) if body.logprobs else None, None
    # top_k beyond any vocabulary (1e29 arrives as a huge int) keeps every token, as -1 does; never an overflow.
    top_k = body.top_k if 0 < body.top_k < 2**31 else -1
    return SamplingOptions(max_tokens=max_tokens, temperature=temperature, top_p=body.top_p,
                           top_k=top_k, seed=seed, stop=list(body.stop or []),
                           stop_token_ids=list(body.stop_token_ids or []), ignore_eos=body.ignore_eos,
                           presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                           repetition_penalty=body.repetition_penalty, logit_bias=logit_bias, logprobs=logprobs,
                           prompt_logprobs=prompt_logprobs)


def _specs(engine: Engine, prompts: list[list[int]], body: Any, max_tokens: int) -> list[SequenceSpec]:
    specs = []
    logit_bias = _logit_bias(engine, body.logit_bias)
    for p, ids in enumerate(prompts):
        for j in range(body.n):
            seed = None if body.seed is None else (body.seed + j) % SEED_MODULUS
            specs.append(SequenceSpec(p * body.n + j, p, ids, _sampling(body, max_tokens, seed, logit_bias)))
    return specs


# ---------------------------------------------------------------- running requests


async def _wait_disconnect(request: Request) -> None:
    """Return when the client goes away (the body was already read, so the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_to_completion(service: Service, request: Request, request_id: str,
                            specs: list[SequenceSpec]) -> list[SequenceResult]:
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

    pending = set(service.start_pumps(request_id, specs, sink, stream=False))
    watcher = asyncio.create_task(_wait_disconnect(request))
    deadline = time.monotonic() + service.settings.request_timeout_s
    try:
        while pending:
            done, _ = await asyncio.wait(pending | {watcher}, timeout=deadline - time.monotonic(),
                                         return_when=asyncio.FIRST_COMPLETED)
            if watcher in done:
                service.metrics.rejected.labels(service.model_name, "client_disconnected").inc()
                raise ApiError(499, "the client closed the connection", code="client_closed")
            if not done:
                service.metrics.rejected.labels(service.model_name, "timeout").inc()
                raise ApiError(504, f"the request did not finish within {service.settings.request_timeout_s:g} s",
                               type="timeout_error", code="timeout")
            pending -= done
    finally:
        watcher.cancel()
        for task in pending:
            task.cancel()
    for result in results:
        if result.error is not None:
            raise _engine_failure(result.error)
    return results


def _engine_failure(exc: BaseException) -> ApiError:
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

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def stream_response(service: Service, request_id: str, specs: list[SequenceSpec], prompt_tokens: int,
                    chunk: Callable[[int, str, EngineOutput | None], dict | None],
                    preamble: list[dict], include_usage: bool,
                    usage_chunk: Callable[[dict], dict]) -> StreamingResponse:
    """SSE: ``preamble`` chunks, then one chunk per delta with text or a finish, optional usage, ``[DONE]``."""
    queue: asyncio.Queue = asyncio.Queue()
    tasks = service.start_pumps(request_id, specs, lambda index, out: queue.put_nowait((index, out)), stream=True)
    deadline = time.monotonic() + service.settings.request_timeout_s

    async def events() -> AsyncIterator[str]:
        remaining, completion_tokens = len(specs), [0] * len(specs)
        for item in preamble:
            yield sse(item)
        while remaining:
            try:
                index, out = await asyncio.wait_for(queue.get(), timeout=max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                service.metrics.rejected.labels(service.model_name, "timeout").inc()
                err = ApiError(504, f"the request did not finish within {service.settings.request_timeout_s:g} s",
                               type="timeout_error", code="timeout")
                yield sse(error_body(err.message, err.type, code=err.code))
                break
            if isinstance(out, BaseException):
                err = _engine_failure(out)
                yield sse(error_body(err.message, err.type, code=err.code))
                break
            completion_tokens[index] = out.num_generated_tokens
            if out.finished:
                remaining -= 1
            payload = chunk(index, out.text, out)
            if payload is not None:
                yield sse(payload)
        else:
            if include_usage:
                total = sum(completion_tokens)
                yield sse(usage_chunk({"prompt_tokens": prompt_tokens, "completion_tokens": total,
                                       "total_tokens": prompt_tokens + total}))
        yield "data: [DONE]\n\n"

    def close() -> None:
        for task in tasks:
            task.cancel()  # no-op for finished pumps; aborts the rest (client gone, timeout, error)

    return _SSEResponse(events(), close)


# ---------------------------------------------------------------- middleware


class HTTPMetricsMiddleware:
    """Counts HTTP requests by (known) path and status; a pure ASGI middleware so streaming is untouched."""

    def __init__(self, app: ASGIApp, metrics: ServeMetrics, paths: Callable[[], set[str]]):
        self.app, self.metrics, self.paths = app, metrics, paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = {"code": 500}

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            path = scope["path"] if scope["path"] in self.paths() else "other"
            self.metrics.http.labels(path, scope["method"], str(status["code"])).inc()


class EdgeGuard:
    """What must happen before a POST body is read (FastAPI reads it before any dependency runs): the API key
    check, and the body-size limit — a declared ``Content-Length`` over ``max_body_bytes`` is refused at once,
    a chunked body as soon as it passes the limit. Both answer in OpenAI's error shape (401, 413)."""

    def __init__(self, app: ASGIApp, settings: ServeSettings):
        self.app, self.settings = app, settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope["headers"]}
        limit = self.settings.max_body_bytes
        try:
            auth = headers.get(b"authorization", b"").decode("latin-1")
            check_bearer(self.settings, auth[7:].strip() if auth[:7].lower() == "bearer " else "")
            declared = headers.get(b"content-length")
            if declared is not None and declared.isdigit() and int(declared) > limit:
                raise _too_large(limit)
        except ApiError as exc:
            await error_response(exc)(scope, receive, send)
            return
        received, body_done = 0, False
        body_timeout = self.settings.body_timeout_s

        async def counting_receive() -> Message:
            nonlocal received, body_done
            if body_done:  # after the body, receive() waits for the disconnect: no deadline there
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), body_timeout)
            except TimeoutError:  # a client that stops sending its body must not hold a slot forever
                raise StarletteHTTPException(408, detail=(
                    f"the request body stopped arriving for {body_timeout:g} s (the body_timeout_s setting)")) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if received > limit:  # an HTTPException passes FastAPI's body parsing untouched -> our handler
                    raise StarletteHTTPException(413, detail=_too_large(limit).message)
            else:
                body_done = True
            return message

        await self.app(scope, counting_receive, send)


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than this server accepts ({limit} bytes; the "
                    "max_body_bytes setting)", code="request_too_large")


# ---------------------------------------------------------------- the app


def _install_drain_hook(service: Service) -> Callable[[], None]:
    """Chain SIGTERM/SIGINT so the service drains (503) before uvicorn stops; returns an uninstaller."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None  # signals are only delivered to the main thread (uvicorn run from a thread: tests)
    loop = asyncio.get_running_loop()
    previous: dict[int, Any] = {}

    def on_signal(signum: int, frame: Any) -> None:
        service.begin_drain()
        chained = previous.get(signum)
        if callable(chained):
            # Tell uvicorn to stop after the grace period: a load balancer sees the 503s first.
            loop.call_later(service.settings.drain_grace_s, chained, signum, frame)

    def handler(signum: int, frame: Any) -> None:
        # Signal handlers interrupt the loop between bytecodes; hand the work to the loop itself.
        loop.call_soon_threadsafe(on_signal, signum, frame)

    for sig in (signal.SIGTERM, signal.SIGINT):
        previous[sig] = signal.getsignal(sig)
        signal.signal(sig, handler)

    def uninstall() -> None:
        for sig, old in previous.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, old)

    return uninstall


def create_app(settings: ServeSettings | None = None) -> FastAPI:
    """Build the FastAPI app for ``settings`` (default: env + serve.yaml). The model loads at startup."""
    settings = settings or load_settings()
    service = Service(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        uninstall = _install_drain_hook(service)
        loader = asyncio.create_task(service.load())
        if not settings.load_in_background:
            await loader  # a load failure stops startup with its error
        else:
            loader.add_done_callback(lambda t: t.cancelled() or t.exception())  # reported via /health + log
        try:
            yield
        finally:
            loader.cancel()
            await service.shutdown()
            uninstall()

    # With an API key the interactive docs and the schema are off (they map the attack surface for anyone).
    docs = {} if settings.api_key is None else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(
        **docs,
        title="verl suite inference service",
        version=__version__,
        description="OpenAI-compatible completions and chat, a simple /generate, Prometheus metrics.",
        lifespan=lifespan,
    )
    app.state.service = service
    if settings.cors_allow_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_allow_origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    app.add_middleware(EdgeGuard, settings=settings)
    app.add_middleware(HTTPMetricsMiddleware, metrics=service.metrics,
                       paths=lambda: {route.path for route in app.routes})
    _add_error_handlers(app)
    _add_routes(app, service)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems, first = [], None
        for error in exc.errors():
            loc = [str(p) for p in error.get("loc", ()) if p != "body"]
            name = ".".join(loc) or "body"
            first = first or name
            problems.append(f"{name}: {error.get('msg')}")
        message = "invalid request: " + "; ".join(problems[:5]) + (" ..." if len(problems) > 5 else "")
        # 400, as OpenAI answers (the official client raises BadRequestError); FastAPI's default would be 422.
        return JSONResponse(error_body(message, "invalid_request_error", first, "invalid_value"), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        # OpenAI's schema has a string or null `code`, never the HTTP status.
        code = {404: "not_found", 408: "request_timeout", 413: "request_too_large"}.get(exc.status_code)
        headers = dict(getattr(exc, "headers", None) or {})
        if exc.status_code == 408:
            headers["Connection"] = "close"  # the rest of that body may still come: never read it as a new request
        return JSONResponse(error_body(str(exc.detail), kind, code=code), status_code=exc.status_code,
                            headers=headers or None)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path, exc_info=exc)
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "internal_error"), status_code=500)


def _add_routes(app: FastAPI, service: Service) -> None:
    protected = [Depends(require_api_key)]

    # ------------------------------------------------------------ operational

    @app.get("/health", response_model=HealthResponse, responses={503: {"model": HealthResponse}}, tags=["ops"])
    async def health() -> JSONResponse:
        """200 when serving; 503 while loading, draining or when the engine died (no API key needed)."""
        status, detail = service.health()
        engine = service.engine.name if service.engine else None
        body = HealthResponse(status=status, engine=engine, detail=detail, model=service.model_name,
                              model_source=service.settings.model_source).model_dump()
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    # /metrics needs the key when one is set, unless metrics_public (a scraper that cannot send headers).
    metrics_guard = [] if service.settings.metrics_public else protected

    @app.get("/metrics", tags=["ops"], response_class=Response, dependencies=metrics_guard,
             responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}})
    async def metrics() -> Response:
        """Prometheus metrics (``verl:`` prefix, vLLM's names)."""
        return Response(service.metrics.exposition(), media_type=CONTENT_TYPE)

    @app.get("/version", response_model=VersionResponse, tags=["ops"], dependencies=protected)
    async def version() -> VersionResponse:
        return VersionResponse(version=__version__, engine=service.engine.name if service.engine else "loading",
                               model=service.model_name)

    @app.get("/v1/models", response_model=ModelList, dependencies=protected, responses=ERROR_RESPONSES,
             tags=["openai"])
    async def models() -> dict:
        engine = service.ready_engine()
        return {"object": "list", "data": [{
            "id": service.model_name, "object": "model", "created": service.created, "owned_by": "verl-suite",
            "root": service.model_name, "max_model_len": engine.max_model_len,  # never a local path
            "source": service.settings.model_source}]}

    @app.get("/v1/models/{model_id}", response_model=ModelCard, dependencies=protected, responses=ERROR_RESPONSES,
             tags=["openai"])
    async def model(model_id: str) -> dict:
        """One served model by id (OpenAI's retrieve-model); an unknown id is a 404."""
        if model_id != service.model_name:
            raise ApiError(404, f"The model '{model_id}' does not exist", type="not_found_error", param="model",
                           code="model_not_found")
        return (await models())["data"][0]

    # ------------------------------------------------------------ generation

    @app.post("/v1/completions", dependencies=protected, tags=["openai"],
              responses={200: {"model": CompletionResponse, **SSE_DOC}, **ERROR_RESPONSES})
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """OpenAI-compatible text completion (``prompt`` may be text, texts, token ids or lists of them)."""
        _check_unsupported(body)
        _check_model(service, body.model)
        engine = service.ready_engine()
        prompts = await asyncio.to_thread(_completion_prompts, engine, body.prompt)
        if len(prompts) > service.settings.max_prompts_per_request:
            raise ApiError(400, f"{len(prompts)} prompts in one request; the limit is "
                           f"{service.settings.max_prompts_per_request}", param="prompt")
        if body.n > service.settings.max_n:
            raise ApiError(400, f"'n' is {body.n}; this server allows at most {service.settings.max_n}", param="n")
        max_tokens = _plan_tokens(service, engine, prompts, body.max_tokens, "max_tokens", "prompt")
        specs = _specs(engine, prompts, body, max_tokens)
        prompt_tokens = sum(len(p) for p in prompts)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        echo_texts = _echo_texts(engine, body.prompt, prompts) if body.echo else None
        text_of = token_texts(lambda ids: engine.tokenizer.decode(ids, skip_special_tokens=False))
        service.admit(len(specs))
        if body.stream:
            started: dict[int, CompletionLogprobs] = {}

            def chunk(index: int, text: str, out: EngineOutput | None) -> dict | None:
                spec = specs[index]
                first = index not in started
                logprobs = started.setdefault(index, CompletionLogprobs(text_of))
                block = None
                if echo_texts is not None and first:
                    text = echo_texts[spec.prompt_index] + text
                    if body.logprobs is not None and out is not None:
                        block = logprobs.block(spec.prompt_ids, out.prompt_logprobs or [None] * len(spec.prompt_ids))
                if out is not None and out.logprobs:
                    more = logprobs.block(out.token_ids, out.logprobs)
                    block = more if block is None else {k: block[k] + more[k] for k in block}
                if not text and block is None and not (out and out.finished):
                    return None
                choice = {"index": index, "text": text, "logprobs": block,
                          "finish_reason": out.finish_reason if out else None}
                if out is not None and out.finished:
                    choice["stop_reason"] = out.stop_reason
                return {"id": request_id, "object": "text_completion", "created": created,
                        "model": service.model_name, "choices": [choice]}

            usage_chunk = _usage_chunk(request_id, "text_completion", created, service.model_name)
            include = bool(body.stream_options and body.stream_options.include_usage)
            return stream_response(service, request_id, specs, prompt_tokens, chunk, [], include, usage_chunk)
        results = await run_to_completion(service, request, request_id, specs)
        choices = []
        for spec, r in zip(specs, results, strict=True):
            text, block = "".join(r.text), None
            if body.logprobs is not None:
                ids, entries = r.token_ids, r.logprobs
                if echo_texts is not None:
                    ids = [*spec.prompt_ids, *ids]
                    entries = [*(r.prompt_logprobs or [None] * len(spec.prompt_ids)), *entries]
                block = CompletionLogprobs(text_of).block(ids, entries)
            if echo_texts is not None:
                text = echo_texts[spec.prompt_index] + text
            choices.append({"index": spec.index, "text": text, "logprobs": block, "finish_reason": r.finish_reason,
                            "stop_reason": r.stop_reason})
        return JSONResponse({"id": request_id, "object": "text_completion", "created": created,
                             "model": service.model_name, "choices": choices,
                             "usage": _usage(prompt_tokens, results)})

    @app.post("/v1/chat/completions", dependencies=protected, tags=["openai"],
              responses={200: {"model": ChatCompletionResponse, **SSE_DOC}, **ERROR_RESPONSES})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """OpenAI-compatible chat completion (the model's chat template is applied)."""
        _check_unsupported(body)
        _check_model(service, body.model)
        engine = service.ready_engine()
        if body.n > service.settings.max_n:
            raise ApiError(400, f"'n' is {body.n}; this server allows at most {service.settings.max_n}", param="n")
        prompt = await asyncio.to_thread(_chat_prompt, engine, body.messages, body.add_generation_prompt)
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = _plan_tokens(service, engine, [prompt], requested, param, "messages")
        specs = _specs(engine, [prompt], body, max_tokens)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        text_of = token_texts(lambda ids: engine.tokenizer.decode(ids, skip_special_tokens=False))
        service.admit(len(specs))
        if body.stream:
            base = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                    "model": service.model_name}

            def chunk(index: int, text: str, out: EngineOutput | None) -> dict | None:
                block = chat_logprobs(out.logprobs, text_of) if out is not None and out.logprobs else None
                if not text and block is None and not (out and out.finished):
                    return None
                finished = out is not None and out.finished
                choice = {"index": index, "delta": {"content": text} if text else {}, "logprobs": block,
                          "finish_reason": out.finish_reason if finished else None}
                if finished:
                    choice["stop_reason"] = out.stop_reason
                return {**base, "choices": [choice]}

            preamble = [{**base, "choices": [{"index": s.index, "delta": {"role": "assistant", "content": ""},
                                               "logprobs": None, "finish_reason": None}]} for s in specs]
            usage_chunk = _usage_chunk(request_id, "chat.completion.chunk", created, service.model_name)
            include = bool(body.stream_options and body.stream_options.include_usage)
            return stream_response(service, request_id, specs, len(prompt), chunk, preamble, include, usage_chunk)
        results = await run_to_completion(service, request, request_id, specs)
        choices = [{"index": i, "message": {"role": "assistant", "content": "".join(r.text), "refusal": None},
                    "logprobs": chat_logprobs(r.logprobs, text_of) if body.logprobs else None,
                    "finish_reason": r.finish_reason, "stop_reason": r.stop_reason} for i, r in enumerate(results)]
        return JSONResponse({"id": request_id, "object": "chat.completion", "created": created,
                             "model": service.model_name, "choices": choices,
                             "usage": _usage(len(prompt), results)})

    @app.post("/generate", response_model=GenerateResponse, dependencies=protected, responses=ERROR_RESPONSES,
              tags=["simple"])
    async def generate(body: GenerateRequest, request: Request) -> JSONResponse:
        """The tutorial-style endpoint: raw prompt in, generated text out (greedy unless ``temperature`` > 0)."""
        engine = service.ready_engine()
        prompts = await asyncio.to_thread(_encode_texts, engine, [body.prompt])
        max_tokens = _plan_tokens(service, engine, prompts, body.max_new_tokens, "max_new_tokens", "prompt")
        temperature = body.temperature if body.temperature > 1e-5 else 0.0
        sampling = SamplingOptions(max_tokens=max_tokens, temperature=temperature, top_p=body.top_p, seed=body.seed,
                                   stop=list(body.stop or []))
        service.admit(1)
        request_id = f"gen-{uuid.uuid4().hex}"
        [result] = await run_to_completion(service, request, request_id, [SequenceSpec(0, 0, prompts[0], sampling)])
        return JSONResponse({"response": "".join(result.text), "finish_reason": result.finish_reason,
                             "prompt_tokens": len(prompts[0]), "completion_tokens": result.tokens})

    # ------------------------------------------------------------ tokenizer utilities

    @app.post("/tokenize", response_model=TokenizeResponse, dependencies=protected, responses=ERROR_RESPONSES,
              tags=["utility"])
    async def tokenize(body: TokenizeRequest) -> dict:
        """Token ids of a raw prompt, or of chat messages after the chat template."""
        engine = service.ready_engine()
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give exactly one of 'prompt' or 'messages'", param="prompt")
        if body.messages is not None:
            if not body.messages:
                raise ApiError(400, "'messages' must not be empty", param="messages")
            ids = await asyncio.to_thread(_chat_prompt, engine, body.messages, body.add_generation_prompt)
        else:
            ids = (await asyncio.to_thread(_encode_texts, engine, [body.prompt]))[0] if body.prompt else []
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @app.post("/detokenize", response_model=DetokenizeResponse, dependencies=protected, responses=ERROR_RESPONSES,
              tags=["utility"])
    async def detokenize(body: DetokenizeRequest) -> dict:
        engine = service.ready_engine()
        vocab = len(engine.tokenizer)
        bad = [t for t in body.tokens if t >= vocab]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is outside the vocabulary (size {vocab})", param="tokens")
        return {"prompt": engine.tokenizer.decode(body.tokens)}


def _usage(prompt_tokens: int, results: list[SequenceResult]) -> dict:
    completion = sum(r.tokens for r in results)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}


def _usage_chunk(request_id: str, obj: str, created: int, model: str) -> Callable[[dict], dict]:
    def make(usage: dict) -> dict:
        return {"id": request_id, "object": obj, "created": created, "model": model, "choices": [], "usage": usage}

    return make


def __getattr__(name: str) -> Any:
    """``serve.api.app`` is built on first access, so importing this module reads no settings and loads nothing."""
    if name == "app":
        application = create_app()
        globals()["app"] = application
        return application
    raise AttributeError(f"module 'serve.api' has no attribute {name!r}")


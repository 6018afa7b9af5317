"""The service's state and the errors and auth every route shares: ``Service`` (engine, limits, admission, health,
drain), ``ApiError`` in OpenAI's error shape, and the API-key check."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, Request
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from serve import __version__
from serve.engines import create_engine
from serve.engines.base import (
    Engine,
    EngineOutput,
    EngineRequest,
    SamplingOptions,
)
from serve.metrics import SequenceTimer, ServeMetrics
from serve.schemas import (
    ErrorResponse,
)
from serve.settings import ServeSettings

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


def service_of(request: Request) -> Service:
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
    check_bearer(service_of(request).settings, credentials.credentials if credentials is not None else "")



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
import signal
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve import __version__, log
from serve.admin import ADMIN_PREFIX, admin_router, check_admin_key, multiple_workers_problem, serving_processes
from serve.auth import check_bearer
from serve.errors import ApiError, error_body, error_response
from serve.routes import add_routes
from serve.service import Service
from serve.settings import ServeSettings, load_settings
from serve.weight_updates import WEIGHT_PATHS, weight_router


class HTTPMetricsMiddleware:
    """Counts HTTP requests by (known) path and status, and names on every response the models-and-routes version
    it was served at (``X-Verl-Config-Version``), so a client or a test sees when a change reached the replica that
    answered; a pure ASGI middleware so streaming is untouched."""

    def __init__(self, app: ASGIApp, service: Service, paths: Callable[[], set[str]]):
        self.app, self.service, self.paths = app, service, paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = {"code": 500}
        version = str(self.service.lifecycle.config_version).encode()  # the version when the request came in

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-verl-config-version", version)]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            path = scope["path"] if scope["path"] in self.paths() else "other"
            self.service.metrics.http.labels(path, scope["method"], str(status["code"])).inc()


class EdgeGuard:
    """What must happen before a request body is read (FastAPI reads it before any dependency runs): the API key
    check (the admin key on /admin paths), and the body-size limit — a declared ``Content-Length`` over
    ``max_body_bytes`` is refused at once, a chunked body as soon as it passes the limit. Both answer in OpenAI's
    error shape (401, 413)."""

    def __init__(self, app: ASGIApp, settings: ServeSettings):
        self.app, self.settings = app, settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT"):
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope["headers"]}
        limit = self.settings.max_body_bytes
        try:
            auth = headers.get(b"authorization", b"").decode("latin-1")
            token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
            if scope["path"].startswith(ADMIN_PREFIX + "/") or scope["path"] in WEIGHT_PATHS:
                if self.settings.admin_api_key is not None:  # (else the path is a 404 anyway)
                    check_admin_key(self.settings, token)
            else:
                check_bearer(self.settings, token)
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


def create_app(settings: ServeSettings | None = None, fleet: Any = None) -> FastAPI:
    """Build the FastAPI app for ``settings`` (default: env + serve.yaml). The model loads at startup. ``fleet``: a
    ``serve.fleet.FleetLink`` when this app is one replica of ``verl serve --replicas`` (serve/fleet.py)."""
    settings = settings or load_settings()
    service = Service(settings, fleet=fleet)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        uninstall = _install_drain_hook(service)
        if fleet is not None:
            await fleet.join(service)  # the control plane's models and routes, at its version
        loader = asyncio.create_task(service.load())
        if not settings.load_in_background:
            await loader  # a load failure stops startup with its error
        else:
            loader.add_done_callback(lambda t: t.cancelled() or t.exception())  # reported via /health + log
        if fleet is not None:
            fleet.start(service)
        try:
            yield
        finally:
            loader.cancel()
            if fleet is not None:
                await fleet.stop()
            await service.shutdown()
            uninstall()

    # With an API key the interactive docs and the schema are off (they map the attack surface for anyone).
    docs = {} if settings.api_key is None else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(**docs, title="verl suite inference service", version=__version__,
                  description="OpenAI-compatible completions and chat, a simple /generate, Prometheus metrics.",
                  lifespan=lifespan)
    app.state.service = service
    if settings.cors_allow_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_allow_origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    app.add_middleware(EdgeGuard, settings=settings)
    app.add_middleware(HTTPMetricsMiddleware, service=service, paths=lambda: {route.path for route in app.routes})
    _add_error_handlers(app)
    add_routes(app, service)
    if settings.admin_api_key is not None:
        app.include_router(admin_router(service))
        app.include_router(weight_router(service))
        problem = multiple_workers_problem(serving_processes())
        if problem is not None and fleet is None:
            log.warning("verl serve: %s", problem)
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


def __getattr__(name: str) -> Any:
    """``serve.api.app`` is built on first access, so importing this module reads no settings and loads nothing."""
    if name == "app":
        application = create_app()
        globals()["app"] = application
        return application
    raise AttributeError(f"module 'serve.api' has no attribute {name!r}")

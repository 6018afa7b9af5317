"""The service's state and the errors and auth every route shares: ``Service`` (engine, limits, admission, health,
drain), ``ApiError`` in OpenAI's error shape, and the API-key check."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Depends, Request
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from serve import __version__
from serve.engines import create_engine
from serve.engines.base import (
    Engine,
    EngineError,
    EngineOutput,
    EngineRequest,
    RequestFailedError,
    SamplingOptions,
)
from serve.export import ADAPTER_CONFIG, select_checkpoint
from serve.lineage import lineage_of
from serve.metrics import SequenceTimer, ServeMetrics
from serve.records import OnlineRecord, OnlineRecords, prompt_hash, score, user_hash
from serve.registry import ModelRegistry, ServedModel, UnknownModelError
from serve.schemas import (
    ErrorResponse,
    VerlExtension,
)
from serve.settings import ModelEntry, ServeSettings, check_route
from verl.errors import ConfigError, VerlError
from verl.utils.fs import atomic_write_json

# A child of uvicorn's logger: our lines appear in the server log with its format and level.
log = logging.getLogger("uvicorn.error.serve")


SEED_MODULUS = 2**63  # torch generators take 64-bit seeds; seed + i for n > 1 must stay in range
TIMEOUT_CANCEL = "verl-timeout"  # the message a pump is cancelled with when its request timed out (an error row)


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


@dataclass
class Responder:
    """Who answers one request and what is recorded about it: the model (picked directly or by ``route``) and the
    request's ``verl`` extension (a rule reward to score the response with)."""

    model: ServedModel
    route: str | None = None
    online: VerlExtension | None = None
    shadow: bool = False  # a mirrored copy of a request (never returned)
    user: str | None = None  # the routed user, hashed (serve.records.user_hash)
    arrival: float | None = None  # wall clock when it was routed
    config_version: int | None = None  # the models-and-routes version it was routed under
    route_share: float | None = None  # the model's share of the route then

    @property
    def name(self) -> str:
        return self.model.name

    def headers(self) -> dict[str, str]:
        """Response headers naming the variant that answered (and the route that chose it)."""
        headers = {"X-Verl-Model": self.model.name, **self.model.lineage.headers()}
        if self.route is not None:
            headers["X-Verl-Route"] = self.route
        return headers


def resolve_adapter_dir(path: str) -> str:
    """A PEFT adapter dir: ``path`` itself (a LoRA run's checkpoint), or a LoRA run dir's best checkpoint (as
    ``verl export`` picks it)."""
    root = Path(path).expanduser()
    if (root / ADAPTER_CONFIG).is_file():
        return str(root)
    if (root / "checkpoints").is_dir():
        chosen = select_checkpoint(root, "best").checkpoint
        if (chosen / ADAPTER_CONFIG).is_file():
            return str(chosen)
        raise ConfigError(f"the best checkpoint of run '{path}' ({chosen.name}) is a full model, not a LoRA adapter; "
                          "serve its export with 'path' instead")
    raise ConfigError(f"'{path}' holds no LoRA adapter ({ADAPTER_CONFIG}); give a LoRA run dir or one of its "
                      "checkpoints (outputs/<project>/<run>/checkpoints/global_step_N), or serve a full export with "
                      "'path'")


class Service:
    """Engines and the models they serve, routes, admission control and the sequence pumps every endpoint shares."""

    def __init__(self, settings: ServeSettings, fleet: Any = None):
        self.settings = settings
        # A replica of ``verl serve --replicas``: a ``serve.fleet.FleetLink`` to the control plane, which then holds
        # the models and routes (admin changes go through it), else None (this process is the control plane).
        self.fleet = fleet
        self.config_version = 1  # the models-and-routes version responses are served at (X-Verl-Config-Version)
        self.entries = settings.model_entries()
        self.routes = dict(settings.routes)
        self.state_note: str | None = None
        if settings.state_path and Path(settings.state_path).is_file():
            self.entries, self.routes = read_state(Path(settings.state_path))
            self.state_note = f"models and routes from {settings.state_path} (saved by the admin API)"
        self.model_name = self.entries[0].name  # the primary model: /health, /tokenize, /generate without a route
        self.metrics = ServeMetrics(self.model_name, version=__version__)
        self.registry = ModelRegistry()
        # A replica ships its rows to the control plane, which writes records_path for the whole fleet.
        self.records = (OnlineRecords(settings.records_path) if fleet is None
                        else OnlineRecords(None, replica=fleet.replica))
        self.engine: Engine | None = None  # the primary model's engine
        self.status = "loading"
        self.detail: str | None = "the model is loading"
        self.capacity = settings.max_batch_size + settings.max_queue_size
        self.in_flight = 0
        self.created = int(time.time())
        self.pumps: set[asyncio.Task] = set()
        self._background: set[asyncio.Task] = set()  # unloads after a fleet switch
        self._abort_timer: asyncio.TimerHandle | None = None
        self._changes = asyncio.Lock()  # one admin change at a time
        self.metrics.bind_gauges(
            running=lambda: sum(m.engine.num_running for m in self.registry.full_models()),
            waiting=lambda: sum(m.engine.num_waiting for m in self.registry.full_models()),
            healthy=lambda: 1.0 if self.health()[0] == "ok" else 0.0,
        )

    # ------------------------------------------------------------ lifecycle

    def announce(self) -> None:
        """One prominent line naming the model and who chose it, so the built-in default is never served silently."""
        source = self.settings.model_source
        if self.settings.config_file is not None:
            log.warning("verl serve: settings from %s (then VERL_SERVE_* env vars)", self.settings.config_file)
        if self.state_note:
            log.warning("verl serve: %s", self.state_note)
        if self.settings.models or self.state_note:
            log.warning("verl serve: serving %d models: %s", len(self.entries),
                        ", ".join(f"{e.name} ({e.path or 'adapter ' + str(e.adapter)})" for e in self.entries))
        elif source == "default":
            log.warning("verl serve: no model configured; serving the built-in %s, and %s for tool-calling requests "
                        "(set VERL_SERVE_MODEL=<export dir> or model: in serve.yaml to serve yours)",
                        self.settings.model, ", ".join(e.name for e in self.entries[1:]))
        else:
            log.warning("verl serve: serving %s (from %s) as '%s'", self.settings.model, source, self.model_name)

    async def load(self) -> None:
        self.announce()
        first_full = self.default_base()
        try:
            for entry in self.entries:
                if entry.path is not None:
                    await self.load_model(entry.name, entry.path)
            for entry in self.entries:
                if entry.adapter is not None:
                    await self.load_adapter(entry.name, entry.adapter, entry.base or first_full)
            for route, weights in self.routes.items():
                self.registry.set_route(route, weights)
        except Exception as exc:
            self.status, self.detail = "dead", f"the model failed to load: {exc}"
            log.error("verl serve: %s", self.detail)
            raise
        if self.status == "loading":
            self.status, self.detail = "ok", None

    async def load_model(self, name: str, path: str) -> ServedModel:
        """Start an engine for the full model at ``path`` and serve it as ``name``."""
        engine = await asyncio.to_thread(create_engine, self.settings, path)
        # vLLM decides at start whether it can take adapters: yes when some are configured over this model, or when
        # the admin API may load them later.
        default = self.default_base()
        engine.lora_enabled = self.settings.admin_api_key is not None or any(
            e.adapter is not None and (e.base or default) == name for e in self.entries)
        await engine.start()
        model = ServedModel(name, engine, "model", name, path, lineage=await asyncio.to_thread(lineage_of, path))
        self.registry.add(model)
        if self.engine is None:
            self.engine = engine
            self.metrics.set_engine(engine.name, __version__)
        log.info("verl serve: %s ready on the %s engine (context %d tokens)", name, engine.name, engine.max_model_len)
        return model

    def default_base(self) -> str:
        """The full model an adapter without ``base`` applies to: the first one served (the first configured one
        while loading)."""
        fulls = self.registry.full_models()
        return fulls[0].name if fulls else next(e.name for e in self.entries if e.path is not None)

    async def load_adapter(self, name: str, path: str, base: str) -> ServedModel:
        """Serve the LoRA adapter at ``path`` as ``name`` over full model ``base``'s engine (not merged)."""
        base_model = self.registry.models.get(base)
        if base_model is None or base_model.kind != "model" or base_model.retiring:
            raise ConfigError(f"adapter '{name}': base '{base}' is not a served full model")
        if not base_model.engine.supports_adapters:
            raise ConfigError(f"adapter '{name}': the {base_model.engine.name} engine does not serve LoRA adapters")
        if name in self.registry.models or name in self.registry.routes:
            raise ConfigError(f"the name '{name}' is already in use")
        directory = resolve_adapter_dir(path)
        await base_model.engine.add_adapter(name, directory)
        model = ServedModel(name, base_model.engine, "adapter", base, path,
                            lineage=await asyncio.to_thread(lineage_of, directory))
        self.registry.add(model)
        log.info("verl serve: adapter %s (%s) ready over %s", name, directory, base)
        return model

    async def unload(self, name: str) -> None:
        """Stop routing to ``name``, let its requests finish (up to ``request_timeout_s``), then release it."""
        model = self.registry.retire(name)
        self.registry.shadows = {r: v for r, v in self.registry.shadows.items() if v[0] != name}
        try:
            await asyncio.wait_for(model.idle.wait(), self.settings.request_timeout_s)
        except TimeoutError:
            log.warning("verl serve: %s still had %d requests after %g s; releasing it anyway", name,
                        model.in_flight, self.settings.request_timeout_s)
        self.registry.remove(name)
        if model.kind == "adapter":
            await model.engine.remove_adapter(name)
        else:
            await model.engine.shutdown(self.settings.shutdown_timeout_s)
            if model.engine is self.engine:
                fulls = self.registry.full_models()
                self.engine = fulls[0].engine if fulls else None
                self.model_name = fulls[0].name if fulls else self.model_name
        log.info("verl serve: %s unloaded", name)

    # ------------------------------------------------------------ admin changes: one at a time, each saved

    async def put_route(self, route: str, weights: dict[str, float]) -> None:
        """Create or change ``route``'s weights (400 for weights that name no model or do not sum to a share)."""
        if self.fleet is not None:
            state = await self._fleet_state()
            try:
                check_route(route, weights, {m["name"] for m in state["models"]})
            except ValueError as exc:
                raise ApiError(400, str(exc), param="weights") from None
            await self._fleet_change({**state, "routes": {**state["routes"], route: dict(weights)}})
            return
        async with self._changes:
            try:
                self.registry.set_route(route, weights)
            except ValueError as exc:
                raise ApiError(400, str(exc), param="weights") from None
        log.warning("verl serve: route %s -> %s", route, self.registry.routes[route])
        self._changed()

    async def delete_route(self, route: str) -> None:
        if self.fleet is not None:
            state = await self._fleet_state()
            if route not in state["routes"]:
                raise ApiError(404, f"no route named '{route}'", type="not_found_error", param="route")
            await self._fleet_change({**state, "routes": {r: w for r, w in state["routes"].items() if r != route}})
            return
        async with self._changes:
            if route not in self.registry.routes:
                raise ApiError(404, f"no route named '{route}'", type="not_found_error", param="route")
            self.registry.delete_route(route)
        self._changed()

    async def add_model(self, entry: ModelEntry) -> None:
        """Load a full model (``entry.path``) or an adapter over a served model; 409 when the name is taken."""
        if self.fleet is not None:
            state = await self._fleet_state()
            if entry.name in {m["name"] for m in state["models"]} or entry.name in state["routes"]:
                raise ApiError(409, f"the name '{entry.name}' is already in use; unload it first or pick another",
                               param="name", code="name_in_use")
            added = ({"name": entry.name, "path": entry.path} if entry.path is not None else
                     {"name": entry.name, "adapter": entry.adapter,
                      "base": entry.base or next(m["name"] for m in state["models"] if m.get("path"))})
            await self._fleet_change({**state, "models": [*state["models"], added]})
            return
        async with self._changes:
            if entry.name in self.registry.models or entry.name in self.registry.routes:
                raise ApiError(409, f"the name '{entry.name}' is already in use; unload it first or pick another",
                               param="name", code="name_in_use")
            try:
                if entry.path is not None:
                    await self.load_model(entry.name, entry.path)
                else:
                    await self.load_adapter(entry.name, entry.adapter, entry.base or self.default_base())
            except (VerlError, OSError, ValueError) as exc:
                raise ApiError(400, f"cannot load '{entry.name}': {exc}", param="path") from None
        self._changed()

    async def remove_model(self, name: str) -> None:
        """Stop routing to ``name``, let its requests finish, release it; the last model cannot go."""
        if self.fleet is not None:
            state = await self._fleet_state()
            names = [m["name"] for m in state["models"]]
            if name not in names:
                raise ApiError(404, f"no model named '{name}'", type="not_found_error", param="name")
            if len(names) == 1:
                raise ApiError(409, f"'{name}' is the last model served; load another first", code="last_model")
            using = [r for r, w in state["routes"].items() if w.get(name, 0.0) > 0]
            adapters = [m["name"] for m in state["models"] if m.get("base") == name]
            if using or adapters:
                why = (f"routes {', '.join(using)} still send it traffic" if using
                       else f"it is the base of adapter(s) {', '.join(adapters)}")
                raise ApiError(409, f"cannot unload '{name}': {why}", param="name", code="in_use")
            routes = {r: {m: x for m, x in w.items() if m != name} for r, w in state["routes"].items()}
            await self._fleet_change({"models": [m for m in state["models"] if m["name"] != name],
                                      "routes": routes})
            return
        async with self._changes:
            if name not in self.registry.models:
                raise ApiError(404, f"no model named '{name}'", type="not_found_error", param="name")
            if len(self.registry.names()) == 1:
                raise ApiError(409, f"'{name}' is the last model served; load another first", code="last_model")
            try:
                await self.unload(name)
            except ValueError as exc:
                raise ApiError(409, str(exc), param="name", code="in_use") from None
        self._changed()

    async def put_shadow(self, route: str, model: str, fraction: float) -> None:
        """Mirror ``fraction`` of ``route``'s requests to ``model`` (per process: a fleet refuses it for now)."""
        if self.fleet is not None:
            raise ApiError(409, "shadow traffic is set per process and a fleet's replicas would not all follow; "
                           "not available on verl serve --replicas yet", code="fleet_shadow")
        if route not in self.registry.routes:
            raise ApiError(404, f"no route named '{route}'", type="not_found_error", param="route")
        if model not in self.registry.models or self.registry.models[model].retiring:
            raise ApiError(404, f"no model named '{model}'", type="not_found_error", param="model")
        if not 0.0 < fraction <= 1.0:
            raise ApiError(400, f"the shadow fraction must be in (0, 1] (got {fraction})", param="fraction")
        self.registry.shadows[route] = (model, fraction)
        log.warning("verl serve: mirroring %.0f%% of route %s to %s", 100 * fraction, route, model)

    def delete_shadow(self, route: str) -> None:
        self.registry.shadows.pop(route, None)

    def _changed(self) -> None:
        self.config_version += 1
        self.save_state()

    # ------------------------------------------------------------ the fleet (verl serve --replicas; serve/fleet.py)

    async def _fleet_state(self) -> dict:
        """The control plane's models and routes (the desired state a change starts from)."""
        state = (await self.fleet.state())["state"]
        return {"models": list(state["models"]), "routes": dict(state["routes"])}

    async def _fleet_change(self, desired: dict) -> None:
        """Every live replica follows ``desired`` or none does (409 naming the ones that did not follow)."""
        async with self._changes:
            result = await self.fleet.change(desired)
        if not result["ok"]:
            why = "; ".join(f"{name}: {reason}" for name, reason in result["replicas"].items())
            raise ApiError(409, f"the change did not reach every replica ({result['phase']} failed: {why}); "
                           f"rolled back, serving version {result['version']}", code="fleet_rollback")
        log.warning("verl serve: fleet at version %d on %d replicas", result["version"], len(result["replicas"]))

    async def prepare_state(self, state: dict) -> None:
        """Load what ``state`` adds (models, then adapters) without routing to it."""
        loaded = set(self.registry.models)
        fulls = [m for m in state["models"] if m.get("path") is not None]
        for m in fulls:
            if m["name"] not in loaded:
                await self.load_model(m["name"], m["path"])
        for m in state["models"]:
            if m.get("adapter") is not None and m["name"] not in loaded:
                await self.load_adapter(m["name"], m["adapter"], m.get("base") or fulls[0]["name"])

    async def commit_state(self, state: dict) -> None:
        """Switch to ``state``: its routes at once, then release the models it no longer has."""
        await self.prepare_state(state)
        wanted = {m["name"] for m in state["models"]}
        self.registry.routes = {}
        for route, weights in state["routes"].items():
            self.registry.set_route(route, weights)
        self.config_version = int(state["version"])
        gone = sorted((n for n in self.registry.names() if n not in wanted),
                      key=lambda n: self.registry.models[n].kind != "adapter")  # adapters before their base
        if gone:  # in the background: their requests finish first, and the switch is reported at once
            task = asyncio.create_task(self._unload_all(gone))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _unload_all(self, names: list[str]) -> None:
        for name in names:
            with contextlib.suppress(ValueError, KeyError):  # already gone, or unloaded by a later change
                await self.unload(name)

    def save_state(self) -> None:
        """Write the served models and routes to ``state_path`` (atomically), after an admin change (in a fleet the
        control plane writes it)."""
        if not self.settings.state_path or self.fleet is not None:
            return
        models = []
        for m in self.registry.models.values():
            if not m.retiring:
                models.append({"name": m.name, "path": m.source} if m.kind == "model"
                              else {"name": m.name, "adapter": m.source, "base": m.base})
        atomic_write_json(Path(self.settings.state_path), {"models": models, "routes": self.registry.routes})

    def health(self) -> tuple[str, str | None]:
        if self.status == "ok":
            dead = [m.name for m in self.registry.full_models() if not m.engine.is_healthy()]
            if dead or self.engine is None:
                self.status = "dead"
                self.detail = f"the engine worker of {', '.join(dead)} stopped" if dead else "no model is served"
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
        engines = [m.engine for m in self.registry.full_models()]
        await asyncio.gather(*(e.shutdown(self.settings.shutdown_timeout_s) for e in engines),
                             return_exceptions=True)
        self.abort_all()

    # ------------------------------------------------------------ admission

    def ready_engine(self) -> Engine:
        """The primary model's engine, or the 503 while loading, draining or dead."""
        status, detail = self.health()
        if status != "ok" or self.engine is None:
            self.metrics.rejected.labels(self.model_name, status).inc()
            raise ApiError(503, f"service unavailable: {detail}", type="service_unavailable", code=status,
                           headers={"Retry-After": str(self.settings.retry_after_s)})
        return self.engine

    def target(self, requested: str | None, user: str | None, online: VerlExtension | None = None) -> Responder:
        """The model that answers a request naming ``requested`` (a model, a route, or None for the default)."""
        self.ready_engine()
        try:
            model, route = self.registry.pick(requested, user)
        except UnknownModelError:
            served = ", ".join([*self.registry.names(), *self.registry.routes]) or "none"
            raise ApiError(404, f"The model '{requested}' does not exist (served models and routes: {served}; see "
                           "/v1/models)", type="invalid_request_error", param="model",
                           code="model_not_found") from None
        if online is not None:
            try:
                score(online.reward, "", online.ground_truth)
            except ConfigError as exc:
                raise ApiError(400, f"verl.reward: {exc}", param="verl.reward") from None
        share = None
        if route is not None:
            weights = self.registry.routes[route]
            share = weights.get(model.name, 0.0) / (sum(w for w in weights.values() if w > 0) or 1.0)
        return Responder(model, route, online, user=user_hash(user), arrival=time.time(),
                      config_version=self.config_version, route_share=share)

    def admit(self, sequences: int, target: Responder | None = None, request_id: str | None = None) -> None:
        """Reserve ``sequences`` slots or refuse: the queue never grows past ``max_queue_size``. A refusal at
        capacity is recorded as failed requests of ``target`` (the canary counts it against the model)."""
        if sequences > self.capacity:
            raise ApiError(400, f"the request needs {sequences} sequences (prompts x n) but this server holds at "
                           f"most {self.capacity}; split it", param="n")
        if self.in_flight + sequences > self.capacity:
            self.metrics.rejected.labels(self.model_name, "queue_full").inc()
            if target is not None:
                now = time.time()
                for index in range(sequences):
                    self._write_record(target, request_id, index, now, 0, 0, None,
                                       now - (target.arrival or now), "abort", "queue_full: 429 at capacity", None)
            raise ApiError(429, f"the server is at capacity ({self.in_flight} sequences in flight, limit "
                           f"{self.capacity}); retry later", type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(self.settings.retry_after_s)})
        self.in_flight += sequences

    def start_pumps(self, request_id: str, specs: list[SequenceSpec],
                    sink: Callable[[int, EngineOutput | BaseException], None], stream: bool,
                    target: Responder | None = None) -> list[asyncio.Task]:
        """One task per sequence, reading the engine stream and passing each output to ``sink``."""
        if target is None:
            target = Responder(self.registry.models[self.model_name])
        arrival = time.perf_counter()
        tasks = []
        for spec in specs:
            timer = SequenceTimer(self.metrics, arrival, len(spec.prompt_ids), label=target.name)
            req = EngineRequest(f"{request_id}-{spec.index}", spec.prompt_ids, spec.sampling, arrival, stream,
                                adapter=target.model.adapter)
            target.model.acquire()
            task = asyncio.create_task(self._pump(target, req, request_id, spec.index, timer, sink))
            self.pumps.add(task)
            task.add_done_callback(self.pumps.discard)
            tasks.append(task)
        self._mirror(request_id, specs, stream, target)
        return tasks

    def _mirror(self, request_id: str, specs: list[SequenceSpec], stream: bool, target: Responder) -> None:
        """Shadow traffic: send a drawn share of a route's requests to its shadow model too. Its answers are
        recorded (``shadow: true``, scored like the user's) and dropped; it never takes a slot a user needs (no
        mirror when the queue lacks room) and never answers the user."""
        shadow = self.registry.shadows.get(target.route) if target.route is not None else None
        if shadow is None or random.random() >= shadow[1]:
            return
        model = self.registry.models.get(shadow[0])
        if model is None or model.retiring or model is target.model or self.in_flight + len(specs) > self.capacity:
            return
        self.in_flight += len(specs)
        mirror = Responder(model, target.route, target.online, shadow=True, user=target.user, arrival=target.arrival,
                        config_version=target.config_version, route_share=0.0)
        arrival = time.perf_counter()
        for spec in specs:
            timer = SequenceTimer(self.metrics, arrival, len(spec.prompt_ids), label=model.name)
            req = EngineRequest(f"{request_id}-shadow-{spec.index}", spec.prompt_ids, spec.sampling, arrival, stream,
                                adapter=model.adapter)
            model.acquire()
            task = asyncio.create_task(self._pump(mirror, req, request_id, spec.index, timer,
                                                  lambda _i, _out: None))
            self.pumps.add(task)
            task.add_done_callback(self.pumps.discard)

    async def _pump(self, target: Responder, req: EngineRequest, request_id: str, index: int, timer: SequenceTimer,
                    sink: Callable[[int, EngineOutput | BaseException], None]) -> None:
        finish, produced, error = "abort", 0, None
        text: list[str] = []
        try:
            self._inject_fault(target)
            stream = target.model.engine.generate(req)
            try:
                async for out in stream:
                    timer.on_output(time.perf_counter(), len(out.token_ids), out.scheduled_time, out.token_times)
                    produced = out.num_generated_tokens
                    if target.online is not None:
                        text.append(out.text)
                    sink(index, out)
                    if out.finished:
                        finish = out.finish_reason
            finally:
                await stream.aclose()  # aborts the sequence in the engine if it is still running
        except asyncio.CancelledError as exc:
            # Timeout, disconnect or shutdown deadline: the consumer (if any) sees an aborted sequence. A timeout is
            # the service's failure (recorded as an error); a client that left is not.
            if TIMEOUT_CANCEL in exc.args:
                error = f"timeout: not finished within {self.settings.request_timeout_s:g} s"
            sink(index, EngineOutput("", [], produced, finish_reason="abort"))
            raise
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            self.metrics.errors.labels(target.name).inc()
            sink(index, exc)
        finally:
            self.in_flight -= 1
            target.model.release()
            end = time.perf_counter()
            timer.on_finish(end, finish)
            self._record(target, req, request_id, index, timer, end, finish, produced, error, "".join(text))

    def _inject_fault(self, target: Responder) -> None:
        """Test-only (``fault_error_rate``): fail a share of a model's requests as an engine would."""
        rates = self.settings.fault_error_rate
        rate = rates.get(target.name, rates.get("*", 0.0)) if isinstance(rates, dict) else rates
        if rate > 0 and random.random() < rate:
            raise RequestFailedError(f"injected fault (fault_error_rate {rate:g} for {target.name})")

    def _record(self, target: Responder, req: EngineRequest, request_id: str, index: int, timer: SequenceTimer,
                end: float, finish: str, produced: int, error: str | None, text: str) -> None:
        """One online record per finished sequence; the reward when the request asked for one."""
        reward = None
        online = target.online
        if online is not None and error is None and finish != "abort":
            try:
                reward = score(online.reward, text, online.ground_truth)
            except (EngineError, ValueError, TypeError) as exc:  # a reward that cannot score this text: no reward
                log.warning("verl serve: reward %s failed on a response: %r", online.reward, exc)
            if reward is not None:
                self.metrics.reward.labels(target.name).observe(reward)
        self._write_record(target, request_id, index, time.time(), len(req.prompt_token_ids), produced, timer.ttft,
                           end - timer.arrival, finish, error, reward, prompt_hash(req.prompt_token_ids))

    def _write_record(self, target: Responder, request_id: str | None, index: int, now: float, prompt_tokens: int,
                      produced: int, ttft: float | None, e2e: float, finish: str, error: str | None,
                      reward: float | None, prompt_id: str | None = None) -> None:
        online = target.online
        if online is not None and online.prompt_id:
            prompt_id = online.prompt_id
        self.records.add(OnlineRecord(
            time=now, model=target.name, route=target.route, prompt_id=prompt_id or "", prompt_tokens=prompt_tokens,
            completion_tokens=produced, ttft_s=ttft, e2e_s=e2e, finish_reason=finish, error=error, reward=reward,
            shadow=target.shadow, id=request_id, index=index, user=target.user, arrival=target.arrival,
            config_version=target.config_version, route_share=target.route_share,
            reward_expected=online is not None,
            reward_source=f"rule:{online.reward}" if online is not None else None, **target.model.lineage.fields()))


def read_state(path: Path) -> tuple[list[ModelEntry], dict[str, dict[str, float]]]:
    """The models and routes a previous run saved in ``state_path``; a damaged file is an error naming it."""
    try:
        data = json.loads(path.read_text())
        entries = [ModelEntry(**m) for m in data["models"]]
        routes = {str(k): {str(n): float(w) for n, w in v.items()} for k, v in data["routes"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"the service state file {path} is damaged ({exc}); fix or delete it (the service then "
                          "starts from serve.yaml's models and routes)") from None
    if not any(e.path is not None for e in entries):
        raise ConfigError(f"the service state file {path} lists no full model; delete it")
    return entries, routes


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



"""vLLM's RL-facing endpoints, under vLLM's names, for a trainer that changes the weights of a running service:

    POST /pause?mode=abort|wait|keep     {"status": "paused"}    abort: end every sequence (finish_reason "abort");
                                                                 wait: admit nothing, let the running ones finish;
                                                                 keep: freeze them with their KV cache
    POST /resume                         {"status": "resumed"}   queued and kept sequences go on
    GET  /is_paused                      {"is_paused": false}
    POST /update_weights                 {"update_info": {"path": DIR, "model": NAME, "version": N}}
    POST /sleep?level=0|1&mode=...       {"status": "sleeping", "level": 1}
    POST /wake_up                        {"status": "awake"}
    GET  /is_sleeping                    {"is_sleeping": false}
    POST /reset_prefix_cache             200 (the prefixes kept across prefills are dropped)
    POST /v1/load_lora_adapter           {"lora_name": "b", "lora_path": DIR, "load_inplace": false}
    POST /v1/unload_lora_adapter         {"lora_name": "b"}

``update_info.path`` is a directory of safetensors (the full weights, as ``save_pretrained`` writes them) or a PEFT
adapter; ``model`` names the served model or adapter it replaces (default: the first full model); ``version`` is
the weight version the tokens sampled afterwards carry (default: the current one + 1; a trainer sends its step).
vLLM's own ``update_info`` (tensor names, dtypes and shapes sent over NCCL or IPC after
``/init_weight_transfer_engine``) has no counterpart on CPU and is refused by name. Every response names the weight
version that produced it (``X-Verl-Weight-Version``), and every online record carries it (and each token's when an
update came mid-answer under ``keep``).

Like ``/admin``, they exist only when ``admin_api_key`` is set and need it as the bearer token (vLLM serves them
only in its dev mode, unauthenticated); a service of several worker processes refuses them (``multiple_workers``).
An update that does not fit the served model (other names or shapes) is a 400 and leaves the weights as they were.

On a fleet (``verl serve --replicas``) each is a versioned change of the control plane's state, as admin changes are
(serve/fleet_sync.py): every replica checks new weights before any applies them, and pauses, updates, resumes or
sleeps with the others or the change is rolled back everywhere (a 409 naming the replicas that did not follow,
weights that do not fit among them). ``/is_paused`` and ``/is_sleeping`` answer for the replica asked, which
follows the fleet's state.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Literal

from fastapi import APIRouter, Depends, Query
from fastapi.responses import PlainTextResponse, Response
from pydantic import Field, ValidationError

from serve.admin import require_admin_key, require_one_process
from serve.engines.base import Engine, EngineError
from serve.errors import ApiError
from serve.lineage import lineage_of
from serve.registry import ServedModel
from serve.schemas import _Strict
from serve.service import Service
from serve.settings import ModelEntry

PauseMode = Literal["abort", "wait", "keep"]
# The paths EdgeGuard checks the admin key on (before the body is read), as it does for /admin/*.
WEIGHT_PATHS = frozenset({"/pause", "/resume", "/update_weights", "/sleep", "/wake_up", "/reset_prefix_cache",
                          "/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
VLLM_TRANSFER_KEYS = ("names", "dtype_names", "shapes", "packed", "is_checkpoint_format")


class UpdateInfo(_Strict):
    path: str = Field(min_length=1, description="A safetensors directory (full weights) or a PEFT adapter directory.")
    model: str | None = Field(None, description="The served model or adapter to update (default: the first model).")
    version: int | None = Field(None, ge=0, description="The new weight version (default: the current one + 1).")


class UpdateWeights(_Strict):
    update_info: dict


class LoadLora(_Strict):
    lora_name: str = Field(min_length=1, max_length=128)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False


class UnloadLora(_Strict):
    lora_name: str = Field(min_length=1, max_length=128)
    lora_int_id: int | None = None


def engines(service: Service) -> list[Engine]:
    """Every full model's engine, once (adapters share their base's); a 400 when nothing generates."""
    found = service.lifecycle.registry.engines()
    if not found:
        raise ApiError(400, "no generating model is served", code="model_not_found")
    return found


def served(service: Service, name: str | None) -> ServedModel:
    registry = service.lifecycle.registry
    if name is None:
        fulls = registry.full_models()
        if not fulls:
            raise ApiError(400, "no generating model is served", code="model_not_found")
        return fulls[0]
    model = registry.models.get(name)
    if model is None or model.retiring:
        raise ApiError(404, f"no model named '{name}' (served: {', '.join(registry.names())})", param="model",
                       type="not_found_error")
    return model


def update_info(body: dict) -> UpdateInfo:
    """``update_info`` as ours, vLLM's transfer-engine form refused with what to send instead."""
    transfer = [key for key in VLLM_TRANSFER_KEYS if key in body]
    if transfer:
        raise ApiError(400, f"update_info.{transfer[0]}: weights sent over NCCL or IPC (vLLM's weight transfer "
                       "engine) are not served on CPU; save them to a directory and send "
                       '{"update_info": {"path": DIR}}', param=f"update_info.{transfer[0]}")
    unknown = sorted(set(body) - set(UpdateInfo.model_fields))
    if unknown:
        raise ApiError(400, f"update_info.{unknown[0]} is not a key here (keys: path, model, version)",
                       param=f"update_info.{unknown[0]}")
    try:
        return UpdateInfo(**body)
    except ValidationError as exc:
        error = exc.errors()[0]
        raise ApiError(400, f"update_info.{error['loc'][0]}: {error['msg']}", param=f"update_info.{error['loc'][0]}") \
            from None


async def apply_update(service: Service, info: UpdateInfo) -> dict:
    """Copy the new weights into the engine serving ``info.model`` (on a fleet: every replica's) and move its version
    and lineage."""
    if service.fleet is not None:
        name, version = await service.changes.update_weights(info.model, info.path, info.version)
        lineage = await asyncio.to_thread(lineage_of, info.path)
        return {"message": "Weights updated", "model": name, "weight_version": version, **lineage.fields()}
    model = served(service, info.model)
    try:
        await model.replace_weights(info.path, model.weight_version + 1 if info.version is None else info.version)
    except EngineError as exc:
        raise ApiError(400, str(exc), param="update_info.path") from None
    return {"message": "Weights updated", "model": model.name, "weight_version": model.weight_version,
            **model.lineage.fields()}


async def change_engines(service: Service, lock: asyncio.Lock, work: str, *args,
                         on_fleet: Callable[[], Awaitable[None]]) -> None:
    """``engine.<work>(*args)`` on every engine, one change at a time; an engine's refusal is a 400. On a fleet,
    ``on_fleet()`` instead: a change of the control plane's state, which every replica follows."""
    async with lock:
        try:
            if service.fleet is not None:
                await on_fleet()
                return
            for engine in engines(service):
                await getattr(engine, work)(*args)
        except EngineError as exc:
            raise ApiError(400, str(exc)) from None


def refuse_what_replicas_would(service: Service, work: str, *args) -> None:
    """On a fleet, refuse here what an engine would refuse (a 400), not after every replica prepared the change."""
    if service.fleet is None:
        return
    try:
        for engine in engines(service):
            if work == "sleep":
                engine.check_sleep(*args)
            elif work == "resume" and engine.sleeping:
                raise EngineError("the engine is asleep: POST /wake_up resumes it")
    except EngineError as exc:
        raise ApiError(400, str(exc)) from None


def weight_router(service: Service) -> APIRouter:
    changes = [Depends(require_one_process)]
    router = APIRouter(tags=["weights"], dependencies=[Depends(require_admin_key)])
    lock = asyncio.Lock()  # one weight change at a time

    async def each_engine(work: str, *args, fleet: dict) -> None:
        refuse_what_replicas_would(service, work, *args)
        await change_engines(service, lock, work, *args, on_fleet=lambda: service.changes.set_engine(**fleet))

    @router.post("/pause", dependencies=changes)
    async def pause(mode: PauseMode = Query("abort"), wait_for_inflight_requests: bool = Query(False),
                    clear_cache: bool = Query(True)) -> dict:
        # vLLM's deprecated wait_for_inflight_requests=true is mode=wait; clear_cache is moot (no prefix cache).
        mode = "wait" if wait_for_inflight_requests else mode
        await each_engine("pause", mode, fleet={"paused": mode})
        return {"status": "paused"}

    @router.post("/resume", dependencies=changes)
    async def resume() -> dict:
        await each_engine("resume", fleet={"paused": None})
        return {"status": "resumed"}

    @router.get("/is_paused")
    async def is_paused() -> dict:
        return {"is_paused": any(engine.paused for engine in engines(service))}

    @router.post("/update_weights", dependencies=changes)
    async def update_weights(body: UpdateWeights) -> dict:
        async with lock:
            return await apply_update(service, update_info(body.update_info))

    @router.post("/sleep", dependencies=changes)
    async def sleep(level: int = Query(1, ge=0, le=2), mode: PauseMode = Query("abort")) -> dict:
        await each_engine("sleep", level, mode, fleet={"sleeping": level, "paused": mode})
        return {"status": "sleeping", "level": level}

    @router.post("/wake_up", dependencies=changes)
    async def wake_up() -> dict:
        await each_engine("wake_up", fleet={"sleeping": None, "paused": None})
        return {"status": "awake"}

    @router.get("/is_sleeping")
    async def is_sleeping() -> dict:
        return {"is_sleeping": any(engine.sleeping for engine in engines(service))}

    @router.post("/reset_prefix_cache", dependencies=changes)
    async def reset_prefix_cache() -> Response:
        await change_engines(service, lock, "reset_prefix_cache", on_fleet=lambda: service.changes.reset_prefix_cache())
        return Response(status_code=200)

    @router.post("/v1/load_lora_adapter", dependencies=[Depends(require_one_process)])
    async def load_lora_adapter(body: LoadLora) -> PlainTextResponse:
        existing = service.lifecycle.registry.models.get(body.lora_name)
        if existing is not None and body.load_inplace:
            if existing.kind != "adapter":
                raise ApiError(400, f"'{body.lora_name}' is a full model, not a LoRA adapter", param="lora_name")
            async with lock:
                await apply_update(service, UpdateInfo(path=body.lora_path, model=body.lora_name))
            return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' reloaded in place.")
        await service.changes.add_model(ModelEntry(name=body.lora_name, adapter=body.lora_path))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @router.post("/v1/unload_lora_adapter", dependencies=[Depends(require_one_process)])
    async def unload_lora_adapter(body: UnloadLora) -> PlainTextResponse:
        model = service.lifecycle.registry.models.get(body.lora_name)
        if model is not None and model.kind != "adapter":
            raise ApiError(400, f"'{body.lora_name}' is a full model, not a LoRA adapter: unload it with "
                           "DELETE /admin/models/{name}", param="lora_name")
        await service.changes.remove_model(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    return router

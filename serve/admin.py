"""Admin endpoints: change route weights, load and unload models and adapters, read the online records — while
requests are in flight. Mounted only when ``admin_api_key`` is set (otherwise every /admin path is a 404), and
every call needs ``Authorization: Bearer <admin_api_key>`` (the service's own ``api_key`` does not open them).

    GET    /admin/state                  models (kind, base, requests in flight) and routes
    PUT    /admin/routes/{route}         {"weights": {"a": 0.9, "b": 0.1}}   (creates the route if new)
    DELETE /admin/routes/{route}
    POST   /admin/models                 {"name": "b", "path": DIR} or {"name": "b", "adapter": DIR, "base": "a"}
    DELETE /admin/models/{name}          stops routing to it, waits for its requests, then releases it
    GET    /admin/records?since=T        the online records (``verl compare --online`` and ``verl ship`` read them)
    POST   /admin/records/rewards        {"rewards": [{"id": ..., "index": 0, "reward": 1.0, "source": "..."}]}
    PUT    /admin/shadow/{route}         {"model": "b", "fraction": 0.2}: mirror 20% of the route to b (never returned)
    DELETE /admin/shadow/{route}

A change is applied in one step on the event loop: each request sees the old routing or the new, and a model is
released only after its last request finished, so a change never fails or drops a request.

One process, one control plane. Models and routes live in the process that serves them. Under
``uvicorn serve.api:app --workers N`` (or gunicorn's ``-w N``, or ``WEB_CONCURRENCY=N``) each worker holds its own
copy, and a change would reach only the worker that happened to answer the admin call: a promote that half the
traffic never sees. So with more than one worker every change is refused (409 ``multiple_workers``) with the
reason, and ``GET /admin/state`` says which worker answered; reads still work. Run admin-managed services as one
worker per process.
"""

from __future__ import annotations

import os
import secrets
import sys
from collections.abc import Mapping, Sequence

from fastapi import APIRouter, Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import Field, ValidationError

from serve.auth import service_of
from serve.errors import ApiError
from serve.schemas import _Strict
from serve.service import Service
from serve.settings import ModelEntry, ServeSettings
from verl.data.records import reward_row

ADMIN_PREFIX = "/admin"

_bearer = HTTPBearer(auto_error=False, description="The admin_api_key setting.")


class RouteWeights(_Strict):
    weights: dict[str, float]


class Shadow(_Strict):
    model: str
    fraction: float


class LateReward(_Strict):
    id: str = Field(min_length=1, max_length=128, description="The completion's id (the response's `id`).")
    index: int = Field(0, ge=0, description="The choice index.")
    reward: float = Field(allow_inf_nan=False, description="The reward (the canary's betting test needs [0, 1]).")
    source: str = Field(min_length=1, max_length=64, description="Where it came from, e.g. rule:gsm8k, judge:x.")
    model: str | None = Field(None, max_length=128, description="The model that answered (a mirror's reward).")
    shadow: bool = Field(False, description="The reward of a mirrored answer (the shadow stage).")


class LateRewards(_Strict):
    rewards: list[LateReward] = Field(max_length=10_000)


def check_admin_key(settings: ServeSettings, given: str) -> None:
    """Raise the 401 unless ``given`` is the admin key (constant time)."""
    key = settings.admin_api_key
    if key is None or not secrets.compare_digest(given.encode(), key.get_secret_value().encode()):
        raise ApiError(401, "missing or wrong admin key: send 'Authorization: Bearer <admin_api_key>'",
                       type="authentication_error", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


async def require_admin_key(request: Request,
                            credentials: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> None:
    check_admin_key(service_of(request).settings, credentials.credentials if credentials is not None else "")


def serving_processes(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """How many server processes run this app, as its launch says: ``--workers N`` / ``--workers=N`` / ``-w N`` on
    the command line (uvicorn's and gunicorn's workers are spawned with the parent's ``sys.argv``), else
    ``WEB_CONCURRENCY`` (both servers read it), else 1."""
    argv = list(sys.argv if argv is None else argv)
    environ = os.environ if environ is None else environ
    for i, arg in enumerate(argv):
        value = None
        if arg in ("--workers", "-w") and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--workers="):
            value = arg.split("=", 1)[1]
        if value is not None and value.isdigit():
            return max(1, int(value))
    concurrency = environ.get("WEB_CONCURRENCY", "")
    return max(1, int(concurrency)) if concurrency.isdigit() else 1


def multiple_workers_problem(workers: int) -> str | None:
    """The one line that refuses admin changes when ``workers`` processes each hold their own routes."""
    if workers <= 1:
        return None
    return (f"admin changes are refused: this service runs as {workers} worker processes (uvicorn/gunicorn --workers "
            f"or WEB_CONCURRENCY), each with its own models and routes, so a change would reach only the worker "
            f"that answered; run the admin-managed service as one worker (drop --workers)")


def state(service: Service) -> dict:
    registry = service.lifecycle.registry
    workers = 1 if service.fleet is not None else serving_processes()
    process = {"pid": os.getpid(), "workers": workers, "changes": multiple_workers_problem(workers) or "allowed"}
    if service.fleet is not None:
        process.update(replica=service.fleet.replica, node=service.fleet.node, replicas_live=service.fleet.live)
    return {
        "version": service.lifecycle.config_version,
        "process": process,
        "models": [{"name": m.name, "kind": m.kind, "base": m.base, "source": m.source, "in_flight": m.in_flight,
                    "retiring": m.retiring, "engine": m.engine.name, "weight_version": m.weight_version,
                    **m.lineage.fields()}
                   for m in registry.models.values()]
        + [{"name": name, "kind": "reward", "base": name, "source": scorer.source, "in_flight": 0, "retiring": False,
            "engine": "transformers", **scorer.lineage.fields()} for name, scorer in service.lifecycle.scorers.items()],
        "routes": {route: dict(weights) for route, weights in registry.routes.items()},
        "shadows": {route: {"model": m, "fraction": f} for route, (m, f) in registry.shadows.items()},
    }


async def require_one_process(request: Request) -> None:
    """Refuse a change that would reach one worker of several (409, one line that says why); replicas of
    ``verl serve --replicas`` share a control plane instead."""
    if service_of(request).fleet is not None:
        return
    problem = multiple_workers_problem(serving_processes())
    if problem is not None:
        raise ApiError(409, problem, code="multiple_workers")


def admin_router(service: Service) -> APIRouter:
    router = APIRouter(prefix=ADMIN_PREFIX, tags=["admin"], dependencies=[Depends(require_admin_key)])
    one_process = [Depends(require_one_process)]

    @router.get("/state")
    async def get_state() -> dict:
        return state(service)

    @router.put("/routes/{route}", dependencies=one_process)
    async def put_route(route: str, body: RouteWeights) -> dict:
        await service.changes.put_route(route, body.weights)
        return state(service)

    @router.delete("/routes/{route}", dependencies=one_process)
    async def delete_route(route: str) -> dict:
        await service.changes.delete_route(route)
        return state(service)

    @router.put("/shadow/{route}", dependencies=one_process)
    async def put_shadow(route: str, body: Shadow) -> dict:
        service.shadow.put(route, body.model, body.fraction)
        return state(service)

    @router.delete("/shadow/{route}", dependencies=one_process)
    async def delete_shadow(route: str) -> dict:
        service.shadow.delete(route)
        return state(service)

    @router.post("/models", dependencies=one_process)
    async def load_model(body: dict) -> dict:
        try:
            entry = ModelEntry(**body)
        except ValidationError as exc:
            raise ApiError(400, f"invalid model entry: {exc.errors()[0]['msg']}", param="name") from None
        await service.changes.add_model(entry)
        return state(service)

    @router.delete("/models/{name}", dependencies=one_process)
    async def unload_model(name: str) -> dict:
        await service.changes.remove_model(name)
        return state(service)

    @router.get("/records")
    async def records(since: float | None = None) -> dict:
        if service.fleet is not None:  # every replica's rows, from the control plane
            return {"records": await service.fleet.records(since)}
        return {"records": service.records.snapshot(since)}

    @router.post("/records/rewards")
    async def add_rewards(body: LateRewards) -> dict:
        """Rewards that arrive after their answers (a checker run later, a judge): one reward row each, joined to
        its request by completion id and choice index. A request still in this process's memory lends the row its
        model and route; others are recorded as given (in a fleet another replica may have answered)."""
        unmatched = []
        for item in body.rewards:
            found = service.records.find(item.id, item.index) if not item.shadow else None
            if found is None:
                unmatched.append(item.id)
            service.records.add(reward_row(item.id, item.index, item.reward, item.source,
                                           model=item.model or (found or {}).get("model"),
                                           route=(found or {}).get("route"), shadow=item.shadow))
        return {"recorded": len(body.rewards), "not_in_memory": unmatched}

    return router

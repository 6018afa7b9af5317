"""Fleet sync, a replica's half of ``verl serve --replicas`` (the control plane and the poll loop are
serve/fleet.py): admin changes go to the control plane, which every live replica follows or none does; a replica
joins at the control plane's state and switches to each new version (load first, then route, then release)."""

from __future__ import annotations

import asyncio
from typing import Any

from serve import log
from serve.changes import last_model, name_in_use, no_such
from serve.errors import ApiError
from serve.lifecycle import ModelLifecycle
from serve.settings import ModelEntry, check_route


class FleetSync:
    """Admin changes through the control plane (``fleet``: a ``serve.fleet.FleetLink``) and this replica's state
    switches. Changes answer as ``serve.changes.LocalChanges`` does, plus a 409 when a replica did not follow."""

    def __init__(self, fleet: Any, lifecycle: ModelLifecycle):
        self.fleet, self.lifecycle, self.registry = fleet, lifecycle, lifecycle.registry
        self._lock = asyncio.Lock()  # one admin change at a time from this replica
        self._background: set[asyncio.Task] = set()  # unloads after a switch

    # ------------------------------------------------------------ admin changes

    async def put_route(self, route: str, weights: dict[str, float]) -> None:
        state = await self._state()
        try:
            check_route(route, weights, {m["name"] for m in state["models"]})
        except ValueError as exc:
            raise ApiError(400, str(exc), param="weights") from None
        await self._change({**state, "routes": {**state["routes"], route: dict(weights)}})

    async def delete_route(self, route: str) -> None:
        state = await self._state()
        if route not in state["routes"]:
            raise no_such("route", route)
        await self._change({**state, "routes": {r: w for r, w in state["routes"].items() if r != route}})

    async def add_model(self, entry: ModelEntry) -> None:
        state = await self._state()
        if entry.name in {m["name"] for m in state["models"]} or entry.name in state["routes"]:
            raise name_in_use(entry.name)
        added = ({"name": entry.name, "path": entry.path, "kind": entry.kind} if entry.path is not None else
                 {"name": entry.name, "adapter": entry.adapter,
                  "base": entry.base or next(m["name"] for m in state["models"]
                                             if m.get("path") and m.get("kind", "chat") == "chat")})
        await self._change({**state, "models": [*state["models"], added]})

    async def remove_model(self, name: str) -> None:
        state = await self._state()
        names = [m["name"] for m in state["models"]]
        if name not in names:
            raise no_such("model", name)
        if len(names) == 1:
            raise last_model(name)
        using = [r for r, w in state["routes"].items() if w.get(name, 0.0) > 0]
        adapters = [m["name"] for m in state["models"] if m.get("base") == name]
        if using or adapters:
            why = (f"routes {', '.join(using)} still send it traffic" if using
                   else f"it is the base of adapter(s) {', '.join(adapters)}")
            raise ApiError(409, f"cannot unload '{name}': {why}", param="name", code="in_use")
        routes = {r: {m: x for m, x in w.items() if m != name} for r, w in state["routes"].items()}
        await self._change({"models": [m for m in state["models"] if m["name"] != name], "routes": routes})

    async def _state(self) -> dict:
        """The control plane's models and routes (the desired state a change starts from)."""
        state = (await self.fleet.state())["state"]
        return {"models": list(state["models"]), "routes": dict(state["routes"])}

    async def _change(self, desired: dict) -> None:
        """Every live replica follows ``desired`` or none does (409 naming the ones that did not follow)."""
        async with self._lock:
            result = await self.fleet.change(desired)
        if not result["ok"]:
            why = "; ".join(f"{name}: {reason}" for name, reason in result["replicas"].items())
            raise ApiError(409, f"the change did not reach every replica ({result['phase']} failed: {why}); "
                           f"rolled back, serving version {result['version']}", code="fleet_rollback")
        log.warning("verl serve: fleet at version %d on %d replicas", result["version"], len(result["replicas"]))

    # ------------------------------------------------------------ this replica's state

    def join(self, state: dict) -> None:
        """Before the models load: serve the control plane's ``state`` (models, routes, version)."""
        self.lifecycle.adopt([ModelEntry(**m) for m in state["models"]], dict(state["routes"]), int(state["version"]))

    async def prepare(self, state: dict) -> None:
        """Load what ``state`` adds (models, then adapters) without routing to it."""
        loaded = set(self.registry.models) | set(self.lifecycle.scorers)
        fulls = [m for m in state["models"] if m.get("path") is not None and m.get("kind", "chat") == "chat"]
        for m in fulls:
            if m["name"] not in loaded:
                await self.lifecycle.load_model(m["name"], m["path"])
        for m in state["models"]:
            if m.get("kind") == "reward" and m["name"] not in loaded:
                await self.lifecycle.load_reward(m["name"], m["path"])
        for m in state["models"]:
            if m.get("adapter") is not None and m["name"] not in loaded:
                await self.lifecycle.load_adapter(m["name"], m["adapter"], m.get("base") or fulls[0]["name"])

    async def commit(self, state: dict) -> None:
        """Switch to ``state``: its routes at once, then release the models it no longer has."""
        await self.prepare(state)
        wanted = {m["name"] for m in state["models"]}
        self.registry.routes = {}
        for route, weights in state["routes"].items():
            self.registry.set_route(route, weights)
        self.lifecycle.config_version = int(state["version"])
        gone = sorted((n for n in self.registry.names() if n not in wanted),
                      key=lambda n: self.registry.models[n].kind != "adapter")  # adapters before their base
        gone += [n for n in self.lifecycle.scorers if n not in wanted]
        if gone:  # in the background: their requests finish first, and the switch is reported at once
            task = asyncio.create_task(self.lifecycle.unload_all(gone))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

"""Fleet sync, a replica's half of ``verl serve --replicas`` (the control plane and the poll loop are
serve/fleet.py): admin changes go to the control plane, which every live replica follows or none does; a replica
joins at the control plane's state and switches to each new version (load and check first, then route, copy new
weights in place and pause or resume, then release).

The weight endpoints (serve/weight_updates.py) are changes of the same state: ``/update_weights`` sets a model's
``weights`` (directory and version), ``/pause`` ``/resume`` ``/sleep`` ``/wake_up`` the ``engine`` part (pause mode,
sleep level). Every replica checks new weights against what it serves before any replica applies them, so weights
that do not fit are refused on every replica, the served ones untouched."""

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
        self.applied: dict[str, dict] = {}  # each model's in-place weights this replica serves (name -> weights)
        self.prefix_cache_resets = 0  # the fleet's POST /reset_prefix_cache count this replica followed

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
        await self._change({**state, "models": [m for m in state["models"] if m["name"] != name], "routes": routes})

    async def update_weights(self, name: str | None, path: str, version: int | None) -> tuple[str, int]:
        """New weights for model or adapter ``name`` (None: the first full model) on every replica; returns the
        name and the new version (default: the current one + 1)."""
        state = await self._state()
        generating = [m for m in state["models"] if m.get("kind", "chat") == "chat" or m.get("adapter")]
        if name is None:
            name = next((m["name"] for m in generating if m.get("path") is not None), None)
        entry = next((m for m in generating if m["name"] == name), None)
        if entry is None:
            raise ApiError(404, f"no model named '{name}' (served: {', '.join(m['name'] for m in generating)})",
                           param="model", type="not_found_error")
        served = self.registry.models.get(name)
        current = (entry.get("weights") or {}).get("version", served.weight_version if served else 0)
        version = current + 1 if version is None else version
        weights = {"path": path, "version": version}
        await self._change({**state, "models": [{**m, "weights": weights} if m is entry else m
                                                for m in state["models"]]})
        return name, version

    async def set_engine(self, **engine) -> None:
        """Every replica's engines paused (``paused``: a pause mode, or None to resume) or asleep (``sleeping``: a
        sleep level, or None to wake)."""
        state = await self._state()
        await self._change({**state, "engine": {**state["engine"], **engine}})

    async def reset_prefix_cache(self) -> None:
        """Every replica drops the prompt prefixes its engines keep (the fleet state counts the resets)."""
        state = await self._state()
        resets = int(state["engine"].get("prefix_cache_resets", 0)) + 1
        await self._change({**state, "engine": {**state["engine"], "prefix_cache_resets": resets}})

    async def _state(self) -> dict:
        """The control plane's models, routes and engine state (the desired state a change starts from)."""
        state = (await self.fleet.state())["state"]
        return {"models": list(state["models"]), "routes": dict(state["routes"]),
                "engine": dict(state.get("engine") or {})}

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
        """Before the models load: serve the control plane's ``state`` (models, routes, version); its in-place
        weights and engine state follow once they loaded (``settle``)."""
        self.lifecycle.adopt([ModelEntry(**{k: v for k, v in m.items() if k != "weights"}) for m in state["models"]],
                             dict(state["routes"]), int(state["version"]))

    async def prepare(self, state: dict) -> None:
        """Load what ``state`` adds (models, then adapters) without routing to it, and check its new in-place weights
        against what they replace without applying them."""
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
        for model, weights in self._new_weights(state):
            await model.engine.check_weights(model.adapter, weights["path"])

    async def commit(self, state: dict) -> None:
        """Switch to ``state``: its routes at once, then release the models it no longer has."""
        await self.prepare(state)
        wanted = {m["name"] for m in state["models"]}
        self.registry.routes = {}
        for route, weights in state["routes"].items():
            self.registry.set_route(route, weights)
        await self.settle(state)
        self.lifecycle.config_version = int(state["version"])
        gone = sorted((n for n in self.registry.names() if n not in wanted),
                      key=lambda n: self.registry.models[n].kind != "adapter")  # adapters before their base
        gone += [n for n in self.lifecycle.scorers if n not in wanted]
        for name in gone:
            self.applied.pop(name, None)
        if gone:  # in the background: their requests finish first, and the switch is reported at once
            task = asyncio.create_task(self.lifecycle.unload_all(gone))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def settle(self, state: dict) -> None:
        """This replica's engines as ``state`` says: each model's in-place weights at their version, then paused,
        asleep or running."""
        for model, weights in self._new_weights(state):
            await model.replace_weights(weights["path"], int(weights["version"]))
            self.applied[model.name] = weights
        for m in state["models"]:  # a rollback past a model's first update: nothing names the weights it loaded
            if not m.get("weights") and self.applied.pop(m["name"], None) is not None:
                log.warning("verl serve: version %s has no in-place weights for '%s'; it keeps the last ones applied "
                            "(load it again to serve the weights it loaded with)", state["version"], m["name"])
        wanted = state.get("engine") or {}
        level, mode = wanted.get("sleeping"), wanted.get("paused")
        resets = int(wanted.get("prefix_cache_resets", 0))
        for engine in self.registry.engines():
            if resets != self.prefix_cache_resets:
                await engine.reset_prefix_cache()
            if level is not None:
                if not engine.sleeping:
                    await engine.sleep(int(level), mode or "abort")
                continue
            if engine.sleeping:
                await engine.wake_up()
            if mode is not None and not engine.paused:
                await engine.pause(mode)
            elif mode is None and engine.paused:
                await engine.resume()
        self.prefix_cache_resets = resets

    def _new_weights(self, state: dict) -> list[tuple[Any, dict]]:
        """(served model, its ``weights``) for each model of ``state`` whose weights this replica does not serve."""
        out = []
        for m in state["models"]:
            model, weights = self.registry.models.get(m["name"]), m.get("weights")
            if weights and model is not None and self.applied.get(model.name) != weights:
                out.append((model, weights))
        return out

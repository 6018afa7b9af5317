"""Admin changes on a process that is its own control plane: one at a time, each moving the config version and
saved to ``state_path``. A replica of a fleet makes them through the control plane instead (serve/fleet_sync.py);
both answer the admin API's errors (400, 404, 409) the same way."""

from __future__ import annotations

import asyncio

from serve import log
from serve.errors import ApiError
from serve.lifecycle import ModelLifecycle
from serve.settings import ModelEntry
from verl.errors import VerlError


def name_in_use(name: str) -> ApiError:
    return ApiError(409, f"the name '{name}' is already in use; unload it first or pick another", param="name",
                    code="name_in_use")


def no_such(kind: str, name: str) -> ApiError:
    return ApiError(404, f"no {kind} named '{name}'", type="not_found_error", param=kind if kind == "route" else "name")


def last_model(name: str) -> ApiError:
    return ApiError(409, f"'{name}' is the last model served; load another first", code="last_model")


class LocalChanges:
    """Routes and models changed in this process (``verl serve`` without ``--replicas``)."""

    def __init__(self, lifecycle: ModelLifecycle):
        self.lifecycle = lifecycle
        self.registry = lifecycle.registry
        self._lock = asyncio.Lock()  # one admin change at a time

    async def put_route(self, route: str, weights: dict[str, float]) -> None:
        """Create or change ``route``'s weights (400 for weights that name no model or do not sum to a share)."""
        async with self._lock:
            try:
                self.registry.set_route(route, weights)
            except ValueError as exc:
                raise ApiError(400, str(exc), param="weights") from None
        log.warning("verl serve: route %s -> %s", route, self.registry.routes[route])
        self._changed()

    async def delete_route(self, route: str) -> None:
        async with self._lock:
            if route not in self.registry.routes:
                raise no_such("route", route)
            self.registry.delete_route(route)
        self._changed()

    async def add_model(self, entry: ModelEntry) -> None:
        """Load a full model (``entry.path``) or an adapter over a served model; 409 when the name is taken."""
        async with self._lock:
            if entry.name in self.registry.models or entry.name in self.registry.routes \
                    or entry.name in self.lifecycle.scorers:
                raise name_in_use(entry.name)
            try:
                if entry.kind == "reward":
                    await self.lifecycle.load_reward(entry.name, entry.path)
                elif entry.path is not None:
                    await self.lifecycle.load_model(entry.name, entry.path)
                else:
                    await self.lifecycle.load_adapter(entry.name, entry.adapter,
                                                      entry.base or self.lifecycle.default_base())
            except (VerlError, OSError, ValueError) as exc:
                raise ApiError(400, f"cannot load '{entry.name}': {exc}", param="path") from None
        self._changed()

    async def remove_model(self, name: str) -> None:
        """Stop routing to ``name``, let its requests finish, release it; the last model cannot go."""
        async with self._lock:
            if name not in self.registry.models and name not in self.lifecycle.scorers:
                raise no_such("model", name)
            if len(self.registry.names()) + len(self.lifecycle.scorers) == 1:
                raise last_model(name)
            try:
                await self.lifecycle.unload(name)
            except ValueError as exc:
                raise ApiError(409, str(exc), param="name", code="in_use") from None
        self._changed()

    def _changed(self) -> None:
        self.lifecycle.config_version += 1
        self.lifecycle.save_state()

"""Which model answers a request: the served models and the routes that split traffic between them.

A service serves one or more **full models** (each its own engine) and any number of **LoRA adapters** over a
full model's weights (served by that model's engine, not merged: N checkpoints of one run cost one base in memory).
A **route** maps a name to weights over models (``{"a": 0.9, "b": 0.1}``). A request's ``model`` field names a model
(served by it) or a route (one of its models, drawn by weight). With a user key (the request's ``user`` or the
``X-Verl-User`` header) the draw is a hash of route and user, so one user always sees one variant; raising a
variant's weight only moves users towards it (models keep their order in the route, so the cumulative intervals
grow monotonically), which is what a gradual promote needs.

Changes (new weights, a model loaded or unloaded) replace the route dict or add/remove an entry in one step on the
event loop, so a request sees either the old or the new state, never half of each. An unloaded model first stops
taking new requests (``retiring``); its engine or adapter is released when its last request finishes.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
from dataclasses import dataclass, field
from typing import Literal

from serve.engines.base import Engine
from serve.lineage import Lineage, lineage_of
from serve.settings import check_route

DEFAULT_ROUTE = "default"


@dataclass(eq=False)
class ServedModel:
    """One name clients can ask for."""

    name: str
    engine: Engine
    kind: Literal["model", "adapter"]
    base: str  # the full model whose engine serves it (itself for a full model)
    source: str  # the path or builtin name it was loaded from (logs and the admin API only, never /v1/models)
    created: int = field(default_factory=lambda: int(time.time()))
    lineage: Lineage = field(default_factory=Lineage)  # run, step and weights hash (headers and records)
    in_flight: int = 0
    retiring: bool = False
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def weight_version(self) -> int:
        """The version of the weights answering for this name now (moved by each in-place update: the engine's)."""
        return self.engine.weight_version(self.adapter)

    @property
    def adapter(self) -> str | None:
        """The adapter id inside the engine (the model's name), None for a full model."""
        return self.name if self.kind == "adapter" else None

    async def replace_weights(self, path: str, version: int) -> None:
        """The weights in directory ``path`` in place of this name's (``/update_weights``): tokens sampled from now
        on carry ``version``, responses and records the new directory's lineage."""
        await self.engine.update_weights(self.adapter, path, version)
        self.lineage = await asyncio.to_thread(lineage_of, path)

    def acquire(self) -> None:
        self.in_flight += 1
        self.idle.clear()

    def release(self) -> None:
        self.in_flight -= 1
        if self.in_flight <= 0:
            self.idle.set()


class UnknownModelError(LookupError):
    """The requested name is neither a served model nor a route."""


class ModelRegistry:
    """Served models by name, and routes over them."""

    def __init__(self) -> None:
        self.models: dict[str, ServedModel] = {}
        self.routes: dict[str, dict[str, float]] = {}
        # Shadow traffic: route -> (model, fraction): that share of the route's requests is also sent to the model,
        # recorded, never returned (``verl ship``'s shadow stage).
        self.shadows: dict[str, tuple[str, float]] = {}

    # ------------------------------------------------------------ lookup

    def names(self) -> list[str]:
        """Models that take new requests, in load order."""
        return [name for name, m in self.models.items() if not m.retiring]

    def full_models(self) -> list[ServedModel]:
        return [m for m in self.models.values() if m.kind == "model"]

    def engines(self) -> list[Engine]:
        """Every full model's engine, once (adapters share their base's)."""
        return list({id(m.engine): m.engine for m in self.full_models()}.values())

    def pick(self, requested: str | None, user: str | None) -> tuple[ServedModel, str | None]:
        """The model that answers a request naming ``requested`` (None: the default route, else the first model);
        returns it and the route used (None when a model was named directly)."""
        if requested is None:
            if DEFAULT_ROUTE in self.routes:
                requested = DEFAULT_ROUTE
            else:
                names = self.names()
                if not names:
                    raise UnknownModelError("no model is being served")
                return self.models[names[0]], None
        model = self.models.get(requested)
        if model is not None and not model.retiring:
            return model, None
        weights = self.routes.get(requested)
        if weights is None:
            raise UnknownModelError(requested)
        return self.models[draw(requested, weights, user)], requested

    # ------------------------------------------------------------ changes

    def add(self, model: ServedModel) -> None:
        if model.name in self.models or model.name in self.routes:
            raise ValueError(f"the name '{model.name}' is already in use")
        model.idle.set()
        self.models[model.name] = model

    def set_route(self, route: str, weights: dict[str, float]) -> None:
        """Replace ``route``'s weights (validated; models with weight 0 stay listed, so their users keep their
        place); the order of models already in the route is kept."""
        check_route(route, weights, set(self.names()))
        old = self.routes.get(route, {})
        ordered = {name: float(weights[name]) for name in old if name in weights}
        ordered.update({name: float(w) for name, w in weights.items() if name not in ordered})
        self.routes[route] = ordered

    def delete_route(self, route: str) -> None:
        self.routes.pop(route)

    def routes_using(self, name: str) -> list[str]:
        return [route for route, weights in self.routes.items() if weights.get(name, 0.0) > 0]

    def retire(self, name: str) -> ServedModel:
        """Stop routing new requests to ``name``; the caller waits for ``model.idle`` and then releases it."""
        model = self.models[name]
        using = self.routes_using(name)
        if using:
            raise ValueError(f"model '{name}' still has traffic on route(s) {', '.join(using)}; set its weight to 0 "
                             "first (verl promote ... --model OTHER)")
        adapters = [m.name for m in self.models.values() if m.kind == "adapter" and m.base == name]
        if adapters:
            raise ValueError(f"model '{name}' is the base of adapter(s) {', '.join(adapters)}; unload them first")
        model.retiring = True
        for weights in self.routes.values():
            weights.pop(name, None)
        return model

    def remove(self, name: str) -> None:
        self.models.pop(name, None)


def user_share(route: str, user: str) -> float:
    """A user's fixed point in [0, 1) for ``route`` (the first 8 bytes of a SHA-256, so it is the same in every
    process and every restart)."""
    digest = hashlib.sha256(f"{route}\0{user}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def draw(route: str, weights: dict[str, float], user: str | None) -> str:
    """The model for one request: by ``user``'s fixed share when given, else at random, in proportion to weight."""
    total = sum(weights.values())
    point = (user_share(route, user) if user else random.random()) * total
    chosen = None
    for name, weight in weights.items():
        if weight <= 0:
            continue
        chosen = name
        if point < weight:
            return name
        point -= weight
    return chosen  # rounding at the top end: the last model with weight

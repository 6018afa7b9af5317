"""Shadow traffic: a drawn share of a route's requests is mirrored to another model. Its answers are recorded
(``shadow: true``, scored like the user's) and dropped; a mirror never takes a slot a user needs and never answers
the user."""

from __future__ import annotations

import dataclasses
import random

from serve import log
from serve.admission import Admission, Responder
from serve.errors import ApiError
from serve.registry import ModelRegistry


class ShadowTraffic:
    """The mirrors set per route (``registry.shadows``: route -> (model, fraction)) and the draw per request."""

    def __init__(self, registry: ModelRegistry, admission: Admission, in_fleet: bool = False):
        self.registry, self.admission, self.in_fleet = registry, admission, in_fleet

    def put(self, route: str, model: str, fraction: float) -> None:
        """Mirror ``fraction`` of ``route``'s requests to ``model`` (per process: a fleet refuses it for now)."""
        if self.in_fleet:
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

    def delete(self, route: str) -> None:
        self.registry.shadows.pop(route, None)

    def mirror_of(self, target: Responder, sequences: int) -> Responder | None:
        """The responder of a mirrored copy of ``target``'s request (its ``sequences`` slots taken), or None: not
        drawn, no shadow on the route, the shadow is the model that answers, or no spare slots."""
        shadow = self.registry.shadows.get(target.route) if target.route is not None else None
        if shadow is None or random.random() >= shadow[1]:
            return None
        model = self.registry.models.get(shadow[0])
        if model is None or model.retiring or model is target.model or not self.admission.reserve_spare(sequences):
            return None
        return dataclasses.replace(target, model=model, shadow=True, route_share=0.0)

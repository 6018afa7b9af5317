"""``verl promote``: shift a route's traffic to a model on a running service (and load / unload models), through the
admin API. The service keeps serving throughout; see ``serve/admin.py``.

    verl promote --service http://127.0.0.1:8000 --route default --model b --weight 0.5   # canary to 50 %
    verl promote --service URL --route default --model b                                 # all traffic to b
    verl promote --service URL --route default --model a --unload b                      # roll back, free b
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import httpx

from verl.data.records import ADMIN_KEY_ENV
from verl.errors import VerlError


class PromoteError(VerlError):
    """The service refused or could not be reached; the message says why."""


def new_weights(current: dict[str, float], model: str, weight: float) -> dict[str, float]:
    """``model`` gets share ``weight`` of the route; the others keep their proportions of the rest.

    ``{a: 0.9, b: 0.1}`` with ``b`` at 0.5 -> ``{a: 0.5, b: 0.5}``; at 1.0 -> ``{a: 0.0, b: 1.0}`` (``a`` stays
    listed with weight 0, so sticky users keep their place for a later rollback)."""
    if not 0.0 <= weight <= 1.0:
        raise PromoteError(f"--weight must be between 0 and 1 (got {weight})")
    others = {name: w for name, w in current.items() if name != model}
    rest = sum(others.values())
    if weight < 1.0 and rest <= 0:
        raise PromoteError(f"the route has no other model with traffic to give the remaining {1 - weight:.0%}; use "
                           "--weight 1.0, or first give another model a weight")
    scaled = {name: (w / rest * (1.0 - weight) if rest > 0 else 0.0) for name, w in others.items()}
    return {**scaled, model: weight}


@dataclass
class AdminClient:
    url: str
    key: str
    timeout: float = 600.0

    def call(self, method: str, path: str, **kwargs) -> dict:
        try:
            response = httpx.request(method, self.url.rstrip("/") + "/admin" + path, timeout=self.timeout,
                                     headers={"Authorization": f"Bearer {self.key}"}, **kwargs)
        except httpx.HTTPError as exc:
            raise PromoteError(f"cannot reach the service at {self.url}: {exc}") from None
        if response.status_code == 404 and path == "/state":
            raise PromoteError(f"{self.url} has no admin API: start the service with {ADMIN_KEY_ENV} set")
        if response.status_code >= 400:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = response.text[:300]
            raise PromoteError(f"{method} /admin{path} -> {response.status_code}: {message}")
        return response.json()


def promote(url: str, route: str, model: str, weight: float = 1.0, key: str | None = None, load_path: str | None = None,
            load_adapter: str | None = None, base: str | None = None, unload: list[str] | None = None) -> dict:
    """Load ``model`` if asked, give it ``weight`` of ``route``, then unload ``unload``; returns the final state."""
    key = key or os.environ.get(ADMIN_KEY_ENV)
    if not key:
        raise PromoteError(f"no admin key: pass --admin-key or set {ADMIN_KEY_ENV} (the service's admin_api_key)")
    client = AdminClient(url, key)
    state = client.call("GET", "/state")
    if load_path or load_adapter:
        body = {"name": model, "path": load_path} if load_path else {"name": model, "adapter": load_adapter,
                                                                     "base": base}
        state = client.call("POST", "/models", json=body)
    if model not in {m["name"] for m in state["models"]}:
        raise PromoteError(f"the service has no model '{model}' (models: "
                           f"{', '.join(m['name'] for m in state['models'])}); load it with --path or --adapter")
    weights = new_weights(state["routes"].get(route, {}), model, weight)
    state = client.call("PUT", f"/routes/{route}", json={"weights": weights})
    for name in unload or []:
        state = client.call("DELETE", f"/models/{name}")
    return state

"""One process's inference service, composed of its roles (one module each):

- ``lifecycle`` (serve/lifecycle.py): the models and their engines, from load to release; health.
- ``admission`` (serve/admission.py): which model answers a request, and whether there is a slot for it.
- ``shadow`` (serve/shadow.py): mirrored traffic to a shadow model.
- ``pumps`` (serve/pumps.py): one task per sequence from the engine to the endpoint, and its online record.
- ``live_scoring`` (serve/live_scoring.py): a reward model scoring a sample of the answers in the background.
- ``changes``: admin changes, in this process (serve/changes.py) or through a fleet's control plane
  (serve/fleet_sync.py).

Endpoints turn bodies into sequences in serve/requests.py and answer them in serve/routes.py and
serve/streaming.py."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from serve import __version__
from serve.admission import Admission, PerKeyRateLimit
from serve.changes import LocalChanges
from serve.fleet_sync import FleetSync
from serve.lifecycle import ModelLifecycle, initial_models
from serve.live_scoring import LiveScoring
from serve.metrics import ServeMetrics
from serve.pumps import Pumps
from serve.records import OnlineRecords
from serve.registry import ServedModel
from serve.settings import ServeSettings
from serve.shadow import ShadowTraffic


class Service:
    """The roles of one serving process, wired together; startup, drain and shutdown across them."""

    def __init__(self, settings: ServeSettings, fleet: Any = None):
        self.settings = settings
        # A replica of ``verl serve --replicas``: a ``serve.fleet.FleetLink`` to the control plane, which then holds
        # the models and routes (admin changes go through it), else None (this process is the control plane).
        self.fleet = fleet
        self.created = int(time.time())
        entries, routes, note = initial_models(settings)
        self.metrics = ServeMetrics(entries[0].name, version=__version__)
        # A replica ships its rows to the control plane, which writes records_path for the whole fleet.
        self.records = (OnlineRecords(settings.records_path, **settings.records_options()) if fleet is None
                        else OnlineRecords(None, replica=fleet.replica, **settings.records_options()))
        self.feedback_limiter = PerKeyRateLimit(settings.feedback_rate_limit, settings.feedback_burst)
        self.lifecycle = ModelLifecycle(settings, self.metrics, entries, routes, note)
        registry = self.lifecycle.registry
        self.admission = Admission(settings, self.lifecycle, self.metrics, self.records)
        self.shadow = ShadowTraffic(registry, self.admission, in_fleet=fleet is not None)
        self.live_scoring = LiveScoring(settings.score_traffic, self.lifecycle, self.records, self.metrics)
        self.pumps = Pumps(settings, self.lifecycle, self.admission, self.shadow, self.metrics, self.records,
                           self.live_scoring)
        self.changes: LocalChanges | FleetSync = (FleetSync(fleet, self.lifecycle) if fleet is not None
                                                  else LocalChanges(self.lifecycle))
        self._abort_timer: asyncio.TimerHandle | None = None
        self.metrics.bind_gauges(running=lambda: sum(m.engine.num_running for m in registry.full_models()),
                                 waiting=lambda: sum(m.engine.num_waiting for m in registry.full_models()),
                                 kv_cache=lambda: kv_cache_usage(registry.full_models()),
                                 healthy=lambda: 1.0 if self.lifecycle.health()[0] == "ok" else 0.0)

    async def load(self) -> None:
        await self.lifecycle.load()
        self.live_scoring.start()

    def begin_drain(self) -> None:
        """Refuse new work; abort what is still running after ``drain_grace_s + shutdown_timeout_s``."""
        if self.lifecycle.status == "draining":
            return
        self.lifecycle.begin_drain()
        deadline = self.settings.drain_grace_s + self.settings.shutdown_timeout_s
        with contextlib.suppress(RuntimeError):
            self._abort_timer = asyncio.get_running_loop().call_later(deadline, self.pumps.abort_all)

    async def shutdown(self) -> None:
        self.begin_drain()
        await self.live_scoring.stop()
        await self.lifecycle.shutdown_engines()
        self.pumps.abort_all()


def kv_cache_usage(models: list[ServedModel]) -> float:
    """The served engines' mean KV-cache usage (each in [0, 1]; NaN where none can say): one gauge for the service,
    as vLLM has one for its one engine."""
    shares = [share for share in (m.engine.kv_cache_usage for m in models) if share == share]  # NaN != NaN
    return sum(shares) / len(shares) if shares else float("nan")


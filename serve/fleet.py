"""The service as Ray Serve replicas with one control plane (``verl serve --replicas N``; docs/serving.md).

Each replica is the same FastAPI app and engines as ``uvicorn serve.api:app``, built inside a Ray Serve deployment
(``VerlReplica``: the app is the deployment's ingress). What the replicas serve — models, adapters, routes — and its
version live in one place, the ``ControlPlane`` actor (named ``verl-control``, persisted through ``state_path`` and
restarted by Ray when it dies). A change is all or nothing, in two phases:

1. **prepare**: the control plane publishes the desired state as *pending* at version v+1; every live replica loads
   what is new (models, adapters) without routing to it, checks new in-place weights against what it serves
   without applying them, and reports *prepared v+1* (or the error);
2. **commit**: when every live replica prepared, the state becomes v+1; every replica switches its routes, copies
   new weights in place, pauses, resumes, sleeps or wakes its engines as the state says, unloads what is gone,
   and reports *active v+1*; the admin call answers when all live replicas report it.

A replica that fails to prepare, or does not switch in time, rolls the change back (a commit rolled back becomes
version v+2 holding v's content) and the admin call answers 409 naming the replicas that did not follow. Replicas
learn about changes by polling the control plane (every ``POLL_S``); a replica is *live* while its polls arrive
(within ``LIVE_S``). A replica that starts later (a restart, autoscaling) joins at the current version, not at
serve.yaml's. Every response carries ``X-Verl-Config-Version``. Online records travel with the polls: the control
plane holds the fleet's rows (``GET /admin/records`` on any replica) and is the one writer of ``records_path``.

Why polling and not pushing: a Ray Serve replica's methods are reachable only through its deployment handle, which
routes each call to *one* replica; pulling from one actor reaches all of them, also the ones that start later.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from serve import log
from verl.utils.fs import atomic_write_json

CONTROL_NAME = "verl-control"
NAMESPACE = "verl-serve"
APP_NAME = "verl"
POLL_S = 0.2  # how often a replica asks the control plane for changes
METRICS_EVERY_S = 1.0  # how often a replica ships its /metrics page (the fleet's page is at most this stale)
LIVE_S = 5.0  # a replica whose last poll is older than this is not counted (dead, or being replaced)
# A replica's last metrics page stays in the fleet's /metrics this long after its last poll. A poll that lapses past
# LIVE_S under load must not drop the replica's counters from one scrape and bring them back in the next: a reader
# of deltas (verl loadtest's cross-check, Prometheus' rate()) would count its whole history as new requests (the
# fleet test saw 516 served for 483 sent). A dead replica's series leave this long after it.
METRICS_KEEP_S = 30.0
CHANGE_TIMEOUT_S = 300.0  # prepare (loading a model) and switch, per phase
SETTLE_S = 10.0  # after one replica failed a phase, how long the others get to report before the rollback


def state_from_service(entries: list[Any], routes: dict[str, dict[str, float]]) -> dict:
    """The fleet state for configured ``ModelEntry`` items and routes (as ``Service.save_state`` writes them)."""
    models = [{"name": e.name, "path": e.path, "kind": e.kind} if e.path is not None  # kind: a reward model stays one
              else {"name": e.name, "adapter": e.adapter, "base": e.base} for e in entries]
    return {"models": models, "routes": {r: dict(w) for r, w in routes.items()}}


def desired_content(desired: dict) -> dict:
    """What a version holds: ``models`` (each may carry ``weights``: the directory and version of its latest
    in-place update), ``routes``, and ``engine`` (``paused``: a pause mode or None; ``sleeping``: a sleep level or
    None)."""
    return {"models": desired["models"], "routes": desired["routes"], "engine": dict(desired.get("engine") or {})}


class ControlPlane:
    """The single source of truth for what the replicas serve (a Ray actor; its methods run on one event loop)."""

    def __init__(self, initial: dict, state_path: str | None = None, records_path: str | None = None,
                 records_options: dict | None = None):
        from serve.records import OnlineRecords  # noqa: PLC0415  (imported in the actor's process)

        self.state_path = state_path
        # Every replica's rows (records_path: one writer). A control plane restarted by Ray after a crash reads
        # the rows it held back from the file, like any service that starts on an existing records file.
        self.records = OnlineRecords(records_path, **(records_options or {}))
        saved = None
        if state_path and Path(state_path).is_file():
            saved = json.loads(Path(state_path).read_text())
        self.state = {"version": int((saved or {}).get("version", 1)), **desired_content(saved or initial)}
        self.pending: dict | None = None
        self.replicas: dict[str, dict] = {}
        self.metrics: dict[str, str] = {}  # each replica's latest /metrics page
        self.lock = asyncio.Lock()
        self.started = time.time()
        self._persist()  # from the start: a restarted control plane (Ray restarts it) comes back from this file

    def _live(self) -> dict[str, dict]:
        now = time.monotonic()
        return {name: r for name, r in self.replicas.items() if now - r["seen"] < LIVE_S}

    async def report(self, replica: str, active: int, prepared: int, error: str | None,
                     records: list[dict] | None = None, metrics: str | None = None) -> dict:
        """A replica's poll: what it serves (``active`` version), what it has ready (``prepared``), a failed
        prepare, its new online records and (every ``METRICS_EVERY_S``) its metrics page; answers the state, the
        pending change, and the fleet's size."""
        if records:
            self.records.add_rows(records)
        if metrics is not None:
            self.metrics[replica] = metrics
        self.replicas[replica] = {"active": active, "prepared": prepared, "error": error, "seen": time.monotonic()}
        live = self._live()
        return {"state": self.state, "pending": self.pending, "live": len(live),
                "versions": sorted({r["active"] for r in live.values()})}

    async def records_since(self, since: float | None = None) -> list[dict]:
        return self.records.snapshot(since)

    async def feedback(self, completion_id: str, index: int, score: float, source: str, comment: str | None,
                       known: dict | None) -> dict:
        """A user's feedback, sent to any replica (serve.feedback.accept on the fleet's records: one index, one
        dedupe for the whole fleet). An id no replica has shipped yet may be in the answering replica's outbox:
        it is looked up again after two polls."""
        from serve.feedback import accept  # noqa: PLC0415

        verdict = accept(self.records, completion_id, index, score, source, comment, known)
        if verdict.outcome == "unknown_id":
            await asyncio.sleep(2 * POLL_S)
            verdict = accept(self.records, completion_id, index, score, source, comment, known)
        return dataclasses.asdict(verdict)

    async def metrics_pages(self) -> dict[str, str]:
        """The replicas' latest metrics pages, those polled within ``METRICS_KEEP_S`` (a dead replica's series leave
        after that, as a scrape target's go stale)."""
        now = time.monotonic()
        kept = {name for name, r in self.replicas.items() if now - r["seen"] < METRICS_KEEP_S}
        self.metrics = {name: page for name, page in self.metrics.items() if name in kept}
        return dict(self.metrics)

    async def get(self) -> dict:
        return {"state": self.state, "pending": self.pending, "replicas": {
            name: {k: v for k, v in r.items() if k != "seen"} for name, r in self._live().items()}}

    async def change(self, desired: dict, timeout_s: float = CHANGE_TIMEOUT_S) -> dict:
        """Move every live replica to ``desired`` (``models``, ``routes``) or none; see the module docstring."""
        async with self.lock:
            old = self.state
            version = old["version"] + 1
            self.pending = {"version": version, **desired_content(desired)}
            prepared, failed = await self._wait(lambda r: r["prepared"] >= version, version, timeout_s)
            if failed:
                self.pending = None
                return {"ok": False, "version": old["version"], "phase": "prepare", "replicas": failed}
            self.state, self.pending = {"version": version, **desired_content(desired)}, None
            self._persist()
            switched, failed = await self._wait(lambda r: r["active"] >= version, version, timeout_s)
            if failed:  # back to the old content, at a new version every replica will move to
                self.state = {**old, "version": version + 1}
                self._persist()
                return {"ok": False, "version": version + 1, "phase": "switch", "replicas": failed}
            return {"ok": True, "version": version, "replicas": switched}

    async def _wait(self, done, version: int, timeout_s: float) -> tuple[list[str], dict[str, str]]:
        """Wait until ``done`` holds for every live replica; returns (the ones that followed, the ones that did not
        with why). After the first failure the others get ``SETTLE_S`` more to finish or fail, so the answer names
        every replica that could not follow, not just the quickest."""
        deadline = time.monotonic() + timeout_s
        first_error: float | None = None
        while True:
            live = self._live()
            errors = {name: r["error"] for name, r in live.items() if r["error"] and f"v{version}:" in r["error"]}
            waiting = [name for name, r in live.items() if not done(r) and name not in errors]
            if errors and first_error is None:
                first_error = time.monotonic()
            if errors and not waiting:
                return [], errors
            if first_error is not None and time.monotonic() > min(deadline, first_error + SETTLE_S):
                return [], {**errors, **{name: "still working on it when the change was rolled back"
                                         for name in waiting}}
            if live and not waiting and not errors:
                return sorted(live), {}
            if time.monotonic() > deadline:
                return [], {name: f"did not reach version {version} within {timeout_s:g} s" for name in waiting}
            await asyncio.sleep(POLL_S / 2)

    def _persist(self) -> None:
        if self.state_path:
            atomic_write_json(Path(self.state_path), self.state)


def control_plane(create_with: dict | None = None, state_path: str | None = None,
                  records_path: str | None = None, records_options: dict | None = None) -> Any:
    """The running control plane's handle; with ``create_with`` (the initial state), start it if absent."""
    import ray  # noqa: PLC0415  (only the fleet needs ray)

    if create_with is None:
        return ray.get_actor(CONTROL_NAME, namespace=NAMESPACE)
    actor = ray.remote(ControlPlane).options(name=CONTROL_NAME, namespace=NAMESPACE, get_if_exists=True,
                                             max_restarts=-1, max_task_retries=-1, num_cpus=0, lifetime="detached")
    return actor.remote(create_with, state_path, records_path, records_options)


def _node_id() -> str | None:
    """The Ray node this process runs on (a replica's placement), or None outside Ray."""
    with contextlib.suppress(Exception):
        import ray  # noqa: PLC0415

        if ray.is_initialized():
            return ray.get_runtime_context().get_node_id()
    return None


class FleetLink:
    """A replica's side of the control plane: join at the current version, then follow changes (a poll task)."""

    def __init__(self) -> None:
        self.replica = f"{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.node = _node_id()
        self.active = 0
        self.prepared = 0
        self.error: str | None = None
        self.live = 0
        self.versions: list[int] = []
        self.joined: dict = {"models": [], "routes": {}}  # the state this replica joined at
        self._task: asyncio.Task | None = None

    async def join(self, service: Any) -> None:
        """Before the models load: serve the control plane's current state instead of the settings'."""
        reply = await control_plane().get.remote()  # read only: it reports in once it serves this version
        state = reply["state"]
        service.changes.join(state)
        self.joined = state
        self.active = self.prepared = int(state["version"])
        self.live = len(reply["replicas"])

    def start(self, service: Any) -> None:
        self._task = asyncio.create_task(self._follow(service))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    async def change(self, desired: dict) -> dict:
        return await control_plane().change.remote(desired)

    async def state(self) -> dict:
        return await control_plane().get.remote()

    async def records(self, since: float | None = None) -> list[dict]:
        return await control_plane().records_since.remote(since)

    async def feedback(self, completion_id: str, index: int, score: float, source: str, comment: str | None,
                       known: dict | None) -> dict:
        return await control_plane().feedback.remote(completion_id, index, score, source, comment, known)

    async def metrics_page(self, own: bytes) -> bytes:
        """Every live replica's series with a ``replica`` label; this replica's own page (``own``) is current, the
        others are as of their last shipment (at most ``METRICS_EVERY_S`` old)."""
        from serve.metrics import merge_expositions  # noqa: PLC0415

        try:
            pages = await control_plane().metrics_pages.remote()
        except Exception as exc:  # the control plane is restarting: this replica's series alone, still labelled
            log.warning("verl serve: control plane unreachable (%s); /metrics has this replica only", exc)
            pages = {}
        pages[self.replica] = own.decode()
        return merge_expositions(pages)

    async def _follow(self, service: Any) -> None:
        shipped = 0.0
        try:  # the joined version's in-place weights and pause or sleep, now that its models are loaded
            await service.changes.settle(self.joined)
        except Exception as exc:  # logged, not reported: nothing would undo it (a vanished weights directory)
            log.error("verl serve: cannot take version %d's weights or engine state: %s", self.active, exc)
        while True:
            records = service.records.drain()
            metrics = None
            if time.monotonic() - shipped >= METRICS_EVERY_S:
                metrics, shipped = service.metrics.exposition().decode(), time.monotonic()
            try:
                reply = await control_plane().report.remote(self.replica, self.active, self.prepared, self.error,
                                                            records, metrics)
            except Exception as exc:  # the control plane is restarting: keep serving what is in force
                service.records.outbox.extendleft(reversed(records))  # sent again with the next poll
                log.warning("verl serve: control plane unreachable (%s); routes in force stay", exc)
                await asyncio.sleep(1.0)
                continue
            self.live, self.versions = reply["live"], reply["versions"]
            pending, state = reply["pending"], reply["state"]
            if pending is not None and pending["version"] > max(self.prepared, self.active):
                try:
                    await service.changes.prepare(pending)
                    self.prepared, self.error = pending["version"], None
                except Exception as exc:
                    self.error = f"v{pending['version']}: {exc}"
                    log.error("verl serve: cannot prepare version %d: %s", pending["version"], exc)
                continue
            if state["version"] > self.active or (pending is None and (self.prepared > self.active or self.error)):
                # A new version, or a change rolled back after this replica loaded its models: serve the state.
                try:
                    await service.changes.commit(state)
                except Exception as exc:  # reported: the control plane rolls the change back on every replica
                    self.error = f"v{state['version']}: {exc}"
                    log.error("verl serve: cannot switch to version %d: %s", state["version"], exc)
                    await asyncio.sleep(POLL_S)
                    continue
                self.active = self.prepared = int(state["version"])
                self.error = None
                continue
            await asyncio.sleep(POLL_S)


class VerlReplica:
    """One replica of the Ray Serve deployment: builds the app (``__serve_build_asgi_app__``) with a ``FleetLink``.

    ``config``/``overrides``: what ``load_settings`` is given on the driver, re-read here (secrets travel as the
    ``VERL_SERVE_*`` environment of the replica, never in the deployment's arguments)."""

    def __init__(self, config: str | None, overrides: dict):
        import torch  # noqa: PLC0415

        from serve.settings import load_settings  # noqa: PLC0415

        self.settings = load_settings(config, load_in_background=False, **overrides)
        torch.set_num_threads(self.settings.torch_threads)
        self.fleet = FleetLink()

    def __serve_build_asgi_app__(self):
        from serve.api import create_app  # noqa: PLC0415

        return create_app(self.settings, fleet=self.fleet)


def deployment(replicas: int, config: str | None, overrides: dict, cpus_per_replica: float = 1.0,
               autoscaling: dict | None = None) -> Any:
    """The bound Ray Serve application: ``replicas`` copies of ``VerlReplica`` (or ``autoscaling`` settings,
    Ray Serve's ``autoscaling_config``, by ongoing requests)."""
    from ray import serve  # noqa: PLC0415

    env = {k: v for k, v in os.environ.items() if k.startswith(("VERL_", "HF_", "TRANSFORMERS_"))}
    options: dict[str, Any] = {"ray_actor_options": {"num_cpus": cpus_per_replica, "runtime_env": {"env_vars": env}},
                               "max_ongoing_requests": 256, "health_check_period_s": 2}
    if autoscaling:
        options["autoscaling_config"] = autoscaling
    else:
        options["num_replicas"] = replicas
    cls = serve.deployment(serve.ingress()(VerlReplica), name="VerlReplica", **options)
    return cls.bind(config, overrides)


def build_app(args: dict) -> Any:
    """A Ray Serve application builder, for people who run Ray Serve themselves::

        serve run serve.fleet:build_app replicas=2 config=serve.yaml

    Starts the control plane on the connected cluster (if it is not running) and returns the deployment."""
    from serve.settings import load_settings  # noqa: PLC0415

    config = args.get("config")
    replicas = int(args.get("replicas", 1))
    settings = load_settings(config, load_in_background=False)
    state_path = settings.state_path or str(Path(tempfile.mkdtemp(prefix="verl-fleet-")) / "state.json")
    control_plane(create_with=state_from_service(settings.model_entries(), settings.routes), state_path=state_path,
                  records_path=settings.records_path, records_options=settings.records_options())
    return deployment(replicas, config, {}, float(args.get("cpus_per_replica", 1.0)))


def run_fleet(config: str | None, overrides: dict, replicas: int, ray_address: str | None = None,
              max_replicas: int | None = None, cpus_per_replica: float = 1.0) -> None:
    """``verl serve --replicas N``: start (or join, with ``ray_address``) a Ray cluster, the control plane, and the
    deployment behind Ray Serve's HTTP proxy at the settings' host and port; block until Ctrl-C / SIGTERM, then stop
    the deployment and the control plane."""
    import signal  # noqa: PLC0415
    import threading  # noqa: PLC0415

    import ray  # noqa: PLC0415
    from ray import serve  # noqa: PLC0415

    from serve.settings import load_settings  # noqa: PLC0415

    settings = load_settings(config, load_in_background=False, **overrides)  # bad settings fail here, not in Ray
    if ray_address:
        ray.init(address=ray_address, namespace=NAMESPACE, log_to_driver=False)
    else:
        ray.init(num_cpus=max(os.cpu_count() or 1, int(replicas * cpus_per_replica + 0.999)), namespace=NAMESPACE,
                 include_dashboard=False, log_to_driver=False)
    initial = state_from_service(settings.model_entries(), settings.routes)
    # Without a configured state_path, a file of this run's own: a control plane that dies comes back from it.
    state_path = settings.state_path or str(Path(tempfile.mkdtemp(prefix="verl-fleet-")) / "state.json")
    control = control_plane(create_with=initial, state_path=state_path, records_path=settings.records_path,
                            records_options=settings.records_options())
    version = ray.get(control.get.remote())["state"]["version"]
    # One HTTP proxy, on the head node (Ray's default puts one on every node, each binding the same
    # port: behind a load balancer that is what you want, but two nodes on one host would collide).
    serve.start(http_options={"host": settings.host, "port": settings.port}, proxy_location="HeadOnly")
    autoscaling = None
    if max_replicas is not None:
        autoscaling = {"min_replicas": replicas, "max_replicas": max_replicas,
                       "target_ongoing_requests": max(1, settings.max_batch_size // 2)}
    serve.run(deployment(replicas, config, overrides, cpus_per_replica, autoscaling), name=APP_NAME,
              route_prefix="/", blocking=False)
    print(f"verl serve: {replicas} replica(s) on Ray Serve at http://{settings.host}:{settings.port} "
          f"(control plane '{CONTROL_NAME}', version {version}); Ctrl-C stops", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    print("verl serve: stopping the deployment and the control plane", flush=True)
    with contextlib.suppress(Exception):
        serve.shutdown()
    with contextlib.suppress(Exception):
        ray.kill(control)
    ray.shutdown()

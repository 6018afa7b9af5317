"""Model lifecycle: the models one process serves and their engines, from load to release, and the process's
health (``loading`` -> ``ok`` or ``dead`` -> ``draining``). Admin changes and the fleet load and unload through it."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

import torch

from serve import __version__, log
from serve.engines import create_engine
from serve.engines.base import Engine
from serve.engines.reward import RewardScorer
from serve.export import ADAPTER_CONFIG, select_checkpoint
from serve.lineage import lineage_of
from serve.metrics import ServeMetrics
from serve.registry import ModelRegistry, ServedModel
from serve.settings import ModelEntry, ServeSettings
from verl.errors import ConfigError
from verl.models.loader import pick_device
from verl.utils.fs import atomic_write_json


def initial_models(settings: ServeSettings) -> tuple[list[ModelEntry], dict[str, dict[str, float]], str | None]:
    """The models and routes to load: ``state_path``'s when the admin API saved some, else the settings'; and the
    note that says which."""
    if settings.state_path and Path(settings.state_path).is_file():
        entries, routes = read_state(Path(settings.state_path))
        return entries, routes, f"models and routes from {settings.state_path} (saved by the admin API)"
    return settings.model_entries(), dict(settings.routes), None


def primary_name(entries: list[ModelEntry]) -> str:
    """The primary model: the first chat model (the first entry when every model is a reward model)."""
    return next((e.name for e in entries if e.kind == "chat"), entries[0].name)


def read_state(path: Path) -> tuple[list[ModelEntry], dict[str, dict[str, float]]]:
    """The models and routes a previous run saved in ``state_path``; a damaged file is an error naming it."""
    try:
        data = json.loads(path.read_text())
        entries = [ModelEntry(**m) for m in data["models"]]
        routes = {str(k): {str(n): float(w) for n, w in v.items()} for k, v in data["routes"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"the service state file {path} is damaged ({exc}); fix or delete it (the service then "
                          "starts from serve.yaml's models and routes)") from None
    if not any(e.path is not None for e in entries):  # reward models count: a scoring-only service
        raise ConfigError(f"the service state file {path} lists no full model; delete it")
    return entries, routes


def resolve_adapter_dir(path: str) -> str:
    """A PEFT adapter dir: ``path`` itself (a LoRA run's checkpoint), or a LoRA run dir's best checkpoint (as
    ``verl export`` picks it)."""
    root = Path(path).expanduser()
    if (root / ADAPTER_CONFIG).is_file():
        return str(root)
    if (root / "checkpoints").is_dir():
        chosen = select_checkpoint(root, "best").checkpoint
        if (chosen / ADAPTER_CONFIG).is_file():
            return str(chosen)
        raise ConfigError(f"the best checkpoint of run '{path}' ({chosen.name}) is a full model, not a LoRA adapter; "
                          "serve its export with 'path' instead")
    raise ConfigError(f"'{path}' holds no LoRA adapter ({ADAPTER_CONFIG}); give a LoRA run dir or one of its "
                      "checkpoints (outputs/<project>/<run>/checkpoints/global_step_N), or serve a full export with "
                      "'path'")


class ModelLifecycle:
    """Loads, serves and releases the models (``registry``) and tracks what the process can do (``health``).

    ``entries``/``routes``: what to load at start (a replica of a fleet replaces them with the control plane's
    before loading). ``config_version``: the models-and-routes version responses are served at
    (``X-Verl-Config-Version``); each admin change or fleet switch moves it."""

    def __init__(self, settings: ServeSettings, metrics: ServeMetrics, entries: list[ModelEntry],
                 routes: dict[str, dict[str, float]], state_note: str | None = None):
        self.settings, self.metrics = settings, metrics
        self.entries, self.routes, self.state_note = entries, routes, state_note
        self.model_name = primary_name(entries)  # the primary model: /health, /tokenize, /generate without a route
        self.registry = ModelRegistry()
        self.scorers: dict[str, RewardScorer] = {}  # reward models (kind: reward): /classify and /pooling
        self.engine: Engine | None = None  # the primary model's engine
        self.config_version = 1
        self.status = "loading"
        self.detail: str | None = "the model is loading"

    def adopt(self, entries: list[ModelEntry], routes: dict[str, dict[str, float]], version: int) -> None:
        """Before loading: serve these models and routes at ``version`` instead (a fleet replica joining)."""
        self.entries, self.routes = entries, routes
        self.model_name, self.config_version = primary_name(entries), version

    def announce(self) -> None:
        """One prominent line naming the model and who chose it, so the built-in default is never served silently."""
        settings = self.settings
        if settings.config_file is not None:
            log.warning("verl serve: settings from %s (then VERL_SERVE_* env vars)", settings.config_file)
        if self.state_note:
            log.warning("verl serve: %s", self.state_note)
        if settings.models or self.state_note:
            log.warning("verl serve: serving %d models: %s", len(self.entries),
                        ", ".join(f"{e.name} ({e.path or 'adapter ' + str(e.adapter)})" for e in self.entries))
        elif settings.model_source == "default":
            log.warning("verl serve: no model configured; serving the built-in %s, and %s for tool-calling requests "
                        "(set VERL_SERVE_MODEL=<export dir> or model: in serve.yaml to serve yours)",
                        settings.model, ", ".join(e.name for e in self.entries[1:]))
        else:
            log.warning("verl serve: serving %s (from %s) as '%s'", settings.model, settings.model_source,
                        self.model_name)

    async def load(self) -> None:
        """Load every configured model (full models, then adapters over them) and set the routes."""
        self.announce()
        first_full = self.default_base()
        try:
            for entry in self.entries:
                if entry.kind == "reward":
                    await self.load_reward(entry.name, entry.path)
                elif entry.path is not None:
                    await self.load_model(entry.name, entry.path)
            for entry in self.entries:
                if entry.adapter is not None:
                    await self.load_adapter(entry.name, entry.adapter, entry.base or first_full or "")
            for route, weights in self.routes.items():
                self.registry.set_route(route, weights)
        except Exception as exc:
            self.status, self.detail = "dead", f"the model failed to load: {exc}"
            log.error("verl serve: %s", self.detail)
            raise
        if self.status == "loading":
            self.status, self.detail = "ok", None

    async def load_model(self, name: str, path: str) -> ServedModel:
        """Start an engine for the full model at ``path`` and serve it as ``name``."""
        engine = await asyncio.to_thread(create_engine, self.settings, path)
        # vLLM decides at start whether it can take adapters: yes when some are configured over this model, or when
        # the admin API may load them later.
        default = self.default_base()
        engine.lora_enabled = self.settings.admin_api_key is not None or any(
            e.adapter is not None and (e.base or default) == name for e in self.entries)
        await engine.start()
        model = ServedModel(name, engine, "model", name, path, lineage=await asyncio.to_thread(lineage_of, path))
        self.registry.add(model)
        if self.engine is None:
            self.engine = engine
            self.metrics.set_engine(engine.name, __version__)
        log.info("verl serve: %s ready on the %s engine (context %d tokens)", name, engine.name, engine.max_model_len)
        return model

    async def load_reward(self, name: str, path: str) -> RewardScorer:
        """Serve the reward model (sequence classifier) at ``path`` as ``name`` on /classify and /pooling."""
        if name in self.registry.models or name in self.registry.routes or name in self.scorers:
            raise ConfigError(f"the name '{name}' is already in use")
        scorer = await asyncio.to_thread(RewardScorer, path, getattr(torch, self.settings.dtype),
                                         pick_device(self.settings.device))
        scorer.lineage = await asyncio.to_thread(lineage_of, path)
        self.scorers[name] = scorer
        log.info("verl serve: reward model %s ready (%d class%s)", name, scorer.num_labels,
                 "" if scorer.num_labels == 1 else "es")
        return scorer

    def default_base(self) -> str | None:
        """The full model an adapter without ``base`` applies to: the first one served (the first configured one
        while loading); None when no chat model is served."""
        fulls = self.registry.full_models()
        if fulls:
            return fulls[0].name
        return next((e.name for e in self.entries if e.path is not None and e.kind == "chat"), None)

    async def load_adapter(self, name: str, path: str, base: str) -> ServedModel:
        """Serve the LoRA adapter at ``path`` as ``name`` over full model ``base``'s engine (not merged)."""
        base_model = self.registry.models.get(base)
        if base_model is None or base_model.kind != "model" or base_model.retiring:
            raise ConfigError(f"adapter '{name}': base '{base}' is not a served full model")
        if not base_model.engine.supports_adapters:
            raise ConfigError(f"adapter '{name}': the {base_model.engine.name} engine does not serve LoRA adapters")
        if name in self.registry.models or name in self.registry.routes:
            raise ConfigError(f"the name '{name}' is already in use")
        directory = resolve_adapter_dir(path)
        await base_model.engine.add_adapter(name, directory)
        model = ServedModel(name, base_model.engine, "adapter", base, path,
                            lineage=await asyncio.to_thread(lineage_of, directory))
        self.registry.add(model)
        log.info("verl serve: adapter %s (%s) ready over %s", name, directory, base)
        return model

    async def unload(self, name: str) -> None:
        """Stop routing to ``name``, let its requests finish (up to ``request_timeout_s``), then release it."""
        if name in self.scorers:  # a reward model: scoring calls are short and hold no queue slot
            await self.scorers.pop(name).shutdown()
            log.info("verl serve: reward model %s unloaded", name)
            return
        model = self.registry.retire(name)
        self.registry.shadows = {r: v for r, v in self.registry.shadows.items() if v[0] != name}
        try:
            await asyncio.wait_for(model.idle.wait(), self.settings.request_timeout_s)
        except TimeoutError:
            log.warning("verl serve: %s still had %d requests after %g s; releasing it anyway", name,
                        model.in_flight, self.settings.request_timeout_s)
        self.registry.remove(name)
        if model.kind == "adapter":
            await model.engine.remove_adapter(name)
        else:
            await model.engine.shutdown(self.settings.shutdown_timeout_s)
            if model.engine is self.engine:
                fulls = self.registry.full_models()
                self.engine = fulls[0].engine if fulls else None
                self.model_name = fulls[0].name if fulls else self.model_name
        log.info("verl serve: %s unloaded", name)

    async def unload_all(self, names: list[str]) -> None:
        for name in names:
            with contextlib.suppress(ValueError, KeyError):  # already gone, or unloaded by a later change
                await self.unload(name)

    def save_state(self) -> None:
        """Write the served models and routes to ``state_path`` (atomically), after an admin change (in a fleet the
        control plane keeps them, and replicas never call this)."""
        if not self.settings.state_path:
            return
        models = []
        for m in self.registry.models.values():
            if not m.retiring:
                models.append({"name": m.name, "path": m.source} if m.kind == "model"
                              else {"name": m.name, "adapter": m.source, "base": m.base})
        models += [{"name": name, "path": scorer.source, "kind": "reward"} for name, scorer in self.scorers.items()]
        atomic_write_json(Path(self.settings.state_path), {"models": models, "routes": self.registry.routes})

    def health(self) -> tuple[str, str | None]:
        """``(status, detail)``: ``ok`` only while every full model's engine is alive."""
        if self.status == "ok":
            dead = [m.name for m in self.registry.full_models() if not m.engine.is_healthy()]
            dead += [name for name, scorer in self.scorers.items() if not scorer.is_healthy()]
            if dead or (self.engine is None and not self.scorers):
                self.status = "dead"
                self.detail = f"the engine worker of {', '.join(dead)} stopped" if dead else "no model is served"
        return self.status, self.detail

    def begin_drain(self) -> None:
        if self.status in ("ok", "loading"):
            self.status, self.detail = "draining", "the server is shutting down"

    async def shutdown_engines(self) -> None:
        engines = [m.engine for m in self.registry.full_models()] + list(self.scorers.values())
        await asyncio.gather(*(e.shutdown(self.settings.shutdown_timeout_s) for e in engines), return_exceptions=True)

"""Routing and admission: which model answers a request (``Responder``: a model picked directly or by a route's
weights for a user) and whether there is room for it (a fixed number of sequence slots; the queue never grows past
``max_queue_size``, a refusal is a 429 and a failed request in the records), and a per-key rate limit for calls that
hold no slot (``PerKeyRateLimit``: users' feedback)."""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Any

from serve.engines.base import Engine
from serve.errors import ApiError
from serve.lifecycle import ModelLifecycle
from serve.metrics import ServeMetrics
from serve.records import RULE_SCORER_VERSION, OnlineRecords, clip_prompt, score
from serve.registry import ServedModel, UnknownModelError
from serve.schemas import VerlExtension
from serve.settings import ServeSettings
from verl.data.records import OnlineRecord, user_hash
from verl.errors import ConfigError


@dataclass
class Responder:
    """Who answers one request and what is recorded about it: the model (picked directly or by ``route``) and the
    request's ``verl`` extension (a rule reward to score the response with)."""

    model: ServedModel
    route: str | None = None
    online: VerlExtension | None = None
    shadow: bool = False  # a mirrored copy of a request (never returned)
    user: str | None = None  # the routed user, hashed (verl.data.records.user_hash)
    arrival: float | None = None  # wall clock when it was routed
    config_version: int | None = None  # the models-and-routes version it was routed under
    route_share: float | None = None  # the model's share of the route then
    prompt: Any = None  # the prompt as sent, kept only with record_texts (serve.records.clip_prompt)
    not_for_training: bool = False  # the client's verl.not_for_training, or the service's setting
    choices: int = 1  # the request's sequences (prompts x n), set at admission
    episode: str | None = None  # training traffic: its episode id (its records carry the token ids)
    plan: Any = None  # training traffic on chat: the request's ToolPlan (the answer's calls are parsed with it)

    @property
    def name(self) -> str:
        return self.model.name

    def headers(self) -> dict[str, str]:
        """Response headers naming the variant that answered (and the route that chose it) and the version of its
        weights when the headers were sent (a streamed answer's later tokens may be newer: its record says)."""
        headers = {"X-Verl-Model": self.model.name, **self.model.lineage.headers(),
                   "X-Verl-Weight-Version": str(self.model.weight_version)}
        if self.route is not None:
            headers["X-Verl-Route"] = self.route
        return headers

    def record(self, request_id: str | None, index: int, now: float, prompt_tokens: int, produced: int,
               ttft: float | None, e2e: float, finish: str, error: str | None, reward: float | None,
               prompt_id: str | None = None, answer: str | None = None, max_chars: int = 0,
               **tokens: Any) -> OnlineRecord:
        """The online record of one of this request's sequences (choice ``index``); ``answer`` is kept only when
        the prompt is (record_texts), cut at ``max_chars``."""
        online = self.online
        if online is not None and online.prompt_id:
            prompt_id = online.prompt_id
        ruled = self.rule_scored
        prompt, cut = clip_prompt(self.prompt, max_chars) if self.prompt is not None else (None, False)
        if self.prompt is not None and answer is not None and len(answer) > max_chars:
            answer, cut = answer[:max_chars], True
        return OnlineRecord(
            time=now, model=self.name, route=self.route, prompt_id=prompt_id or "", prompt_tokens=prompt_tokens,
            completion_tokens=produced, ttft_s=ttft, e2e_s=e2e, finish_reason=finish, error=error, reward=reward,
            shadow=self.shadow, id=request_id, index=index, choices=self.choices, user=self.user, arrival=self.arrival,
            config_version=self.config_version, route_share=self.route_share, reward_expected=ruled,
            reward_source=f"rule:{online.reward}" if ruled else None,
            scorer_version=RULE_SCORER_VERSION if ruled else None, not_for_training=self.not_for_training,
            prompt=prompt, answer=answer if self.prompt is not None else None, texts_truncated=cut,
            episode=self.episode, **tokens, **self.model.lineage.fields())

    @property
    def rule_scored(self) -> bool:
        """The request carried an answer to score its response against (the `verl` field's ground_truth)."""
        return self.online is not None and self.online.ground_truth is not None


class Admission:
    """Picks the responder of each request and holds the sequence slots (``in_flight`` of ``capacity``)."""

    def __init__(self, settings: ServeSettings, lifecycle: ModelLifecycle, metrics: ServeMetrics,
                 records: OnlineRecords):
        self.settings, self.lifecycle, self.metrics, self.records = settings, lifecycle, metrics, records
        self.capacity = settings.max_batch_size + settings.max_queue_size
        self.in_flight = 0
        self.training_in_flight = 0  # of in_flight: training traffic's (at most training_max_slots_share)
        self.training_capacity = max(1, int(self.capacity * settings.training_max_slots_share))

    def ready(self) -> None:
        """Nothing, or the 503 while loading, draining or dead."""
        status, detail = self.lifecycle.health()
        if status != "ok":
            self.metrics.rejected.labels(self.lifecycle.model_name, status).inc()
            raise ApiError(503, f"service unavailable: {detail}", type="service_unavailable", code=status,
                           headers={"Retry-After": str(self.settings.retry_after_s)})

    def ready_engine(self) -> Engine:
        """The primary model's engine, or the 503 while loading, draining or dead (a 400 on a service that serves
        only reward models: nothing here generates)."""
        self.ready()
        if self.lifecycle.engine is None:
            raise ApiError(400, f"this service serves only reward models ({', '.join(self.lifecycle.scorers)}): "
                           "score texts with POST /classify or /pooling", param="model", code="model_not_found")
        return self.lifecycle.engine

    def target(self, requested: str | None, user: str | None, online: VerlExtension | None = None,
               prompt: Any = None) -> Responder:
        """The model that answers a request naming ``requested`` (a model, a route, or None for the default);
        ``prompt`` is the prompt as sent (recorded only with record_texts)."""
        self.ready_engine()
        registry = self.lifecycle.registry
        if requested in self.lifecycle.scorers:
            raise ApiError(400, f"'{requested}' is a reward model: it scores texts (POST /classify or /pooling) and "
                           "does not generate; send chat and completion requests to a chat model or a route",
                           param="model", code="wrong_model_kind")
        try:
            model, route = registry.pick(requested, user)
        except UnknownModelError:
            served = ", ".join([*registry.names(), *registry.routes]) or "none"
            raise ApiError(404, f"The model '{requested}' does not exist (served models and routes: {served}; see "
                           "/v1/models)", type="invalid_request_error", param="model",
                           code="model_not_found") from None
        if online is not None and online.ground_truth is not None:
            try:
                score(online.reward, "", online.ground_truth)
            except ConfigError as exc:
                raise ApiError(400, f"verl.reward: {exc}", param="verl.reward") from None
        share = None
        if route is not None:
            weights = registry.routes[route]
            share = weights.get(model.name, 0.0) / (sum(w for w in weights.values() if w > 0) or 1.0)
        return Responder(model, route, online, user=user_hash(user), arrival=time.time(),
                         config_version=self.lifecycle.config_version, route_share=share,
                         prompt=prompt if self.settings.record_texts else None,
                         not_for_training=self.settings.records_not_for_training or bool(
                             online is not None and online.not_for_training))

    def admit(self, sequences: int, target: Responder, request_id: str) -> None:
        """Reserve ``sequences`` slots or refuse: the queue never grows past ``max_queue_size``. A refusal at
        capacity is recorded as failed requests of ``target`` (the canary counts it against the model)."""
        target.choices = sequences
        if sequences > self.capacity:
            raise ApiError(400, f"the request needs {sequences} sequences (prompts x n) but this server holds at "
                           f"most {self.capacity}; split it", param="n")
        if self.in_flight + sequences > self.capacity:
            self.metrics.rejected.labels(self.lifecycle.model_name, "queue_full").inc()
            now = time.time()
            for index in range(sequences):
                self.records.add(target.record(request_id, index, now, 0, 0, None, now - (target.arrival or now),
                                               "abort", "queue_full: 429 at capacity", None))
            raise ApiError(429, f"the server is at capacity ({self.in_flight} sequences in flight, limit "
                           f"{self.capacity}); retry later", type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(self.settings.retry_after_s)})
        if target.episode is not None:
            if self.training_in_flight + sequences > self.training_capacity:
                self.metrics.rejected.labels(self.lifecycle.model_name, "training_share_full").inc()
                raise ApiError(429, f"training traffic holds {self.training_in_flight} of its {self.training_capacity} "
                               "sequence slots (training_max_slots_share); retry later", type="rate_limit_error",
                               code="training_share_full", headers={"Retry-After": str(self.settings.retry_after_s)})
            self.training_in_flight += sequences
        self.in_flight += sequences

    def reserve_spare(self, sequences: int) -> bool:
        """Take ``sequences`` slots only if they are free (work no client waits for: never a 429, never queued)."""
        if self.in_flight + sequences > self.capacity:
            return False
        self.in_flight += sequences
        return True

    def release(self, sequences: int = 1, training: bool = False) -> None:
        self.in_flight -= sequences
        if training:
            self.training_in_flight -= sequences


class PerKeyRateLimit:
    """A token bucket per key: ``rate`` calls per second, ``burst`` at once; the ``max_keys`` most recent keys."""

    def __init__(self, rate: float, burst: int, max_keys: int = 10_000):
        self.rate, self.burst, self.max_keys = rate, burst, max_keys
        self.buckets: collections.OrderedDict[str, tuple[float, float]] = collections.OrderedDict()

    def allow(self, key: str, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        tokens, last = self.buckets.pop(key, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - last) * self.rate)
        allowed = tokens >= 1.0
        self.buckets[key] = (tokens - 1.0 if allowed else tokens, now)
        while len(self.buckets) > self.max_keys:
            self.buckets.popitem(last=False)
        return allowed

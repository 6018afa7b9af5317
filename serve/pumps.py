"""Sequence pumps: one asyncio task per sequence reads its engine stream, hands each output to the endpoint's
``sink``, frees the slot and writes the sequence's online record (scored when the request asked for a reward)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from serve import log
from serve.admission import Admission, Responder
from serve.engines.base import EngineError, EngineOutput, EngineRequest, RequestFailedError, SamplingOptions
from serve.lifecycle import ModelLifecycle
from serve.live_scoring import Answer, LiveScoring
from serve.metrics import SequenceTimer, ServeMetrics
from serve.records import OnlineRecords, prompt_hash, score
from serve.settings import ServeSettings
from serve.shadow import ShadowTraffic
from serve.tool_calling import response_message

TIMEOUT_CANCEL = "verl-timeout"  # the message a pump is cancelled with when its request timed out (an error row)


@dataclass
class SequenceSpec:
    index: int  # the choice index in the response
    prompt_index: int
    prompt_ids: list[int]
    sampling: SamplingOptions


@dataclass
class SequenceResult:
    """What one sequence produced, assembled from its deltas."""

    text: list[str] = field(default_factory=list)
    tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: BaseException | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # TokenLogprob per generated token, when asked for
    prompt_logprobs: list | None = None  # TokenLogprob | None per prompt token, when asked for


Sink = Callable[[int, EngineOutput | BaseException], None]


class Pumps:
    """The running sequences (``tasks``) of every request, mirrors included."""

    def __init__(self, settings: ServeSettings, lifecycle: ModelLifecycle, admission: Admission,
                 shadow: ShadowTraffic, metrics: ServeMetrics, records: OnlineRecords, live: LiveScoring):
        self.settings, self.lifecycle, self.admission, self.shadow = settings, lifecycle, admission, shadow
        self.metrics, self.records, self.live = metrics, records, live
        self.tasks: set[asyncio.Task] = set()

    def start(self, request_id: str, specs: list[SequenceSpec], sink: Sink, stream: bool,
              target: Responder) -> list[asyncio.Task]:
        """One task per sequence (its slot already admitted), reading the engine stream and passing each output to
        ``sink``; a drawn share of a route's requests is mirrored to its shadow model too."""
        tasks = self._spawn(target, request_id, request_id, specs, stream, sink)
        mirror = self.shadow.mirror_of(target, len(specs))
        if mirror is not None:
            self._spawn(mirror, request_id, f"{request_id}-shadow", specs, stream, lambda _i, _out: None)
        return tasks

    def _spawn(self, target: Responder, request_id: str, engine_id: str, specs: list[SequenceSpec], stream: bool,
               sink: Sink) -> list[asyncio.Task]:
        arrival = time.perf_counter()
        tasks = []
        for spec in specs:
            timer = SequenceTimer(self.metrics, arrival, len(spec.prompt_ids), label=target.name)
            req = EngineRequest(f"{engine_id}-{spec.index}", spec.prompt_ids, spec.sampling, arrival, stream,
                                adapter=target.model.adapter, training=target.episode is not None)
            target.model.acquire()
            task = asyncio.create_task(self._pump(target, req, request_id, spec.index, timer, sink))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
            tasks.append(task)
        return tasks

    def abort_all(self) -> None:
        for task in list(self.tasks):
            task.cancel()

    async def _pump(self, target: Responder, req: EngineRequest, request_id: str, index: int, timer: SequenceTimer,
                    sink: Sink) -> None:
        finish, produced, error = "abort", 0, None
        text: list[str] = []
        sampled: list[int] = []  # training traffic: the ids and their log-probs, for its record
        logprobs: list[float] = []
        versions: list[int] = []
        scored = self.live.draws(target)
        try:
            self._inject_fault(target)
            stream = target.model.engine.generate(req)
            try:
                async for out in stream:
                    timer.on_output(time.perf_counter(), len(out.token_ids), out.scheduled_time, out.token_times)
                    produced = out.num_generated_tokens
                    if target.rule_scored or target.prompt is not None or scored or target.episode is not None:
                        text.append(out.text)
                    if target.episode is not None:
                        sampled.extend(out.token_ids)
                        logprobs.extend(entry.logprob for entry in out.logprobs or [])
                    versions.extend(out.weight_versions or [])
                    sink(index, out)
                    if out.finished:
                        finish = out.finish_reason
            finally:
                await stream.aclose()  # aborts the sequence in the engine if it is still running
        except asyncio.CancelledError as exc:
            # Timeout, disconnect or shutdown deadline: the consumer (if any) sees an aborted sequence. A timeout is
            # the service's failure (recorded as an error); a client that left is not.
            if TIMEOUT_CANCEL in exc.args:
                error = f"timeout: not finished within {self.settings.request_timeout_s:g} s"
            sink(index, EngineOutput("", [], produced, finish_reason="abort"))
            raise
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            self.metrics.errors.labels(target.name).inc()
            sink(index, exc)
        finally:
            self.admission.release(training=target.episode is not None)
            target.model.release()
            end = time.perf_counter()
            timer.on_finish(end, finish)
            tokens = version_fields(target, versions) if target.episode is None else training_fields(
                target, req, sampled, logprobs, versions, "".join(text), finish)
            self._record(target, req, request_id, index, timer, end, finish, produced, error, "".join(text), tokens)
            if scored and error is None and finish != "abort":
                self.live.offer(Answer(target, request_id, index, list(req.prompt_token_ids), "".join(text)))

    def _inject_fault(self, target: Responder) -> None:
        """Test-only (``fault_error_rate``): fail a share of a model's requests as an engine would."""
        rates = self.settings.fault_error_rate
        rate = rates.get(target.name, rates.get("*", 0.0)) if isinstance(rates, dict) else rates
        if rate > 0 and random.random() < rate:
            raise RequestFailedError(f"injected fault (fault_error_rate {rate:g} for {target.name})")

    def _record(self, target: Responder, req: EngineRequest, request_id: str, index: int, timer: SequenceTimer,
                end: float, finish: str, produced: int, error: str | None, text: str, tokens: dict) -> None:
        """One online record per finished sequence; the reward when the request asked for one."""
        reward = None
        online = target.online
        if online is not None and target.rule_scored and error is None and finish != "abort":
            try:
                reward = score(online.reward, text, online.ground_truth)
            except (EngineError, ValueError, TypeError) as exc:  # a reward that cannot score this text: no reward
                log.warning("verl serve: reward %s failed on a response: %r", online.reward, exc)
            if reward is not None:
                self.metrics.reward.labels(target.name).observe(reward)
        self.records.add(target.record(request_id, index, time.time(), len(req.prompt_token_ids), produced, timer.ttft,
                                       end - timer.arrival, finish, error, reward, prompt_hash(req.prompt_token_ids),
                                       answer=text, max_chars=self.settings.record_texts_max_chars, **tokens))


def training_fields(target: Responder, req: EngineRequest, sampled: list[int], logprobs: list[float],
                    versions: list[int], text: str, finish: str) -> dict:
    """What a training record adds (verl.data.records.OnlineRecord): the prompt's ids as the engine got them,
    the sampled ids with their log-probs, the weight version that sampled the first id (and each id's, when an
    in-place update came in between) and, on chat with tools, the calls parsed."""
    calls = None
    if target.plan is not None and target.plan.parses_calls:
        message, _ = response_message(text, finish, target.plan)
        calls = message.get("tool_calls") or []
    return {"prompt_ids": list(req.prompt_token_ids), "token_ids": sampled, "logprobs": logprobs,
            **version_fields(target, versions), "tool_calls": calls}


def version_fields(target: Responder, versions: list[int]) -> dict:
    """Every record's weight version: the one that sampled its first token (the current one when it sampled none),
    and each token's when an in-place update came mid-answer (pause mode keep)."""
    return {"weight_version": versions[0] if versions else target.model.weight_version,
            "weight_versions": versions if len(set(versions)) > 1 else None}

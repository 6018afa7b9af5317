"""Scoring live traffic (``score_traffic``): a reward model scores a sample of the answers the service gives, in
the background, and each score becomes a reward row (``reward_source: rm:NAME``) beside its request — what
``verl ship --reward-source rm:NAME`` and ``verl compare --online --reward-source rm:NAME`` decide on when users'
requests carry no answer.

Never on a user's path: a sequence is drawn when it starts (``draws``), its answer is queued when it finishes
(``offer``: a bounded queue; full, the answer is not scored and counted ``dropped``), and one task scores the queue
in batches — on a reward model served here (its own thread, no generation slot) or behind a URL
(``verl.rewards.remote.RemoteRewardModel``: retries, backoff; in a worker thread). What is scored is what the
trainer sends a reward model: the prompt as the policy saw it (its chat template, decoded from the prompt's token
ids) followed by the answer. A score that could not be obtained is recorded as nothing (counted ``failed``), never
as 0. Mirrored answers (the shadow stage) are scored too: the shadow stage pairs them with the incumbent's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
from dataclasses import dataclass
from typing import Any

from serve.admission import Responder
from serve.lifecycle import ModelLifecycle
from serve.metrics import ServeMetrics
from serve.records import OnlineRecords, reward_row
from serve.settings import LiveScoringSettings
from verl.errors import DataError

log = logging.getLogger("uvicorn.error.serve")


@dataclass
class Answer:
    """A finished sequence waiting for its score."""

    target: Responder
    request_id: str
    index: int
    prompt_ids: list[int]
    text: str


class LiveScoring:
    """The sampler, the queue and the scoring task (see the module docstring); inert without ``score_traffic``."""

    def __init__(self, config: LiveScoringSettings | None, lifecycle: ModelLifecycle, records: OnlineRecords,
                 metrics: ServeMetrics):
        self.config, self.lifecycle, self.records, self.metrics = config, lifecycle, records, metrics
        self.queue: asyncio.Queue[Answer] | None = None
        self.task: asyncio.Task | None = None
        self.remote: Any = None
        if config is not None and config.remote is not None:
            from verl.rewards.remote import RemoteRewardModel  # noqa: PLC0415  (a remote scorer only)

            url, name = config.remote
            self.remote = RemoteRewardModel(url, model=name, score=config.score, batch_size=config.batch_size,
                                            timeout_s=config.timeout_s)

    def start(self) -> None:
        if self.config is not None:
            self.queue = asyncio.Queue(self.config.max_pending)
            self.task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        if self.remote is not None:
            self.remote.close()

    def draws(self, target: Responder) -> bool:
        """Whether this request's answers are to be scored (drawn when it starts, so its text is kept)."""
        c = self.config
        return (c is not None and self.queue is not None and (not c.routes or target.route in c.routes)
                and random.random() < c.fraction)

    def offer(self, answer: Answer) -> None:
        """Queue a drawn, finished answer; a full queue drops it (counted) rather than wait."""
        assert self.queue is not None
        try:
            self.queue.put_nowait(answer)
        except asyncio.QueueFull:
            self.metrics.live_scores.labels(answer.target.name, "dropped").inc()

    async def _run(self) -> None:
        assert self.queue is not None and self.config is not None
        while True:
            batch = [await self.queue.get()]
            while len(batch) < self.config.batch_size and not self.queue.empty():
                batch.append(self.queue.get_nowait())
            try:
                scores, version = await self._score(batch)
            except Exception as exc:  # noqa: BLE001 - a scorer failure costs these scores, never the service
                log.warning("verl serve: live scoring failed on %d answers: %r", len(batch), exc)
                scores, version = [math.nan] * len(batch), None
            for answer, value in zip(batch, scores, strict=True):
                target = answer.target
                if not math.isfinite(value):
                    self.metrics.live_scores.labels(target.name, "failed").inc()
                    continue
                self.metrics.live_scores.labels(target.name, "scored").inc()
                self.metrics.live_score.labels(target.name).observe(value)
                self.records.add(reward_row(answer.request_id, answer.index, value, self.config.source,
                                            model=target.name, route=target.route, shadow=target.shadow,
                                            scorer_version=version))

    async def _score(self, batch: list[Answer]) -> tuple[list[float], str | None]:
        """One score per answer (NaN where none), and the scorer's version."""
        texts = [answer.target.model.engine.tokenizer.decode(answer.prompt_ids, skip_special_tokens=False)
                 + answer.text for answer in batch]
        config = self.config
        assert config is not None
        if self.remote is not None:
            values, _ = await asyncio.to_thread(self.remote.score, texts)
            return [float(v) for v in values], config.scorer
        scorer = self.lifecycle.scorers.get(config.scorer)
        if scorer is None:
            raise RuntimeError(f"the reward model '{config.scorer}' is not served (unloaded?)")
        out = []
        for text in texts:  # one by one through encode: a text too long for the scorer fails alone
            try:
                out.append(scorer.encode([text], False, None)[0])
            except DataError:
                out.append(None)
        kept = [ids for ids in out if ids is not None]
        scored = await scorer.score(kept, config.score == "probability") if kept else None
        values = iter(scored.values if scored is not None else [])
        version = scorer.lineage.fields().get("weights") or scorer.source
        return [math.nan if ids is None else float(next(values)[0]) for ids in out], version

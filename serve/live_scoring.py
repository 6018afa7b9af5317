"""Scoring live traffic (``score_traffic``): a reward model or a chat judge scores a sample of the answers the
service gives, in the background, and each score becomes a reward row (``reward_source: rm:NAME`` / ``judge:NAME``)
beside its request — what ``verl ship --reward-source rm:NAME`` and ``verl compare --online --reward-source ...``
decide on when users' requests carry no answer.

Never on a user's path: a sequence is drawn when it starts (``draws``), its answer is queued when it finishes
(``offer``: a bounded queue; full, the answer is not scored and counted ``dropped``), and one task scores the queue
in batches — on a reward model served here (its own thread, no generation slot) or behind a URL
(``verl.rewards.remote.RemoteRewardModel``: retries, backoff; in a worker thread). What a reward model scores is
what the trainer sends one: the prompt as the policy saw it (its chat template, decoded from the prompt's token
ids) followed by the answer. A chat judge (``judge:URL#NAME``, always behind a URL: it generates, and would take the
served models' slots) reads the conversation as text and the answer between nonce markers, by the evaluator's
pointwise rubric (``verl.rewards.judge.PointwiseRubric``), and its ``Score: N`` on ``scale`` maps to [0, 1].
A score that could not be obtained is recorded as nothing (counted ``failed``), never
as 0. Mirrored answers (the shadow stage) are scored too: the shadow stage pairs them with the incumbent's.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import os
import random
from dataclasses import dataclass
from typing import Any

from serve import log
from serve.admission import Responder
from serve.lifecycle import ModelLifecycle
from serve.metrics import ServeMetrics
from serve.records import OnlineRecords
from serve.settings import LiveScoringSettings
from verl.data.records import reward_row
from verl.errors import DataError


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
        self.remote: Any = None  # a reward model behind a URL
        self.judge: Any = None  # a chat judge behind a URL: (its client, the rubric)
        if config is not None and config.remote is not None:
            url, name = config.remote
            key = os.environ.get(config.api_key_env) if config.api_key_env else None
            if config.is_judge:
                from verl.rewards.judge import Endpoint, JudgeClient, PointwiseRubric, load_rubric  # noqa: PLC0415  (a judge only)

                rubric = PointwiseRubric(load_rubric(config.rubric, "pointwise", "score_traffic"), *config.scale,
                                         config.max_tokens)
                endpoint = Endpoint.parse(config.scorer.removeprefix("judge:"), "score_traffic.scorer")
                client = JudgeClient(endpoint, key, config.timeout_s, max_retries=2, concurrency=config.batch_size)
                self.judge = client, rubric
            else:
                from verl.rewards.remote import RemoteRewardModel  # noqa: PLC0415  (a remote scorer only)

                self.remote = RemoteRewardModel(url, model=name, score=config.score, batch_size=config.batch_size,
                                                timeout_s=config.timeout_s, api_key=key)

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
        if self.judge is not None:
            self.judge[0].close()

    @property
    def judge_version(self) -> str:
        """A chat judge's version: its address and the hash of its rubric (another rubric is another scorer)."""
        assert self.config is not None and self.judge is not None
        digest = hashlib.sha256(self.judge[1].text.encode()).hexdigest()[:12]
        return f"{self.config.scorer.removeprefix('judge:')} rubric {digest}"

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
        config = self.config
        assert config is not None
        if self.judge is not None:  # the conversation as text (no special tokens) is the question it judges
            client, rubric = self.judge
            items = [(answer.target.model.engine.tokenizer.decode(answer.prompt_ids, skip_special_tokens=True),
                      answer.text) for answer in batch]
            values = await asyncio.to_thread(client.map, lambda item: rubric.ask(client, *item), items)
            return [float(v) for v in values], self.judge_version
        texts = [answer.target.model.engine.tokenizer.decode(answer.prompt_ids, skip_special_tokens=False)
                 + answer.text for answer in batch]
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

"""A reward model behind a URL: the client the trainer (and later the evaluators and the service's live-traffic
scorer) call it through.

It speaks vLLM's classification API (``POST {url}/classify``, as ``verl serve`` serves a ``kind: reward`` model and
``vllm serve`` serves a sequence classifier): texts in batches of ``batch_size``, up to ``max_concurrency`` batches
in flight, at most ``rate_limit`` requests per second (a token bucket shared by the threads), each with a
``timeout_s``; a timeout, a connection error, a 429 or a 5xx is retried with exponential backoff and jitter up to
``max_retries`` times. A batch that still fails, or whose answer is not one finite number per text (garbage), gives
NaN for its texts: **a reward that could not be obtained is missing, never 0** — the caller masks it and counts it.
Other 4xx answers (a wrong model name, bad auth) are the caller's mistake, not a transient failure: they raise at
once with the server's message.

``score``: ``probability`` reads the class probability (sigmoid of the logit for a one-class reward model: in [0, 1],
what the canary's tests need), ``logit`` the raw output (``use_activation: false``).
"""

from __future__ import annotations

import concurrent.futures
import math
import random
import threading
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

from verl.errors import ConfigError

RETRY_STATUS = {408, 429, 500, 502, 503, 504}


class RemoteRewardRefused(ConfigError):
    """The reward server answered a 4xx that retrying cannot fix (wrong model, auth, bad request)."""


@dataclass
class RemoteStats:
    """Counts of one ``score`` call."""

    requests: int = 0
    retries: int = 0
    failed_batches: int = 0
    failed_texts: int = 0
    reasons: list[str] = field(default_factory=list)  # the first few, for the log


class RateLimiter:
    """At most ``rate`` acquisitions per second across threads (``rate`` <= 0: unlimited)."""

    def __init__(self, rate: float):
        self.interval = 1.0 / rate if rate > 0 else 0.0
        self.next_free = 0.0
        self.lock = threading.Lock()

    def acquire(self) -> None:
        if not self.interval:
            return
        with self.lock:
            now = time.monotonic()
            start = max(now, self.next_free)
            self.next_free = start + self.interval
        if start > now:
            time.sleep(start - now)


class RemoteRewardModel:
    """Scores texts with a reward model behind ``url`` (see the module docstring)."""

    def __init__(self, url: str, model: str | None = None, score: str = "probability", batch_size: int = 32,
                 max_concurrency: int = 4, timeout_s: float = 30.0, max_retries: int = 3, backoff_s: float = 0.5,
                 rate_limit: float = 0.0, api_key: str | None = None, seed: int = 0):
        if score not in ("probability", "logit"):
            raise ConfigError(f"reward.model.score={score!r}: use probability (in [0, 1]) or logit")
        self.url = url.rstrip("/")
        if self.url.endswith("/classify"):
            self.url = self.url[: -len("/classify")]
        self.model, self.score_kind = model, score
        self.batch_size, self.max_concurrency = batch_size, max_concurrency
        self.timeout_s, self.max_retries, self.backoff_s = timeout_s, max_retries, backoff_s
        self.limiter = RateLimiter(rate_limit)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(timeout=timeout_s, headers=self.headers)
        self.rng = random.Random(seed)

    def close(self) -> None:
        self.client.close()

    def score(self, texts: list[str]) -> tuple[np.ndarray, RemoteStats]:
        """One score per text (float64), NaN where none could be obtained; and what it took."""
        out = np.full(len(texts), np.nan)
        stats = RemoteStats()
        batches = [(start, texts[start:start + self.batch_size]) for start in range(0, len(texts), self.batch_size)]
        lock = threading.Lock()

        def run(start: int, batch: list[str]) -> None:
            values, requests, retries, reason = self._batch(batch)
            with lock:
                stats.requests += requests
                stats.retries += retries
                if values is None:
                    stats.failed_batches += 1
                    stats.failed_texts += len(batch)
                    if len(stats.reasons) < 3:
                        stats.reasons.append(reason)
                else:
                    out[start:start + len(batch)] = values

        with concurrent.futures.ThreadPoolExecutor(max(1, min(self.max_concurrency, len(batches)))) as pool:
            for future in [pool.submit(run, start, batch) for start, batch in batches]:
                future.result()  # a RemoteRewardRefused raises here
        return out, stats

    def _batch(self, texts: list[str]) -> tuple[np.ndarray | None, int, int, str]:
        """(scores or None, requests sent, retries, why it failed)."""
        body = {"input": texts, "use_activation": self.score_kind == "probability", "add_special_tokens": False}
        if self.model:
            body["model"] = self.model
        reason, requests = "", 0
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1) * (0.5 + self.rng.random()))
            self.limiter.acquire()
            requests += 1
            try:
                answer = self.client.post(f"{self.url}/classify", json=body)
            except httpx.TimeoutException:
                reason = f"timed out after {self.timeout_s:g} s"
                continue
            except httpx.TransportError as exc:
                reason = f"{type(exc).__name__}: {exc}"
                continue
            if answer.status_code in RETRY_STATUS:
                reason = f"HTTP {answer.status_code}"
                continue
            if answer.status_code >= 400:
                raise RemoteRewardRefused(f"reward model at {self.url}/classify refused the request: HTTP "
                                          f"{answer.status_code} {answer.text[:300]}")
            values = parse_scores(answer, len(texts))
            if values is None:
                reason = f"unreadable answer: {answer.text[:120]!r}"
                continue
            return values, requests, attempt, ""
        return None, requests, self.max_retries, reason


def parse_scores(answer: httpx.Response, expected: int) -> np.ndarray | None:
    """The first class's value per input from a classification response, or None when it is not one finite number
    per input in order."""
    try:
        data = answer.json()["data"]
        if len(data) != expected or [d["index"] for d in data] != list(range(expected)):
            return None
        values = [float(d["probs"][0]) for d in data]
    except (ValueError, KeyError, TypeError, IndexError):
        return None
    if not all(math.isfinite(v) for v in values):
        return None
    return np.asarray(values, dtype=np.float64)

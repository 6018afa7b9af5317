"""Per-request records for the online A/B report: which model answered, how fast, how many tokens, and — when the
request carried the ``verl`` extension — the rule reward of its response.

Prometheus keeps the aggregates (``verl:request_reward`` and the latency histograms, labelled by model); pairing the
same prompt across models needs the rows themselves, so the service also keeps the last ``keep`` rows in memory
(``GET /admin/records``) and, with ``records_path``, appends each as one JSON line (one ``write`` per line on a file
opened for appending, so concurrent writers never interleave within a line). ``verl compare --online`` reads
either.
"""

from __future__ import annotations

import collections
import hashlib
import json
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from verl.rewards import get_reward_fn

KEEP_IN_MEMORY = 10_000


@dataclass
class OnlineRecord:
    """One finished sequence (a request with ``n`` > 1 gives ``n`` rows)."""

    time: float
    model: str
    route: str | None
    prompt_id: str
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float | None
    e2e_s: float
    finish_reason: str
    error: str | None = None
    reward: float | None = None


def prompt_hash(token_ids: list[int]) -> str:
    """A short, stable id of a prompt (its token ids), for pairing the same prompt across models."""
    return hashlib.sha256(json.dumps(token_ids).encode()).hexdigest()[:16]


def score(reward: str, text: str, ground_truth: Any) -> float:
    """The rule reward ``reward`` (a name in verl's reward registry) of ``text`` against ``ground_truth``."""
    value = get_reward_fn(reward)("online", text, str(ground_truth))
    return float(value["score"] if isinstance(value, dict) else value)


class OnlineRecords:
    """A bounded in-memory log of records, mirrored to a JSONL file when ``path`` is set."""

    def __init__(self, path: str | None = None, keep: int = KEEP_IN_MEMORY):
        self.rows: collections.deque[dict] = collections.deque(maxlen=keep)
        self.path = Path(path) if path else None
        self._lock = threading.Lock()
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def add(self, record: OnlineRecord) -> None:
        row = asdict(record)
        self.rows.append(row)
        if self.path is not None:
            line = json.dumps(row) + "\n"
            with self._lock, self.path.open("a") as handle:
                handle.write(line)

    def snapshot(self, since: float | None = None) -> list[dict]:
        rows = list(self.rows)
        return rows if since is None else [r for r in rows if r["time"] >= since]

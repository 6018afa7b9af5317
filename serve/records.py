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
    replica: str | None = None  # verl serve --replicas: which replica answered
    run: str | None = None  # lineage of the weights that answered (serve.lineage)
    step: int | None = None
    weights: str | None = None
    shadow: bool = False  # a mirrored request: answered by this model, recorded, never returned to the client


def prompt_hash(token_ids: list[int]) -> str:
    """A short, stable id of a prompt (its token ids), for pairing the same prompt across models."""
    return hashlib.sha256(json.dumps(token_ids).encode()).hexdigest()[:16]


def score(reward: str, text: str, ground_truth: Any) -> float:
    """The rule reward ``reward`` (a name in verl's reward registry) of ``text`` against ``ground_truth``."""
    value = get_reward_fn(reward)("online", text, str(ground_truth))
    return float(value["score"] if isinstance(value, dict) else value)


class OnlineRecords:
    """A bounded in-memory log of records, mirrored to a JSONL file when ``path`` is set.

    A replica of ``verl serve --replicas`` (``replica`` set) keeps no file: its rows wait in an outbox that each poll
    of the control plane drains (``drain``), and the control plane, one ``OnlineRecords`` for the whole fleet, keeps
    them and writes ``records_path`` — one writer, every replica's rows, on whichever node it runs."""

    def __init__(self, path: str | None = None, keep: int = KEEP_IN_MEMORY, replica: str | None = None):
        self.rows: collections.deque[dict] = collections.deque(maxlen=keep)
        self.path = Path(path) if path else None
        self.replica = replica
        self.outbox: collections.deque[dict] = collections.deque(maxlen=keep)
        self._lock = threading.Lock()
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def add(self, record: OnlineRecord) -> None:
        if self.replica is not None:
            record.replica = self.replica
        row = asdict(record)
        self.rows.append(row)
        if self.replica is not None:
            self.outbox.append(row)
        self._write([row])

    def add_rows(self, rows: list[dict]) -> None:
        """Rows another process recorded (the control plane receiving a replica's outbox)."""
        self.rows.extend(rows)
        self._write(rows)

    def drain(self) -> list[dict]:
        """The rows recorded since the last drain (a replica's outbox), oldest first."""
        rows = []
        while self.outbox:
            rows.append(self.outbox.popleft())
        return rows

    def _write(self, rows: list[dict]) -> None:
        if self.path is not None and rows:
            text = "".join(json.dumps(row) + "\n" for row in rows)
            with self._lock, self.path.open("a") as handle:
                handle.write(text)

    def snapshot(self, since: float | None = None) -> list[dict]:
        rows = list(self.rows)
        return rows if since is None else [r for r in rows if r["time"] >= since]

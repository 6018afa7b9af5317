"""Per-request records for the online A/B report and ``verl ship``'s canary: which model answered which request,
for whom, under which config version, how fast, how many tokens, whether it failed, and its reward.

Two kinds of rows, both JSON objects:

- a **request** row (``kind: "request"``) per finished sequence: the completion ``id`` the client saw and the
  choice ``index``, the routed ``user`` (a hash, never the raw id), ``arrival`` and finish ``time``, the
  ``config_version`` and the answering model's ``route_share`` when it was routed, latencies, tokens, the finish
  reason, an ``error`` (an engine failure, a request refused at capacity, a timeout), ``reward_expected`` (the
  request asked for a reward), its ``reward`` and ``reward_source`` when one was scored at once;
- a **reward** row (``kind: "reward"``) for a reward that arrives later (a checker run afterwards, a judge, a user's
  feedback), joined to its request row by ``(id, index)``, with its ``reward_source``. ``join_rewards`` folds them in.

Prometheus keeps the aggregates (``verl:request_reward`` and the latency histograms, labelled by model); pairing the
same prompt across models needs the rows themselves, so the service also keeps the last ``keep`` rows in memory
(``GET /admin/records``) and, with ``records_path``, appends each as one JSON line (one ``write`` per line on a file
opened for appending, so concurrent writers never interleave within a line). ``verl compare --online`` and the
canary read either.
"""

from __future__ import annotations

import collections
import hashlib
import json
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from verl.rewards import get_reward_fn

KEEP_IN_MEMORY = 10_000


@dataclass
class OnlineRecord:
    """One finished sequence (a request with ``n`` > 1 gives ``n`` rows)."""

    time: float  # when it finished (wall clock)
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
    kind: str = "request"
    id: str | None = None  # the completion id the client saw (a mirror carries its original's)
    index: int = 0  # the choice index within the completion
    user: str | None = None  # the routed user, hashed (user_hash)
    arrival: float | None = None  # when the request arrived (wall clock)
    config_version: int | None = None  # the service's models-and-routes version it was routed under
    route_share: float | None = None  # the answering model's share of the route then
    reward_expected: bool = False  # the request asked for a reward (the `verl` field)
    reward_source: str | None = None  # e.g. "rule:arithmetic"


def user_hash(user: str | None) -> str | None:
    """The recorded form of a user id: enough to tell users apart, not to recover them."""
    return None if user is None else hashlib.sha256(f"verl-user\0{user}".encode()).hexdigest()[:16]


def reward_row(completion_id: str, index: int, reward: float, source: str, model: str | None = None,
               route: str | None = None, shadow: bool = False, at: float | None = None) -> dict:
    """A reward that arrived after its request (see the module docstring)."""
    return {"kind": "reward", "time": time.time() if at is None else at, "id": completion_id, "index": index,
            "reward": float(reward), "reward_source": source, "model": model, "route": route, "shadow": shadow}


def join_rewards(rows: list[dict]) -> list[dict]:
    """Request rows with the rewards that arrived later folded in (the latest row per ``(id, index, shadow)``
    wins); reward rows whose request is not among ``rows`` are dropped."""
    late = {(r.get("id"), r.get("index", 0), bool(r.get("shadow"))): r for r in rows if r.get("kind") == "reward"}
    out = []
    for row in rows:
        if row.get("kind", "request") != "request":
            continue
        extra = late.get((row.get("id"), row.get("index", 0), bool(row.get("shadow"))))
        if extra is not None and row.get("id") is not None and row.get("reward") is None:
            row = {**row, "reward": extra["reward"], "reward_source": extra.get("reward_source")}
        out.append(row)
    return out


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

    def add(self, record: OnlineRecord | dict) -> None:
        """A request record, or a reward row (``reward_row``)."""
        row = asdict(record) if isinstance(record, OnlineRecord) else dict(record)
        if self.replica is not None:
            row["replica"] = self.replica
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

    def find(self, completion_id: str, index: int) -> dict | None:
        """The (non-mirrored) request row of a completion's choice still in memory, or None."""
        for row in reversed(self.rows):
            if row.get("id") == completion_id and row.get("index", 0) == index and row.get("kind", "request") == \
                    "request" and not row.get("shadow"):
                return row
        return None

    def snapshot(self, since: float | None = None) -> list[dict]:
        rows = list(self.rows)
        return rows if since is None else [r for r in rows if r["time"] >= since]

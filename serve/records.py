"""The service's records, kept and written: the request rows it appends per finished sequence and the reward rows
that arrive later (their schema, and the readers: ``verl.data.records``), the completion index feedback is checked
against, and the in-memory window ``GET /admin/records`` serves.

Rows are kept for ``records_retention_s`` (in memory, in the file — compacted at start and hourly — and in the
completion index that feedback is checked against); older ones are dropped.

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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from serve import __version__, log
from verl.data.records import OnlineRecord
from verl.rewards import get_reward_fn
from verl.utils.fs import atomic_path

KEEP_IN_MEMORY = 10_000
RETENTION_S = 7 * 86_400.0  # the default records_retention_s
MAX_COMPLETIONS = 200_000  # the default size of the completion index (feedback's look-up)
COMPACT_EVERY_S = 3_600.0  # how often the records file is rewritten without rows past the retention
FEEDBACK_SOURCE = "feedback"  # the reward_source of a user's feedback
RULE_SCORER_VERSION = f"verl-serve-{__version__}"  # the rule rewards are the registry's of this version


def clip_prompt(prompt: Any, max_chars: int) -> tuple[Any, bool]:
    """``prompt`` (chat messages as dicts, a text, or a list of texts or token ids) within ``max_chars`` characters
    of JSON, and whether it was cut: the latest messages are kept whole while they fit, then the earliest kept one's
    text is cut from its start (the turn being answered matters most)."""
    if len(json.dumps(prompt)) <= max_chars:
        return prompt, False
    if isinstance(prompt, str):
        return prompt[:max_chars], True
    if not isinstance(prompt, list) or not all(isinstance(m, dict) for m in prompt):
        text = json.dumps(prompt)
        return text[:max_chars], True
    kept: list[dict] = []
    room = max_chars - 2  # the list's brackets
    for message in reversed(prompt):
        size = len(json.dumps(message)) + 2  # with its separator
        if size <= room:
            kept.insert(0, message)
            room -= size
            continue
        content = message.get("content")
        keep = room - (size - len(content)) if isinstance(content, str) else 0  # the text's share of the room
        if keep > 0:
            kept.insert(0, {**message, "content": content[len(content) - keep:]})
        break
    return kept, True


def prompt_hash(token_ids: list[int]) -> str:
    """A short, stable id of a prompt (its token ids), for pairing the same prompt across models."""
    return hashlib.sha256(json.dumps(token_ids).encode()).hexdigest()[:16]


def score(reward: str, text: str, ground_truth: Any) -> float:
    """The rule reward ``reward`` (a name in verl's reward registry) of ``text`` against ``ground_truth``."""
    value = get_reward_fn(reward)("online", text, str(ground_truth))
    return float(value["score"] if isinstance(value, dict) else value)


@dataclass
class Completion:
    """What the completion index keeps of an answered request: enough to accept feedback on it (and to give the
    feedback row the answer's model, route and lineage) for as long as its records are kept."""

    time: float
    model: str | None
    route: str | None
    choices: int  # choice indices 0 .. choices - 1
    lineage: dict
    feedback: dict[tuple[int, str], float] = field(default_factory=dict)  # (index, feedback source) -> score


class CompletionIndex:
    """Completion id -> ``Completion`` for the last ``retention_s`` seconds, at most ``max_entries`` (the oldest go
    first); ids dropped for either reason are remembered a while longer so feedback on them is told it came too late
    rather than that the id is unknown."""

    def __init__(self, retention_s: float = RETENTION_S, max_entries: int = MAX_COMPLETIONS):
        self.retention_s, self.max_entries = retention_s, max_entries
        self.entries: collections.OrderedDict[str, Completion] = collections.OrderedDict()
        self.expired: collections.OrderedDict[str, None] = collections.OrderedDict()

    def note(self, row: dict) -> None:
        """Index a request row (a client's answer: mirrors and rows without an id are not feedback targets), or
        mark the feedback a reward row records."""
        completion_id = row.get("id")
        if completion_id is None or row.get("shadow"):
            return
        if row.get("kind", "request") == "request":
            entry = self.entries.get(completion_id)
            if entry is None:
                entry = self.entries[completion_id] = Completion(
                    float(row.get("arrival") or row.get("time") or time.time()), row.get("model"), row.get("route"),
                    0, {k: row.get(k) for k in ("run", "step", "weights")})
            entry.choices = max(entry.choices, int(row.get("index", 0)) + 1)
            self._evict(time.time())
        elif row.get("reward_source") == FEEDBACK_SOURCE and completion_id in self.entries:
            key = (int(row.get("index", 0)), str(row.get("feedback_source")))
            self.entries[completion_id].feedback[key] = float(row["reward"])

    def get(self, completion_id: str) -> Completion | None:
        self._evict(time.time())
        return self.entries.get(completion_id)

    def was_expired(self, completion_id: str) -> bool:
        return completion_id in self.expired

    def _evict(self, now: float) -> None:
        while self.entries:
            oldest_id, oldest = next(iter(self.entries.items()))
            if len(self.entries) <= self.max_entries and oldest.time >= now - self.retention_s:
                break
            self.entries.popitem(last=False)
            self.expired[oldest_id] = None
        while len(self.expired) > self.max_entries:
            self.expired.popitem(last=False)


class OnlineRecords:
    """A bounded in-memory log of records, mirrored to a JSONL file when ``path`` is set.

    A replica of ``verl serve --replicas`` (``replica`` set) keeps no file: its rows wait in an outbox that each poll
    of the control plane drains (``drain``), and the control plane, one ``OnlineRecords`` for the whole fleet, keeps
    them and writes ``records_path`` — one writer, every replica's rows, on whichever node it runs.

    A file that exists is read back at start (rows within the retention: the window in memory and the completion
    index), so a restarted service still takes feedback on what it answered before."""

    def __init__(self, path: str | None = None, keep: int = KEEP_IN_MEMORY, replica: str | None = None,
                 retention_s: float = RETENTION_S, max_completions: int = MAX_COMPLETIONS):
        self.rows: collections.deque[dict] = collections.deque(maxlen=keep)
        self.path = Path(path) if path else None
        self.replica = replica
        self.retention_s = retention_s
        self.index = CompletionIndex(retention_s, max_completions)
        self.outbox: collections.deque[dict] = collections.deque(maxlen=keep)
        self._lock = threading.Lock()
        self._compacted = time.time()
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.path.is_file():
                self._load()

    def _load(self) -> None:
        """Read the file back (rows within the retention); rewrite it without the older ones."""
        kept = self._compact()
        for row in kept:
            self.index.note(row)
        self.rows.extend(kept[-(self.rows.maxlen or len(kept)):])

    def _compact(self) -> list[dict]:
        """Rewrite the file with only the rows within the retention (atomically: a crash leaves the old file) and
        return them. Lines that do not parse (a torn last line after a crash) are dropped with a warning."""
        assert self.path is not None
        cutoff = time.time() - self.retention_s
        kept, dropped, torn = [], 0, 0
        with self._lock:
            for line in self.path.read_text().splitlines():
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    torn += 1
                    continue
                if float(row.get("time") or 0.0) >= cutoff:
                    kept.append(row)
                else:
                    dropped += 1
            if dropped or torn:  # nothing past the retention and nothing torn: the file stays as it is
                with atomic_path(self.path) as tmp:
                    tmp.write_text("".join(json.dumps(row) + "\n" for row in kept))
            self._compacted = time.time()
        if torn:
            log.warning("verl serve: %d unreadable line(s) in %s dropped", torn, self.path)
        return kept

    def add(self, record: OnlineRecord | dict) -> None:
        """A request record, or a reward row (``reward_row``)."""
        row = asdict(record) if isinstance(record, OnlineRecord) else dict(record)
        if self.replica is not None:
            row["replica"] = self.replica
        self._keep([row])
        if self.replica is not None:
            self.outbox.append(row)
        self._write([row])

    def add_rows(self, rows: list[dict]) -> None:
        """Rows another process recorded (the control plane receiving a replica's outbox)."""
        self._keep(rows)
        self._write(rows)

    def _keep(self, rows: list[dict]) -> None:
        self.rows.extend(rows)
        for row in rows:
            self.index.note(row)
        cutoff = time.time() - self.retention_s
        while self.rows and float(self.rows[0].get("time") or 0.0) < cutoff:
            self.rows.popleft()

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
            if time.time() - self._compacted > COMPACT_EVERY_S:
                self._compact()

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

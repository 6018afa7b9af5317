"""Server-side state of each run shown by the dashboard, kept current by reading only what the trainer appended.

Every ``refresh`` reads the new complete rows of the run's ``verl_logs.jsonl`` (``LogFollower``) and appends their
metric points to an append-only list; a browser asks for the points after its cursor, so each refresh transfers
only new points however long the run is. A log that shrank (replaced, rewritten) bumps the run's ``generation``:
the browser then drops what it had and reloads.
"""

from __future__ import annotations

import threading
from collections import deque
from pathlib import Path
from typing import Any

from verl.tracking.common import finite_or_none
from verl.tracking.follow import LogFollower, row_kind, row_metrics

MAX_SAMPLES = 200  # newest sample rows kept per run
MAX_ALERTS = 200


def run_label(path: Path, others: list[Path]) -> str:
    """A short, unique name: the run directory's name, with its parent when two runs share a name."""
    name = path.parent.name or str(path)
    if sum(1 for other in others if other.parent.name == name) > 1:
        name = f"{path.parent.parent.name}/{name}"
    return name


class RunState:
    """One run's points, latest samples and alerts, and status."""

    def __init__(self, run_id: int, name: str, log_path: Path):
        self.id = run_id
        self.name = name
        self.log_path = log_path
        self.lock = threading.Lock()
        self._reset()
        self.generation = 0

    def _reset(self) -> None:
        self.follower = LogFollower(self.log_path)
        self.points: list[tuple[str, int, float | None]] = []  # (tag, step, value) in log order
        self.samples: deque[dict[str, Any]] = deque(maxlen=MAX_SAMPLES)
        self.alerts: deque[dict[str, Any]] = deque(maxlen=MAX_ALERTS)
        self.status: dict[str, Any] = {"state": "waiting", "last_step": None, "total_steps": None, "updated": None,
                                       "reason": None, "checkpoint": None, "best_checkpoint": None, "target": None}

    def refresh(self) -> None:
        with self.lock:
            rows, truncated = self.follower.poll()
            if truncated:
                offset = self.follower.offset
                self._reset()
                self.follower.offset = offset
                self.generation += 1
            for _start, _end, row in rows:
                self._apply(row)

    def _apply(self, row: dict[str, Any]) -> None:
        kind = row_kind(row)
        step = int(row.get("step", 0) or 0)
        status = self.status
        status["updated"] = row.get("timestamp", status["updated"])
        if row.get("scope") == "target":  # time to target (trainer.target): a status line, not a curve
            status["target"] = {k: row.get(k) for k in ("target", "value", "minutes", "validation_seconds")}
            status["target"]["step"] = step
            return
        if kind == "metrics":
            for tag, value in row_metrics(row).items():
                self.points.append((tag, step, finite_or_none(value)))
            status["last_step"] = max(step, status["last_step"] or 0)
            progress = row.get("progress") if row.get("scope") == "train" else None
            if isinstance(progress, (int, float)) and progress > 0:
                status["total_steps"] = round(step / progress)
            if status["state"] in ("waiting", "finished"):
                status["state"] = "running"
        elif kind == "sample":
            self.samples.append({k: row.get(k) for k in ("step", "split", "prompt", "response", "ground_truth",
                                                         "score", "timestamp")})
        elif kind == "alert":
            self.alerts.append({k: row.get(k) for k in ("step", "rule", "message", "level", "action", "timestamp")})
        elif kind == "event":
            if row.get("status") in ("started", "resumed"):
                status.update(state="running", reason=None)
            elif row.get("status") == "finished":
                status.update(state="finished", reason=row.get("reason"))
            if row.get("checkpoint"):
                status["checkpoint"] = row["checkpoint"]
            if row.get("best_checkpoint"):
                status["best_checkpoint"] = row["best_checkpoint"]

    def delta(self, generation: int, cursor: int) -> dict[str, Any]:
        """The points after ``cursor`` (all of them when the browser's generation is stale), and the status."""
        with self.lock:
            reset = generation != self.generation or cursor > len(self.points) or cursor < 0
            start = 0 if reset else cursor
            points: dict[str, list[list[Any]]] = {}
            for tag, step, value in self.points[start:]:
                points.setdefault(tag, []).append([step, value])
            return {"id": self.id, "name": self.name, "path": str(self.log_path), "generation": self.generation,
                    "cursor": len(self.points), "reset": reset, "points": points, "status": dict(self.status)}

    def latest(self, kind: str, limit: int) -> list[dict[str, Any]]:
        with self.lock:
            rows = list(self.samples if kind == "samples" else self.alerts)[-limit:]
        return [{"run": self.name, "run_id": self.id, **row} for row in rows]

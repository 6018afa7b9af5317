"""Structured run logging: ``verl_logs.jsonl`` rows grouped by scope, fanned out to trackers.

Each training step produces one row per scope::

    {"timestamp": "2026-11-22T10:31:02.123", "level": "INFO", "scope": "rollout", "step": 12, "reward_mean": 0.41, ...}

Fields logged during a step with ``log.info(scope, **fields)`` are merged into that step's row for ``scope``
(from anywhere: a reward function, a callback, user code) and written when the step ends; trackers see the
same values as ``scope/name`` keys. ``sample`` and ``alert`` rows, and DEBUG rows, are written at once.

    from verl.utils import log
    log.info("reward", tps=tokens_per_second)

Readers (``read_jsonl``) skip a torn last line, so a log being written by a live trainer can be read any time.
"""

from __future__ import annotations

import contextvars
import json
import math
import sys
import threading
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

LEVELS = {"DEBUG": 10, "INFO": 20, "WARNING": 30, "ERROR": 40}
IMMEDIATE_SCOPES = ("sample", "alert")


def _timestamp() -> str:
    return datetime.now().isoformat(timespec="milliseconds")


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 1) == 0:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/Inf; keep them visible as strings
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return str(value)


class RunLogger:
    """Writes ``verl_logs.jsonl`` and forwards metrics to trackers. One per run."""

    def __init__(self, path: str | Path, trackers: list | None = None, level: str = "INFO"):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", buffering=1)
        self.trackers = trackers or []
        self.level = LEVELS[level]
        self.step = 0
        self._pending: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- writing

    def _write(self, row: dict) -> None:
        with self._lock:
            self._file.write(json.dumps(row, ensure_ascii=False) + "\n")

    def row(self, scope: str, fields: dict, level: str = "INFO", step: int | None = None) -> dict:
        out = {"timestamp": _timestamp(), "level": level, "scope": scope, "step": self.step if step is None else step}
        out.update({k: _jsonable(v) for k, v in fields.items()})
        return out

    def set_step(self, step: int) -> None:
        self.step = step

    def info(self, scope: str, step: int | None = None, **fields: Any) -> None:
        """Merge ``fields`` into this step's ``scope`` row (immediate for sample/alert scopes)."""
        if scope in IMMEDIATE_SCOPES:
            self.event(scope, step=step, **fields)
            return
        if step is not None and step != self.step:
            self._write(self.row(scope, fields, step=step))
            return
        self._pending.setdefault(scope, {}).update(fields)

    def debug(self, scope: str, **fields: Any) -> None:
        if self.level <= LEVELS["DEBUG"]:
            self._write(self.row(scope, fields, level="DEBUG"))

    def event(self, scope: str, level: str = "INFO", step: int | None = None, **fields: Any) -> dict:
        row = self.row(scope, fields, level=level, step=step)
        self._write(row)
        return row

    def log_step(self, step: int, metrics: dict[str, Any]) -> dict[str, float]:
        """Write ``step``'s rows: ``metrics`` (``scope/name`` keys, what the step measured) merged into what ``info``
        gathered during the step (a reward function's or a callback's fields), one row per scope. Returns every
        number written, as ``scope/name``, after forwarding them to the trackers."""
        for key, value in metrics.items():
            scope, slash, name = key.partition("/")
            if not slash:
                raise ValueError(f"metric '{key}' has no scope: name it scope/name (e.g. rollout/{key})")
            self._pending.setdefault(scope, {})[name] = value
        return self.flush(step)

    def flush(self, step: int | None = None) -> dict[str, float]:
        """Write this step's rows; return and forward the numeric ``scope/name`` metrics."""
        step = self.step if step is None else step
        metrics: dict[str, float] = {}
        pending, self._pending = self._pending, {}
        for scope, fields in pending.items():
            if not fields:
                continue
            self._write(self.row(scope, fields, step=step))
            for name, value in fields.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    metrics[f"{scope}/{name}"] = float(value)
        for tracker in self.trackers:
            tracker.log_metrics(metrics, step)
        return metrics

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.close()


def scoped(scope: str, fields: dict[str, Any]) -> dict[str, Any]:
    """``{name: value}`` -> ``{"scope/name": value}``, the keys ``RunLogger.log_step`` and trackers take."""
    return {f"{scope}/{name}": value for name, value in fields.items()}


# ---------------------------------------------------------------- module-level API

# The logger of the run being fitted in this context: ``verl.trainer.run.Run.bound`` sets it for the duration of
# ``fit()``. A context variable, not a module global: two runs fitted in one process (threads, tests) each log into
# their own file. Threads the run starts for user code (the tool runner's) carry it (contextvars.copy_context).
_ACTIVE: contextvars.ContextVar[RunLogger | None] = contextvars.ContextVar("verl_run_logger", default=None)


def bind(logger: RunLogger) -> contextvars.Token:
    """Make ``logger`` the one ``info`` writes to in this context; ``unbind`` the token."""
    return _ACTIVE.set(logger)


def unbind(token: contextvars.Token) -> None:
    _ACTIVE.reset(token)


def get_active() -> RunLogger | None:
    return _ACTIVE.get()


def info(scope: str, step: int | None = None, **fields: Any) -> None:
    """Merge ``fields`` into the current step's row for ``scope`` (no-op outside a run)."""
    logger = _ACTIVE.get()
    if logger is not None:
        logger.info(scope, step=step, **fields)


# ---------------------------------------------------------------- reading


def iter_jsonl(path: str | Path, start: int = 0) -> Iterator[tuple[int, dict]]:
    """Yield ``(end_offset, row)`` for complete lines from byte ``start``; a torn last line is skipped."""
    with Path(path).open("rb") as fh:
        fh.seek(start)
        offset = start
        for raw in fh:
            if not raw.endswith(b"\n"):
                break  # still being written
            offset += len(raw)
            line = raw.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict):
                yield offset, row


_SAID: set[str] = set()


def say_once(message: str, label: str = "note") -> None:
    """Print ``label: message`` to stderr once per process: a resumed or re-read config, or a checkpoint looked up
    twice, does not repeat it."""
    line = f"{label}: {message}"
    if line not in _SAID:
        _SAID.add(line)
        print(line, file=sys.stderr, flush=True)


def read_jsonl(path: str | Path) -> list[dict]:
    return [row for _, row in iter_jsonl(path)]


def quiet_hf() -> None:
    """Silence transformers' per-load progress bars; our own progress and logs say what is happening."""
    from transformers.utils import logging as hf_logging  # noqa: PLC0415  (heavy; only when a command loads models)

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()

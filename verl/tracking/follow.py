"""Reading ``verl_logs.jsonl`` incrementally, as the converter and the dashboard do while a trainer appends to it.

Row kinds (``row_kind``):

- ``metrics``: an INFO row of a step's scope (``rollout``, ``ppo``, ``eval``, ``timing``, ``system``, user scopes);
  its numeric fields are the ``scope/name`` metrics trackers receive (``row_metrics``);
- ``sample``, ``alert``, ``histogram``: sampled generations, health alerts, distributions;
- ``event``: run events (``status`` started/resumed/finished with a ``reason``, ``checkpoint`` written, a new
  ``best_checkpoint``), whose numbers are not curves;
- ``other``: DEBUG/WARNING diagnostics.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from verl.errors import ConfigError
from verl.tracking.common import as_float
from verl.utils.log import iter_jsonl

LOG_NAME = "verl_logs.jsonl"
ROW_META = ("timestamp", "level", "scope", "step")
EVENT_KEYS = ("status", "checkpoint", "best_checkpoint", "reason")
SPECIAL_SCOPES = ("sample", "alert", "histogram")


def resolve_log_path(path: str | Path, must_exist: bool = True) -> Path:
    """A run directory (or a ``--log_dir``) -> its ``verl_logs.jsonl``; a ``.jsonl`` path is taken as it is."""
    path = Path(path)
    candidate = path if path.suffix == ".jsonl" or path.is_file() else path / LOG_NAME
    if must_exist and not candidate.is_file():
        hint = (f"{path} exists but holds no {LOG_NAME}" if path.is_dir() else f"{path} does not exist")
        raise ConfigError(f"--log_dir: no training log found ({hint}); pass the run directory "
                          f"(outputs/<project>/<experiment>) or the --log_dir given to `verl train`")
    return candidate


def find_logs(path: str | Path) -> list[Path]:
    """Every ``verl_logs.jsonl`` for ``path``: the run's own, or those of all runs below a directory of runs."""
    path = Path(path)
    if path.is_file() or (path / LOG_NAME).is_file():
        return [resolve_log_path(path)]
    if path.is_dir():
        found = sorted(path.rglob(LOG_NAME))
        if found:
            return found
    return [resolve_log_path(path)]  # raises the explanatory error


def row_kind(row: dict[str, Any]) -> str:
    scope = row.get("scope")
    if scope in SPECIAL_SCOPES:
        return str(scope)
    if row.get("level", "INFO") != "INFO":
        return "other"
    if any(key in row for key in EVENT_KEYS):
        return "event"
    return "metrics"


def row_metrics(row: dict[str, Any]) -> dict[str, float]:
    """``{"scope/name": value}`` for the numeric fields of a ``metrics`` row (NaN/Inf included)."""
    scope = row.get("scope", "")
    out = {}
    for key, value in row.items():
        if key in ROW_META:
            continue
        number = as_float(value)
        if number is not None:
            out[f"{scope}/{key}"] = number
    return out


class LogFollower:
    """Reads complete rows appended to a log since the last call (a torn last line waits for its newline)."""

    def __init__(self, path: str | Path, offset: int = 0):
        self.path = Path(path)
        self.offset = offset

    def poll(self) -> tuple[list[tuple[int, int, dict[str, Any]]], bool]:
        """``([(start_offset, end_offset, row), ...], truncated)``.

        ``truncated`` is True when the file became shorter than what was already read (it was replaced or
        rewritten): reading then restarts from the beginning.
        """
        if not self.path.is_file():
            return [], False
        truncated = False
        if self.path.stat().st_size < self.offset:
            self.offset, truncated = 0, True
        rows = []
        start = self.offset
        for end, row in iter_jsonl(self.path, self.offset):
            rows.append((start, end, row))
            start = end
        if rows:
            self.offset = rows[-1][1]
        return rows, truncated

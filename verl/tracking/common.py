"""Helpers shared by the trackers, the TensorBoard converter and the dashboard.

- ``histogram_summary``: a compact, fixed-size histogram (TensorBoard's raw histogram fields), so a distribution
  costs the same few hundred bytes in ``verl_logs.jsonl`` whatever the batch size;
- ``flatten_config``: a nested config as ``{"actor.optim.lr": 1e-4, ...}`` scalars (hparams, MLflow params);
- ``samples_markdown``: sampled generations as a Markdown table (TensorBoard's text plugin renders it);
- ``RunIds``: tracker run ids kept in the run directory, so a resumed verl run continues the same wandb/MLflow run.
"""

from __future__ import annotations

import importlib
import json
import math
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from verl.config import TrackingConfig
from verl.errors import MissingDependencyError
from verl.utils.fs import atomic_write_json

HISTOGRAM_BUCKETS = 30
SAMPLE_COLUMNS = ("step", "split", "prompt", "response", "ground_truth", "score")


def histogram_summary(values: Iterable[float], buckets: int = HISTOGRAM_BUCKETS) -> dict[str, Any] | None:
    """Summarise ``values`` as TensorBoard's raw histogram fields; non-finite values are dropped.

    Returns ``{"min", "max", "num", "sum", "sum_squares", "bucket_limits", "bucket_counts"}`` (limits are right
    bucket edges, as ``SummaryWriter.add_histogram_raw`` expects), or None when no finite value is left.
    """
    array = np.asarray(list(values), dtype=np.float64).ravel()
    array = array[np.isfinite(array)]
    if array.size == 0:
        return None
    counts, edges = np.histogram(array, bins=max(1, min(buckets, int(array.size))))
    return {"min": float(array.min()), "max": float(array.max()), "num": int(array.size), "sum": float(array.sum()),
            "sum_squares": float(np.square(array).sum()), "bucket_limits": [float(x) for x in edges[1:]],
            "bucket_counts": [int(c) for c in counts]}


def flatten_config(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"actor": {"optim": {"lr": 1e-4}}}`` -> ``{"actor.optim.lr": 1e-4}``; lists and None become strings.

    Trackers' hyper-parameter views accept only scalars (bool, int, float, str).
    """
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            if value:
                flat.update(flatten_config(value, name + "."))
            else:
                flat[name] = "{}"
        elif isinstance(value, (bool, int, float, str)):
            flat[name] = value
        elif value is None:
            flat[name] = "None"
        else:
            flat[name] = json.dumps(value, default=str)
    return flat


def as_float(value: Any) -> float | None:
    """A metric value from a JSONL row: numbers, and the strings "nan"/"inf"/"-inf" the logger writes for them."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value.lower() in ("nan", "inf", "-inf", "infinity", "-infinity"):
        return float(value)
    return None


def finite_or_none(value: float) -> float | None:
    """JSON has no NaN/Inf: send them to a browser as null (a gap in the curve)."""
    return value if math.isfinite(value) else None


def _cell(value: Any, limit: int = 400) -> str:
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    if len(text) > limit:
        text = text[:limit] + "…"
    # A table cell is one line; a literal pipe would start a new cell.
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\r", "").replace("\n", "⏎")


def samples_markdown(samples: list[dict[str, Any]], step: int | None = None) -> str:
    """Sampled generations as a Markdown table (prompt, response, ground truth, score)."""
    columns = [c for c in SAMPLE_COLUMNS if c != "step" or step is None]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in samples:
        lines.append("| " + " | ".join(_cell(row.get(c, "")) for c in columns) + " |")
    return "\n".join(lines)


class RunIds:
    """``<run_dir>/tracking.json``: ids of the tracker runs that belong to this verl run.

    ``trainer.resume=auto`` continues a verl run in the same directory; reusing the ids makes wandb and MLflow
    continue the same run instead of starting a new one at every restart.
    """

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / "tracking.json"

    def _read(self) -> dict[str, str]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, key: str) -> str | None:
        value = self._read().get(key)
        return str(value) if value else None

    def set(self, key: str, value: str) -> None:
        data = self._read()
        data[key] = value
        atomic_write_json(self.path, data)


def require(module: str, package: str, tracker: str) -> Any:
    """Import an optional backend's package or fail with the install command (at run start, not mid-run)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingDependencyError(
            package, f"trainer.logger={tracker}",
            f"pip install {package}  (or, in a checkout: pip install -e '.[tracking]')"
        ) from None


def backend_settings(config: Any, backend: str) -> Any:
    """``config.trainer.tracking.<backend>``, or its defaults for configs without a tracking section (SFT)."""
    tracking = getattr(getattr(config, "trainer", None), "tracking", None)
    if tracking is None:
        tracking = TrackingConfig()
    return getattr(tracking, backend)


def run_names(config: Any, run_dir: str | Path | None) -> tuple[str, str]:
    """(project, experiment) names for tracker runs; falls back to the run directory's parent/name."""
    trainer = getattr(config, "trainer", None)
    project = getattr(trainer, "project_name", None)
    experiment = getattr(trainer, "experiment_name", None)
    if run_dir is not None:
        run_dir = Path(run_dir)
        project = project or run_dir.parent.name
        experiment = experiment or run_dir.name
    return project or "verl", experiment or "run"


def exiting_with_error() -> str | None:
    """Inside ``finally`` during an exception: "killed" for Ctrl-C, "failed" for errors; None on success.

    Trackers' ``finish`` runs in the trainer's ``finally``, so this tells them how the run ended.
    """
    exc = sys.exc_info()[0]
    if exc is None:
        return None
    return "killed" if issubclass(exc, KeyboardInterrupt) else "failed"

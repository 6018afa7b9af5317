"""Evaluation results on disk and their identities, shared by the policy evaluation (``eval.runner``) and the
reward-model one (``eval.pairwise``): ``results.json`` / ``samples.jsonl`` written atomically and read back with
clear errors, the weights' hash, content ids that pair prompts across models, reuse, and the best checkpoint."""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import platform
from pathlib import Path
from typing import Any

import numpy as np

from eval.settings import DEFAULT_SELECT
from verl.errors import ConfigError, VerlError
from verl.models.loader import resolve_model_path
from verl.utils.fs import atomic_write_json, atomic_write_text, ensure_writable_dir

SCHEMA = "verl-eval/1"
METRIC_PREFIX = "eval/"


def model_hash(path: str) -> str:
    """sha256 (first 16 hex) of the weight files, so results name exactly which weights they describe."""
    try:
        local = Path(resolve_model_path(path))
    except VerlError:
        local = Path(path)
    files = sorted(local.glob("*.safetensors")) + sorted(local.glob("*.bin")) if local.is_dir() else []
    digest = hashlib.sha256()
    if not files:
        digest.update(path.encode())
    for file in files:
        digest.update(file.name.encode())
        with file.open("rb") as fh:
            for chunk in iter(lambda fh=fh: fh.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()[:16]


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("verl-suite", "torch", "transformers", "numpy"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = "not installed"
    return out


# ---------------------------------------------------------------------------------------------- files


def write_results(out_dir: Path, results: dict, samples: list[dict]) -> None:
    ensure_writable_dir(out_dir, "the eval output dir (--out)")
    atomic_write_text(out_dir / "samples.jsonl", "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in samples))
    atomic_write_json(out_dir / "results.json", results)  # last: its presence means the directory is complete


def load_results(path: str | Path) -> dict:
    file = Path(path)
    file = file / "results.json" if file.is_dir() else file
    if not file.is_file():
        raise VerlError(f"no results.json in '{file.parent}'; run `verl eval --ckpt ...` first")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise VerlError(f"{file} is not valid JSON (line {exc.lineno}): delete it and re-run verl eval") from None
    if data.get("schema") != SCHEMA:
        raise VerlError(f"{file} has schema {data.get('schema')!r}, expected {SCHEMA!r}; re-run verl eval")
    return data


def load_samples(path: str | Path) -> list[dict]:
    file = Path(path)
    file = file / "samples.jsonl" if file.is_dir() else file
    if not file.is_file():
        raise VerlError(f"no samples.jsonl in '{file.parent}'; re-run `verl eval` to write it")
    rows = []
    for number, line in enumerate(file.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            raise VerlError(f"{file} row {number} is not valid JSON; re-run verl eval to rewrite it") from None
        if "prompt_id" not in rows[-1]:
            raise VerlError(f"{file} row {number} has no prompt_id; it was not written by verl eval")
    return rows


def sample_columns(rows: list[dict]) -> dict[str, np.ndarray]:
    """The numeric per-sample fields of ``samples.jsonl`` rows as columns ``(N,)`` (None -> NaN): what the
    evaluators' corpus metrics read back (``verl compare``, ``verl eval --group-by`` on cached results)."""
    columns: dict[str, np.ndarray] = {}
    for key in rows[0] if rows else ():
        values = [r.get(key) for r in rows]
        if all((isinstance(v, (int, float)) and not isinstance(v, bool)) or v is None for v in values):
            columns[key] = np.array([np.nan if v is None else float(v) for v in values])
    return columns


def reusable_results(out_dir: Path, fingerprint: str, digest: str) -> dict | None:
    try:
        results = load_results(out_dir)
    except VerlError:
        return None
    if results.get("settings_fingerprint") == fingerprint and results.get("model_hash") == digest and \
            (out_dir / "samples.jsonl").is_file():
        return results
    return None


# ---------------------------------------------------------------------------------------------- entry points


def parse_select(select: str) -> tuple[str, str]:
    metric, _, mode = select.partition(":")
    mode = mode or "max"
    if mode not in ("max", "min"):
        raise ConfigError(f"--select '{select}': the mode after ':' must be max or min")
    metric = metric.strip()
    if not metric.startswith(METRIC_PREFIX):
        metric = METRIC_PREFIX + metric
    return metric, mode


def select_best(per_checkpoint: list[dict], metric: str, mode: str) -> dict:
    """The checkpoint with the best ``metric`` (ties: the earlier step, so a plateau picks the cheaper model)."""
    scored = [(r["metrics"][metric]["value"], r) for r in per_checkpoint
              if r["metrics"].get(metric, {}).get("value") is not None]
    if not scored:
        raise VerlError(f"no checkpoint has a value for {metric}")
    sign = 1.0 if mode == "max" else -1.0
    value, best = max(scored, key=lambda item: (sign * item[0], -(item[1]["step"] or 0)))
    m = best["metrics"][metric]
    return {"label": best["label"], "step": best["step"], "checkpoint": best["checkpoint"], "metric": metric,
            "mode": mode, "value": value, "se": m.get("se"), "ci95": [m.get("ci_low"), m.get("ci_high")],
            "model_hash": best["model_hash"]}


def write_run_summary(out_dir: Path, run_dir: Path, per_checkpoint: list[dict], select: str, metric: str, mode: str,
                      settings: dict, sampling: dict | None, **extra: Any) -> dict:
    """A run's evaluation summary: the best checkpoint by ``metric`` (``best.json``, with the results ``settings``
    it was ranked under) and every checkpoint's metrics (``summary.json``); returns the summary.

    Under the default ``--select`` on evaluators that give no accuracy (``-e mismatch``), there is no best: the
    summary says so (``best: None``, no ``best.json``) instead of failing after every checkpoint was evaluated."""
    available = sorted(per_checkpoint[-1]["metrics"])
    best = None
    if metric in available:
        best = select_best(per_checkpoint, metric, mode)
        best["settings"] = settings
    elif select != DEFAULT_SELECT:
        raise ConfigError(f"--select '{select}': no metric '{metric}' in the results; available: "
                          f"{', '.join(available)}")
    summary = {
        "schema": SCHEMA + "-run", **extra, "run_dir": str(run_dir), "select": {"metric": metric, "mode": mode},
        "sampling": sampling,
        "checkpoints": [{"label": r["label"], "step": r["step"], "dir": str(out_dir / r["label"]),
                         "checkpoint": r["checkpoint"], "metrics": r["metrics"]} for r in per_checkpoint],
        "best": best,
        "metrics_available": available,
    }
    if best is not None:
        atomic_write_json(out_dir / "best.json", best)
    else:
        (out_dir / "best.json").unlink(missing_ok=True)  # an earlier one ranked other results
    atomic_write_json(out_dir / "summary.json", summary)
    return summary

"""Directories of training data made by ``verl data from-records`` (docs/architecture.md §14), read where a parquet
file is.

An export holds ``train.parquet`` / ``val.parquet`` (prompts), ``pairs/train.parquet`` / ``pairs/val.parquet``
(preference pairs) and ``summary.json`` (which records, from where, over which time window, how many went where).
``data.train_files=[DIR]`` reads ``DIR/train.parquet``, ``data.val_files=[DIR]`` its ``val.parquet``, and ``verl
rm`` the pairs. ``records_lineage`` is what a run records of the traffic it learned from.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from verl.errors import DataError

SUMMARY_FILE = "summary.json"  # serve.from_records writes it
DATA_LINEAGE_FILE = "data_lineage.json"  # in a run directory trained on exports, and copied into its exports
Layout = Literal["prompts", "pairs"]


def split_of(config_key: str) -> str:
    """The export's split a config key reads: ``val`` for validation keys, else ``train``."""
    return "val" if "val" in config_key.rsplit(".", 1)[-1].lower() else "train"


def export_file(directory: Path, config_key: str, layout: Layout = "prompts") -> Path:
    """The parquet file of ``directory`` that ``config_key`` reads (see the module docstring), or a clear error."""
    name = f"{'pairs/' if layout == 'pairs' else ''}{split_of(config_key)}.parquet"
    path = directory / name
    if path.is_file():
        return path
    summary = directory / SUMMARY_FILE
    if not summary.is_file():
        raise DataError(f"{config_key}: '{directory}' is a directory without {name}; give a parquet file, or a "
                        "`verl data from-records` export (train.parquet, val.parquet, pairs/)")
    try:
        written = json.loads(summary.read_text()).get("written", {})
    except ValueError:
        written = {}
    raise DataError(f"{config_key}: the export '{directory}' wrote no {name} ({written.get(name, 0)} rows: "
                    f"{directory / SUMMARY_FILE} says why each record was dropped); widen `verl data from-records`' "
                    "filters, or name another file for this key")


def records_lineage(files: Sequence[str]) -> list[dict]:
    """For each export among ``files``: where its records came from (sources, time window, reward source, models)
    and how many became training data — what a run keeps so a shipped model traces back to its traffic."""
    out, seen = [], set()
    for name in files:
        directory = Path(str(name)).expanduser().resolve()
        summary = directory / SUMMARY_FILE
        if directory in seen or not summary.is_file():
            continue
        seen.add(directory)
        try:
            info = json.loads(summary.read_text())
        except ValueError as exc:
            raise DataError(f"'{summary}' is not valid JSON ({exc}); re-run `verl data from-records`") from None
        counts = info.get("counts", {})
        out.append({"export": str(directory), "sources": info.get("sources"),
                    "time_window": info.get("time_window"), "reward_source": info.get("reward_source"),
                    "models": info.get("models"), "requests": counts.get("requests"),
                    "prompts": counts.get("prompts"), "written": info.get("written")})
    return out

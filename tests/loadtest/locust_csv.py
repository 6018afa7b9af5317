"""Write small Locust-format CSVs by hand (same headers as Locust 2.x ``--csv --csv-full-history``)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

PERCENTILES = ["50%", "66%", "75%", "80%", "90%", "95%", "98%", "99%", "99.9%", "99.99%", "100%"]
STATS_HEADER = ["Type", "Name", "Request Count", "Failure Count", "Median Response Time", "Average Response Time",
                "Min Response Time", "Max Response Time", "Average Content Size", "Requests/s", "Failures/s",
                *PERCENTILES]
HISTORY_HEADER = ["Timestamp", "User Count", "Type", "Name", "Requests/s", "Failures/s", *PERCENTILES,
                  "Total Request Count", "Total Failure Count", "Total Median Response Time",
                  "Total Average Response Time", "Total Min Response Time", "Total Max Response Time",
                  "Total Average Content Size"]
FAILURES_HEADER = ["Method", "Name", "Error", "Occurrences", "First Seen", "Last Seen"]


def _percentiles(p50, p95, p99) -> list:
    """The 11 percentile cells; only 50/95/99 matter to the report, the rest are filled monotonically."""
    if p50 is None:
        return ["N/A"] * len(PERCENTILES)
    return [p50, p50, p50, p50, p95, p95, p99, p99, p99, p99, p99]


def stats_row(type_: str, name: str, count: int, failures: int, mean: float, p50=None, p95=None, p99=None) -> list:
    p50 = mean if p50 is None else p50
    return [type_, name, count, failures, p50, mean, 1, p99 or mean, 0, 1.0, 0.0,
            *_percentiles(p50, p95 or mean, p99 or mean)]


def history_row(ts: int, users: int, type_: str, name: str, total: int, failures: int = 0, mean: float = 0.0,
                p50=None, p95=None, p99=None) -> list:
    pct = _percentiles(p50, p95, p99) if total else ["N/A"] * len(PERCENTILES)
    return [ts, users, type_, name, "0.000000", "0.000000", *pct, total, failures, p50 or 0, mean, 0, 0, 0]


def write_run(directory: Path, stats: list[list], history: list[list], failures: list[list] | None = None,
              info: dict | None = None, stem: str = "run") -> Path:
    """Write ``<stem>_stats.csv`` etc. into ``directory``; returns the prefix."""
    directory.mkdir(parents=True, exist_ok=True)
    prefix = directory / stem
    for suffix, header, rows in (("_stats.csv", STATS_HEADER, stats), ("_stats_history.csv", HISTORY_HEADER, history),
                                 ("_failures.csv", FAILURES_HEADER, failures or [])):
        with open(f"{prefix}{suffix}", "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(header)
            writer.writerows(rows)
    if info is not None:
        Path(f"{prefix}_loadtest.json").write_text(json.dumps(info))
    return prefix

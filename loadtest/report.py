"""Capacity report from Locust's ``--csv`` files: ``verl loadtest-report PREFIX --out DIR``.

Reads ``PREFIX_stats.csv`` (totals per entry), ``PREFIX_stats_history.csv`` (one row per entry per second; needs
``--csv-full-history``), ``PREFIX_failures.csv`` and, when present, ``PREFIX_loadtest.json`` (written by our
locustfile: the step plan and request mix). Writes ``capacity_report.{md,html,json}`` and two PNG plots.

How the numbers are made (all from the CSVs, nothing re-measured):

- A *step* is a run of history rows with the same user count. Counts (requests, failures) cover the whole step:
  the difference of the cumulative ``Total Request Count`` between the step's last row and the previous step's
  last row, summed over the HTTP entries (the ``LLM`` custom entries are not requests). So the steps' requests
  add up to the run's HTTP request total in ``_stats.csv``.
- Rates (requests/s, output tokens/s) and percentiles cover the step's *measurement window*: its last
  ``window_s`` seconds (the locustfile sets Locust's sliding percentile window to the same ``step_time -
  settle``). Percentiles are Locust's own, from the step's last history row: latency from the ``LLM
  e2e_latency_ms`` entry (successful requests of every endpoint; without our entries, the ``Aggregated`` row),
  TTFT from ``LLM ttft_ms``. Output tokens = count x mean of the ``LLM output_tokens`` entry, differenced.
- A step *meets the SLO* when its p95 latency <= ``slo_p95_ms``, its failure rate <= ``max_failure_rate`` and
  (if given) its TTFT p95 <= ``slo_ttft_p95_ms``. *Capacity* = the largest user count such that every step
  up to it meets the SLO (the first failing level ends the search, so a lucky higher level never counts).
  The *planning point* keeps ``headroom`` (default 20%) spare: ``floor(capacity * (1 - headroom))`` users and
  ``(1 - headroom) x`` the requests/s measured at capacity.
"""

from __future__ import annotations

import csv
import html
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verl.errors import DataError

LLM = "LLM"  # request type of the locustfile's custom entries
LATENCY_ENTRY, TTFT_ENTRY, TOKENS_ENTRY = "e2e_latency_ms", "ttft_ms", "output_tokens"
STATS_COLUMNS = ("Type", "Name", "Request Count", "Failure Count", "Median Response Time", "Average Response Time",
                 "Min Response Time", "Max Response Time", "Requests/s", "50%", "95%", "99%")
HISTORY_COLUMNS = ("Timestamp", "User Count", "Type", "Name", "50%", "95%", "99%", "Total Request Count",
                   "Total Failure Count", "Total Average Response Time")
FAILURES_COLUMNS = ("Method", "Name", "Error", "Occurrences")
REPORT_STEM = "capacity_report"
PLOTS = {"latency": "latency_vs_users.png", "throughput": "throughput_vs_users.png"}


@dataclass(frozen=True)
class SLO:
    """What "within the SLO" means for one step; the capacity search uses it."""

    p95_ms: float = 1000.0
    max_failure_rate: float = 0.01
    ttft_p95_ms: float | None = None
    headroom: float = 0.2

    def __post_init__(self) -> None:
        if self.p95_ms <= 0:
            raise DataError(f"the p95 SLO must be > 0 ms (got {self.p95_ms})")
        if not 0 <= self.max_failure_rate <= 1:
            raise DataError(f"the failure-rate limit must be within 0..1 (got {self.max_failure_rate})")
        if self.ttft_p95_ms is not None and self.ttft_p95_ms <= 0:
            raise DataError(f"the TTFT p95 SLO must be > 0 ms (got {self.ttft_p95_ms})")
        if not 0 <= self.headroom < 1:
            raise DataError(f"headroom must be within 0..1 (got {self.headroom}); 0.2 keeps 20% spare")


# ---------------------------------------------------------------- reading the CSVs


def resolve_prefix(path: str | Path) -> Path:
    """``out/run`` (Locust's ``--csv`` value), ``out/run_stats.csv`` or a directory holding one ``*_stats.csv``."""
    path = Path(path)
    if path.is_dir():
        found = sorted(path.glob("*_stats.csv"))
        if len(found) != 1:
            names = ", ".join(p.name for p in found) or "none"
            raise DataError(f"'{path}' should hold exactly one Locust '*_stats.csv' (found {names}); pass the "
                            "--csv prefix instead, e.g. out/run for out/run_stats.csv")
        path = found[0]
    name = path.name
    for suffix in ("_stats_history.csv", "_stats.csv", "_failures.csv", "_exceptions.csv", "_loadtest.json"):
        if name.endswith(suffix):
            return path.with_name(name[: -len(suffix)])
    return path


def _read(path: Path, required: tuple[str, ...], hint: str) -> list[tuple[int, dict[str, str]]]:
    """Rows of ``path`` with their line numbers; a missing file or column is an error naming both."""
    if not path.is_file():
        raise DataError(f"'{path}' does not exist; {hint}")
    with path.open(newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        header = reader.fieldnames or []
        missing = [c for c in required if c not in header]
        if missing:
            raise DataError(f"'{path}' has no column {', '.join(repr(c) for c in missing)} (columns: "
                            f"{', '.join(header) or 'none - empty file'}); is it a Locust --csv file?")
        return [(number, row) for number, row in enumerate(reader, 2)]


def _num(row: dict[str, str], column: str, path: Path, line: int) -> float | None:
    """A number from a cell; Locust writes ``N/A`` (entries without requests) and empty cells: ``None``."""
    value = (row.get(column) or "").strip()
    if value in ("", "N/A"):
        return None
    try:
        return float(value)
    except ValueError:
        raise DataError(f"'{path}', line {line}, column '{column}': {value!r} is not a number") from None


def _is_http(entry_type: str, name: str) -> bool:
    """An HTTP endpoint row: not Locust's ``Aggregated`` total and not one of our ``LLM`` custom entries."""
    return name != "Aggregated" and entry_type != LLM


@dataclass
class Entry:
    """One row of ``_stats.csv``."""

    type: str
    name: str
    requests: int
    failures: int
    median_ms: float | None
    mean_ms: float | None
    min_ms: float | None
    max_ms: float | None
    rps: float | None
    p50: float | None
    p95: float | None
    p99: float | None

    @property
    def is_http(self) -> bool:
        return _is_http(self.type, self.name)


@dataclass
class HistoryRow:
    """One row of ``_stats_history.csv`` (cumulative counts; percentiles over Locust's sliding window)."""

    timestamp: int
    users: int
    type: str
    name: str
    p50: float | None
    p95: float | None
    p99: float | None
    total_requests: int
    total_failures: int
    total_mean: float | None

    @property
    def is_http(self) -> bool:
        return _is_http(self.type, self.name)


@dataclass
class Snapshot:
    """Every entry's history row at one timestamp."""

    timestamp: int
    users: int
    rows: dict[tuple[str, str], HistoryRow]

    def http_total(self, attr: str = "total_requests") -> int:
        return sum(getattr(r, attr) for r in self.rows.values() if r.is_http)

    def llm(self, name: str) -> HistoryRow | None:
        return self.rows.get((LLM, name))

    def aggregated(self) -> HistoryRow | None:
        return self.rows.get(("", "Aggregated"))

    def llm_sum(self, name: str) -> float:
        """Sum of an LLM entry's values so far (count x mean): e.g. output tokens generated."""
        row = self.llm(name)
        return row.total_requests * (row.total_mean or 0.0) if row else 0.0


@dataclass
class LocustRun:
    prefix: Path
    entries: list[Entry]
    snapshots: list[Snapshot]
    failures: list[dict[str, Any]]
    info: dict[str, Any] | None


def read_stats(path: Path) -> list[Entry]:
    entries = []
    for line, row in _read(path, STATS_COLUMNS, "run Locust with --csv PREFIX to write it"):
        def n(col: str, row: dict[str, str] = row, line: int = line) -> float | None:
            return _num(row, col, path, line)

        entries.append(Entry(row["Type"], row["Name"], int(n("Request Count") or 0), int(n("Failure Count") or 0),
                             n("Median Response Time"), n("Average Response Time"), n("Min Response Time"),
                             n("Max Response Time"), n("Requests/s"), n("50%"), n("95%"), n("99%")))
    if not any(e.name == "Aggregated" for e in entries):
        raise DataError(f"'{path}' has no 'Aggregated' row; is it a complete Locust _stats.csv?")
    return entries


def read_history(path: Path) -> list[Snapshot]:
    hint = "run Locust with --csv PREFIX --csv-full-history (loadtest/locust.conf sets both)"
    by_time: dict[int, Snapshot] = {}
    for line, row in _read(path, HISTORY_COLUMNS, hint):
        def n(col: str, row: dict[str, str] = row, line: int = line) -> float | None:
            return _num(row, col, path, line)

        timestamp, users = n("Timestamp"), n("User Count")
        if timestamp is None or users is None:
            raise DataError(f"'{path}', line {line}: 'Timestamp' and 'User Count' must be numbers")
        entry = HistoryRow(int(timestamp), int(users), row["Type"], row["Name"], n("50%"), n("95%"), n("99%"),
                           int(n("Total Request Count") or 0), int(n("Total Failure Count") or 0),
                           n("Total Average Response Time"))
        # Locust writes each timestamp once; should a second tick land in the same second, the later row wins.
        snap = by_time.setdefault(entry.timestamp, Snapshot(entry.timestamp, entry.users, {}))
        snap.users = entry.users
        snap.rows[(entry.type, entry.name)] = entry
    snapshots = [by_time[t] for t in sorted(by_time)]
    if not snapshots:
        raise DataError(f"'{path}' has no rows: the test wrote no history (did it run at least a second?)")
    if not any(r.is_http for s in snapshots for r in s.rows.values()):
        raise DataError(f"'{path}' has only 'Aggregated' rows; per-endpoint rows are needed: {hint}")
    return snapshots


def read_failures(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []  # older runs or runs stopped before the first write; no failures table then
    rows = []
    for line, row in _read(path, FAILURES_COLUMNS, ""):
        rows.append({"method": row["Method"], "name": row["Name"], "error": row["Error"],
                     "occurrences": int(_num(row, "Occurrences", path, line) or 0)})
    return sorted(rows, key=lambda r: -r["occurrences"])


def load_run(prefix: str | Path) -> LocustRun:
    prefix = resolve_prefix(prefix)
    info_path = Path(f"{prefix}_loadtest.json")
    info = None
    if info_path.is_file():
        try:
            info = json.loads(info_path.read_text())
        except ValueError as exc:
            raise DataError(f"'{info_path}' is not valid JSON ({exc})") from None
    return LocustRun(prefix, read_stats(Path(f"{prefix}_stats.csv")),
                     read_history(Path(f"{prefix}_stats_history.csv")), read_failures(Path(f"{prefix}_failures.csv")),
                     info)


# ---------------------------------------------------------------- steps and capacity


def segment_steps(snapshots: list[Snapshot]) -> list[list[Snapshot]]:
    """Runs of consecutive snapshots with the same (non-zero) user count, in time order."""
    steps: list[list[Snapshot]] = []
    for snap in snapshots:
        if snap.users <= 0:
            continue
        if steps and steps[-1][-1].users == snap.users:
            steps[-1].append(snap)
        else:
            steps.append([snap])
    return steps


def _rate(delta: float, seconds: float) -> float | None:
    return delta / seconds if seconds > 0 else None


def _pct(row: HistoryRow | None) -> tuple[float | None, float | None, float | None]:
    """A row's windowed p50/p95/p99; 0 means "not computed" (Locust writes 0 when its sliding window found no
    snapshot to diff against, e.g. after a long stall) -- no latency here is really 0 ms -- so it becomes None."""
    if row is None:
        return None, None, None
    return tuple(v if v else None for v in (row.p50, row.p95, row.p99))  # type: ignore[return-value]


def step_metrics(steps: list[list[Snapshot]], snapshots: list[Snapshot], window_s: int) -> list[dict]:
    """Per-step numbers (see the module docstring for what each covers)."""
    has_llm = any(s.llm(LATENCY_ENTRY) for s in snapshots)
    final = snapshots[-1]
    out = []
    previous: Snapshot | None = None
    for index, step in enumerate(steps):
        end = step[-1]
        # Requests finishing after the last level's last row (users stopping) still belong to that level.
        count_end = final if index == len(steps) - 1 else end
        requests = count_end.http_total() - (previous.http_total() if previous else 0)
        failures = count_end.http_total("total_failures") - (previous.http_total("total_failures") if previous else 0)
        # The window's base: the last snapshot at least window_s before the end (else the step's start).
        candidates = ([previous] if previous else []) + step[:-1]
        base = candidates[0] if candidates else None
        for snap in candidates:
            if snap.timestamp <= end.timestamp - window_s:
                base = snap
        seconds = end.timestamp - base.timestamp if base else 0
        base_requests = base.http_total() if base else 0
        base_tokens = base.llm_sum(TOKENS_ENTRY) if base else 0.0
        latency_row = end.llm(LATENCY_ENTRY) if has_llm else end.aggregated()
        p50, p95, p99 = _pct(latency_row)
        ttft50, ttft95, _ = _pct(end.llm(TTFT_ENTRY))
        out.append({
            "index": index,
            "users": end.users,
            "start": step[0].timestamp,
            "end": end.timestamp,
            "window_s": seconds,
            "requests": requests,
            "failures": failures,
            "failure_rate": failures / requests if requests else None,
            "requests_per_s": _rate(end.http_total() - base_requests, seconds),
            "latency_p50_ms": p50,
            "latency_p95_ms": p95,
            "latency_p99_ms": p99,
            "ttft_p50_ms": ttft50,
            "ttft_p95_ms": ttft95,
            "output_tokens_per_s": (_rate(end.llm_sum(TOKENS_ENTRY) - base_tokens, seconds)
                                    if end.llm(TOKENS_ENTRY) else None),
        })
        previous = end
    return out


def judge_step(step: dict, slo: SLO) -> list[str]:
    """Why a step misses the SLO (empty list: it meets it)."""
    reasons = []
    p95 = step["latency_p95_ms"]
    if not step["requests"]:
        reasons.append("no requests finished")
    elif p95 is None:
        reasons.append("no latency percentile for the window (no successful request, or Locust could not compute one)")
    elif p95 > slo.p95_ms:
        reasons.append(f"p95 {p95:g} ms > {slo.p95_ms:g} ms")
    rate = step["failure_rate"]
    if rate is not None and rate > slo.max_failure_rate:
        reasons.append(f"failure rate {rate:.2%} > {slo.max_failure_rate:.2%}")
    if slo.ttft_p95_ms is not None:
        ttft = step["ttft_p95_ms"]
        if ttft is None:
            reasons.append("no TTFT p95 (no streamed requests)")
        elif ttft > slo.ttft_p95_ms:
            reasons.append(f"TTFT p95 {ttft:g} ms > {slo.ttft_p95_ms:g} ms")
    return reasons


def capacity(steps: list[dict], slo: SLO) -> dict[str, Any]:
    """Largest user count with every level up to it within the SLO, and the planning point below it."""
    fraction = 1.0 - slo.headroom
    by_level: dict[int, list[dict]] = {}
    for step in steps:
        by_level.setdefault(step["users"], []).append(step)
    max_users, first_failing = None, None
    for users in sorted(by_level):
        if any(s["why_not"] for s in by_level[users]):
            first_failing = users
            break
        max_users = users
    result: dict[str, Any] = {"max_users_within_slo": max_users, "first_failing_users": first_failing,
                              "headroom": slo.headroom, "all_levels_within_slo": first_failing is None and bool(steps)}
    if max_users is None:
        result.update(planning_users=0, rps_at_max=None, planning_rps=None)
        return result
    rates = [s["requests_per_s"] for s in by_level[max_users] if s["requests_per_s"] is not None]
    rps = sum(rates) / len(rates) if rates else None
    # The small epsilon keeps 5 * 0.8 = 4.000000000000001 -> 4 and 10 * 0.8 = 8 exact after float rounding.
    result.update(planning_users=math.floor(max_users * fraction + 1e-9), rps_at_max=rps,
                  planning_rps=rps * fraction if rps is not None else None)
    return result


def build_report(prefix: str | Path, slo: SLO | None = None,
                 server_metrics: str | Path | None = None) -> dict[str, Any]:
    """Everything the report says, as plain data (``capacity_report.json``).

    ``server_metrics``: a saved ``/metrics`` page of the service after the run (``verl loadtest`` saves one), shown
    beside Locust's numbers as a cross-check.
    """
    slo = slo or SLO()
    run = load_run(prefix)
    server = None
    if server_metrics is not None:
        path = Path(server_metrics)
        if not path.is_file():
            raise DataError(f"server metrics file '{path}' does not exist (save the service's /metrics page)")
        try:
            server = parse_server_metrics(path.read_text())
        except ValueError as exc:
            raise DataError(f"'{path}' is not Prometheus text format ({exc})") from None
    info = run.info or {}
    window = (info.get("plan") or {}).get("window_s") or info.get("percentile_window_s")
    # Without our locustfile's info, assume Locust's default percentile window (10 s).
    window_s = int(window) if window else 10
    steps = step_metrics(segment_steps(run.snapshots), run.snapshots, window_s)
    for step in steps:
        step["why_not"] = judge_step(step, slo)
        step["meets_slo"] = not step["why_not"]
    http = [e for e in run.entries if e.is_http]
    aggregated = next(e for e in run.entries if e.name == "Aggregated")
    final = run.snapshots[-1]
    active = [s.timestamp for s in run.snapshots if s.rows and s.users > 0]
    totals = {
        "http_requests": sum(e.requests for e in http),
        "http_failures": sum(e.failures for e in http),
        "locust_aggregated_requests": aggregated.requests,
        "llm_entries": sum(e.requests for e in run.entries if e.type == LLM),
        "history_http_requests": final.http_total(),
        "steps_requests": sum(s["requests"] for s in steps),
        "output_tokens": round(final.llm_sum(TOKENS_ENTRY)),
        "duration_s": (active[-1] - active[0]) if active else 0,
    }
    notes = []
    if totals["history_http_requests"] != totals["http_requests"]:
        notes.append(f"_stats_history.csv's last row counts {totals['history_http_requests']} HTTP requests but "
                     f"_stats.csv {totals['http_requests']} (files from different moments?)")
    has_llm = any(s.llm(LATENCY_ENTRY) for s in run.snapshots)
    if not has_llm:
        notes.append("no LLM custom entries (not our locustfile?): latency percentiles come from the Aggregated "
                     "row; TTFT and tokens/s are not available")
    if window is None:
        notes.append(f"no {run.prefix.name}_loadtest.json: assumed Locust's default 10 s percentile window")

    def entry(e: Entry) -> dict[str, Any]:
        return {"type": e.type, "name": e.name, "requests": e.requests, "failures": e.failures, "mean": e.mean_ms,
                "p50": e.p50, "p95": e.p95, "p99": e.p99, "max": e.max_ms, "rps": e.rps}

    return {
        "source": {"prefix": str(run.prefix), "run": run.info},
        "slo": {"p95_ms": slo.p95_ms, "max_failure_rate": slo.max_failure_rate, "ttft_p95_ms": slo.ttft_p95_ms,
                "latency_metric": f"{LLM} {LATENCY_ENTRY}" if has_llm else "Aggregated"},
        "window_s": window_s,
        "totals": totals,
        "steps": steps,
        "capacity": capacity(steps, slo),
        "endpoints": [entry(e) for e in http],
        "llm": [entry(e) for e in run.entries if e.type == LLM],
        "failures": run.failures,
        "server": server,
        "notes": notes,
    }


# ---------------------------------------------------------------- the service's own numbers (/metrics)

SERVER_HISTOGRAMS = {"ttft": "verl:time_to_first_token_seconds", "itl": "verl:inter_token_latency_seconds",
                     "e2e": "verl:e2e_request_latency_seconds"}


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' ``histogram_quantile``: linear interpolation inside the bucket holding the q-th observation.

    ``buckets`` are ``(upper bound, cumulative count)`` sorted by bound, ending with ``+Inf``. Like Prometheus, a
    quantile in the ``+Inf`` bucket returns the largest finite bound.
    """
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound


def _read_prometheus(text: str) -> dict[str, Any]:
    """Raw histogram buckets/sum/count, HTTP counts by path and status, generated tokens."""
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError:
        from verl.errors import MissingDependencyError

        raise MissingDependencyError("prometheus-client", "reading the service's /metrics") from None

    raw: dict[str, Any] = {key: {"buckets": {}, "sum": 0.0, "count": 0.0} for key in SERVER_HISTOGRAMS}
    raw["http"], raw["tokens"] = {}, 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for key, name in SERVER_HISTOGRAMS.items():
                hist = raw[key]
                if sample.name == name + "_bucket":
                    le = float(sample.labels["le"])
                    hist["buckets"][le] = hist["buckets"].get(le, 0.0) + sample.value
                elif sample.name == name + "_sum":
                    hist["sum"] += sample.value
                elif sample.name == name + "_count":
                    hist["count"] += sample.value
            if sample.name == "verl:http_requests_total":
                key = (sample.labels.get("path", "?"), sample.labels.get("status", "?"))
                raw["http"][key] = raw["http"].get(key, 0.0) + sample.value
            elif sample.name == "verl:generation_tokens_total":
                raw["tokens"] += sample.value
    return raw


def parse_server_metrics(text: str, baseline: str | None = None) -> dict[str, Any]:
    """The service's TTFT / ITL / e2e histograms (count, mean, p50, p95 in ms) and HTTP counts by path.

    With ``baseline`` (an earlier scrape of the same service) everything is the difference: what happened between
    the two scrapes, e.g. during one Locust run.
    """
    now, then = _read_prometheus(text), _read_prometheus(baseline) if baseline is not None else None
    out: dict[str, Any] = {"generation_tokens": int(now["tokens"] - (then["tokens"] if then else 0))}
    http: dict[str, dict[str, int]] = {}
    for (path, status), value in now["http"].items():
        value -= then["http"].get((path, status), 0.0) if then else 0.0
        if value:
            http.setdefault(path, {})[status] = int(value)
    out["http_requests"] = http
    for key in SERVER_HISTOGRAMS:
        hist, old = now[key], then[key] if then else {"buckets": {}, "sum": 0.0, "count": 0.0}
        count, total = hist["count"] - old["count"], hist["sum"] - old["sum"]
        buckets = sorted((le, c - old["buckets"].get(le, 0.0)) for le, c in hist["buckets"].items())
        p50, p95 = histogram_quantile(0.5, buckets), histogram_quantile(0.95, buckets)
        out[key] = {"count": int(count), "sum_s": total, "mean_ms": 1000 * total / count if count else None,
                    "p50_ms": None if p50 is None else 1000 * p50, "p95_ms": None if p95 is None else 1000 * p95,
                    "buckets": [[le, n] for le, n in buckets]}
    return out


# ---------------------------------------------------------------- writing


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.{digits}g}" if abs(value) < 10 ** digits else f"{value:.0f}"
    return str(value)


def _summary_lines(report: dict[str, Any]) -> list[str]:
    cap, slo, totals = report["capacity"], report["slo"], report["totals"]
    rule = f"p95 latency <= {slo['p95_ms']:g} ms and failure rate <= {slo['max_failure_rate']:.1%}"
    if slo["ttft_p95_ms"] is not None:
        rule += f" and TTFT p95 <= {slo['ttft_p95_ms']:g} ms"
    lines = [f"SLO: {rule} (latency = {slo['latency_metric']}, over each step's last {report['window_s']} s)."]
    if cap["max_users_within_slo"] is None:
        first = report["steps"][0]["why_not"] if report["steps"] else ["no steps"]
        lines.append(f"**No tested level meets the SLO** (lowest level: {'; '.join(first)}).")
    else:
        share = 1 - cap["headroom"]
        lines.append(f"**Capacity: {cap['max_users_within_slo']} users** within the SLO "
                     f"({_fmt(cap['rps_at_max'])} requests/s).")
        planning = cap["planning_users"]
        lines.append(f"**Plan for {planning} users** per replica ({share:.0%} of capacity, {cap['headroom']:.0%} "
                     f"headroom; about {_fmt(cap['planning_rps'])} requests/s)"
                     + (" - below one user: the replica has no headroom at 1 user." if planning < 1 else "."))
        if cap["first_failing_users"] is not None:
            why = next(s["why_not"] for s in report["steps"] if s["users"] == cap["first_failing_users"]
                       and s["why_not"])
            lines.append(f"The next level, {cap['first_failing_users']} users, misses it: {'; '.join(why)}.")
        else:
            lines.append("Every tested level met the SLO: capacity is at least this; test higher levels to find "
                         "the limit.")
    lines.append(f"{totals['http_requests']} HTTP requests ({totals['http_failures']} failed) and "
                 f"{totals['output_tokens']} output tokens in {totals['duration_s']} s. Locust's Aggregated row "
                 f"counts {totals['locust_aggregated_requests']}: the HTTP requests plus "
                 f"{totals['llm_entries']} LLM custom entries.")
    return lines


STEP_HEADERS = ["users", "requests", "requests/s", "failure rate", "p50 ms", "p95 ms", "p99 ms", "TTFT p50 ms",
                "TTFT p95 ms", "output tokens/s", "meets SLO"]


def _step_row(step: dict) -> list[str]:
    rate = step["failure_rate"]
    return [_fmt(step["users"]), _fmt(step["requests"]), _fmt(step["requests_per_s"]),
            "-" if rate is None else f"{rate:.2%}", _fmt(step["latency_p50_ms"]), _fmt(step["latency_p95_ms"]),
            _fmt(step["latency_p99_ms"]), _fmt(step["ttft_p50_ms"]), _fmt(step["ttft_p95_ms"]),
            _fmt(step["output_tokens_per_s"]), "yes" if step["meets_slo"] else "no: " + "; ".join(step["why_not"])]


ENTRY_HEADERS = ["type", "name", "count", "failures", "mean", "p50", "p95", "p99", "max"]


def _entry_row(e: dict) -> list[str]:
    return [e["type"], e["name"], _fmt(e["requests"]), _fmt(e["failures"]), _fmt(e["mean"]), _fmt(e["p50"]),
            _fmt(e["p95"]), _fmt(e["p99"]), _fmt(e["max"])]


def _blocks(report: dict[str, Any], plots: dict[str, Path]) -> list[tuple]:
    blocks: list[tuple] = [("p", line) for line in _summary_lines(report)]
    blocks.append(("h", "Steps"))
    blocks.append(("p", f"Counts cover the whole step; rates and percentiles its last {report['window_s']} s "
                        "(after the users settled)."))
    blocks.append(("table", STEP_HEADERS, [_step_row(s) for s in report["steps"]]))
    for key, title in (("latency", "Latency vs users"), ("throughput", "Throughput vs users")):
        if key in plots:
            blocks.append(("img", plots[key].name, title))
    blocks.append(("h", "Endpoints (whole run, milliseconds)"))
    blocks.append(("table", ENTRY_HEADERS, [_entry_row(e) for e in report["endpoints"]]))
    if report["llm"]:
        blocks.append(("h", "LLM entries (whole run; unit in the name)"))
        blocks.append(("table", ENTRY_HEADERS, [_entry_row(e) for e in report["llm"]]))
    if report["failures"]:
        blocks.append(("h", "Failures"))
        blocks.append(("table", ["method", "name", "error", "occurrences"],
                       [[f["method"], f["name"], f["error"], str(f["occurrences"])] for f in report["failures"][:20]]))
    server = report.get("server")
    if server:
        blocks.append(("h", "The service's own view (/metrics)"))
        blocks.append(("p", "Histogram means are exact (sum / count); p50/p95 are interpolated inside the buckets, "
                            "as Prometheus' histogram_quantile does. The service times from admission (after "
                            "parsing and tokenizing) and counts every endpoint; Locust times from sending the "
                            "request, and its TTFT/ITL cover the streamed chats only."))
        llm = {e["name"]: e for e in report["llm"]}
        rows = []
        for key, label, entry in (("ttft", "time to first token", TTFT_ENTRY), ("itl", "inter-token latency",
                                   "itl_ms"), ("e2e", "end-to-end latency", LATENCY_ENTRY)):
            svc, client = server[key], llm.get(entry, {})
            rows.append([label, _fmt(svc["count"]), _fmt(svc["mean_ms"]), _fmt(svc["p50_ms"]), _fmt(svc["p95_ms"]),
                         _fmt(client.get("requests")), _fmt(client.get("mean")), _fmt(client.get("p50")),
                         _fmt(client.get("p95"))])
        blocks.append(("table", ["metric (ms)", "service count", "service mean", "service p50", "service p95",
                                 "Locust count", "Locust mean", "Locust p50", "Locust p95"], rows))
        by_name = {e["name"]: e for e in report["endpoints"]}
        rows = []
        for path, statuses in sorted(server["http_requests"].items()):
            locust_name = next((n for n in by_name if n.split(" ")[0] == path), None)
            if locust_name is None:
                continue
            served = sum(v for k, v in statuses.items() if k == "200")
            entry = by_name[locust_name]
            rows.append([path, str(served), ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items())),
                         str(entry["requests"] - entry["failures"])])
        if rows:
            blocks.append(("table", ["path", "service 200s", "service by status", "Locust successes"], rows))
    info = report["source"]["run"]
    if info:
        keys = ("host", "model", "load_shape", "plan", "user_classes", "mixed_user_requests", "prompt_file",
                "max_tokens", "temperature", "ignore_eos", "wait_s", "locust_version", "started_at")
        blocks.append(("h", "Run"))
        blocks.append(("table", ["setting", "value"], [[k, json.dumps(info.get(k))] for k in keys if k in info]))
    if report["notes"]:
        blocks.append(("h", "Notes"))
        blocks.extend(("p", note) for note in report["notes"])
    return blocks


def render_markdown(report: dict[str, Any], plots: dict[str, Path]) -> str:
    out = ["# Capacity report", ""]
    for block in _blocks(report, plots):
        if block[0] == "h":
            out += [f"## {block[1]}", ""]
        elif block[0] == "p":
            out += [block[1], ""]
        elif block[0] == "table":
            out.append("| " + " | ".join(block[1]) + " |")
            out.append("|" + "|".join("---" for _ in block[1]) + "|")
            out += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in block[2]]
            out.append("")
        elif block[0] == "img":
            out += [f"![{block[2]}]({block[1]})", ""]
    return "\n".join(out)


_CSS = ("body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}"
        "table{border-collapse:collapse;margin:1em 0;font-size:0.9em}th,td{border:1px solid #ccc;padding:4px 8px;"
        "text-align:right}td:first-child,th:first-child{text-align:left}th{background:#f3f3f3}img{max-width:100%}")


def _inline_html(text: str) -> str:
    # The only Markdown our paragraphs use is **bold**.
    parts = html.escape(text).split("**")
    return "".join(f"<b>{p}</b>" if i % 2 else p for i, p in enumerate(parts))


def render_html(report: dict[str, Any], plots: dict[str, Path]) -> str:
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>Capacity report</title>",
             f"<style>{_CSS}</style></head><body><h1>Capacity report</h1>"]
    for block in _blocks(report, plots):
        if block[0] == "h":
            parts.append(f"<h2>{html.escape(block[1])}</h2>")
        elif block[0] == "p":
            parts.append(f"<p>{_inline_html(block[1])}</p>")
        elif block[0] == "table":
            head = "".join(f"<th>{html.escape(h)}</th>" for h in block[1])
            body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in block[2])
            parts.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
        elif block[0] == "img":
            parts.append(f"<figure><img src='{html.escape(block[1])}' alt='{html.escape(block[2])}'>"
                         f"<figcaption>{html.escape(block[2])}</figcaption></figure>")
    parts.append("</body></html>")
    return "\n".join(parts)


def plot_report(report: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    """Latency-vs-users and throughput-vs-users PNGs (written atomically); no steps, no plots."""
    steps = report["steps"]
    if not steps:
        return {}
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    from verl.utils.fs import atomic_path

    users = [s["users"] for s in steps]
    cap = report["capacity"]
    paths = {}

    def mark_capacity(ax: Any) -> None:
        if cap["max_users_within_slo"] is not None:
            ax.axvline(cap["max_users_within_slo"], color="tab:green", ls=":", lw=1.2,
                       label=f"capacity {cap['max_users_within_slo']} users")
            if cap["planning_users"] >= 1:
                ax.axvline(cap["planning_users"], color="tab:olive", ls="-.", lw=1.2,
                           label=f"plan {cap['planning_users']} users ({1 - cap['headroom']:.0%})")

    def series(key: str) -> list[float]:
        return [float("nan") if s[key] is None else s[key] for s in steps]

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for key, label, style in (("latency_p50_ms", "p50", "o-"), ("latency_p95_ms", "p95", "s-"),
                              ("latency_p99_ms", "p99", "^-"), ("ttft_p50_ms", "TTFT p50", "o--"),
                              ("ttft_p95_ms", "TTFT p95", "s--")):
        values = series(key)
        if any(not math.isnan(v) for v in values):
            ax.plot(users, values, style, label=label, ms=4)
    ax.axhline(report["slo"]["p95_ms"], color="tab:red", lw=1, label=f"SLO p95 {report['slo']['p95_ms']:g} ms")
    mark_capacity(ax)
    ax.set(xlabel="concurrent users", ylabel="milliseconds", title="Latency vs users")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(set(users)), [str(u) for u in sorted(set(users))])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(out_dir / PLOTS["latency"]) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
    paths["latency"] = out_dir / PLOTS["latency"]

    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(users, series("requests_per_s"), "o-", color="tab:blue", label="requests/s")
    ax.set(xlabel="concurrent users", ylabel="requests/s", title="Throughput vs users")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(set(users)), [str(u) for u in sorted(set(users))])
    mark_capacity(ax)
    tokens = series("output_tokens_per_s")
    handles, labels = ax.get_legend_handles_labels()
    if any(not math.isnan(v) for v in tokens):
        ax2 = ax.twinx()
        ax2.plot(users, tokens, "s--", color="tab:orange", label="output tokens/s")
        ax2.set_ylabel("output tokens/s")
        more_handles, more_labels = ax2.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    ax.grid(alpha=0.3)
    ax.legend(handles, labels, fontsize=8, loc="upper left")
    fig.tight_layout()
    with atomic_path(out_dir / PLOTS["throughput"]) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
    paths["throughput"] = out_dir / PLOTS["throughput"]
    return paths


def write_report(report: dict[str, Any], out_dir: str | Path, plots: bool = True) -> dict[str, Path]:
    """``capacity_report.{json,md,html}`` and the PNGs into ``out_dir``; each file written atomically."""
    from verl.utils.fs import atomic_write_json, atomic_write_text, ensure_writable_dir

    out_dir = ensure_writable_dir(out_dir, "the report dir (--out)")
    images = plot_report(report, out_dir) if plots else {}
    paths = {
        "json": atomic_write_json(out_dir / f"{REPORT_STEM}.json", report),
        "markdown": atomic_write_text(out_dir / f"{REPORT_STEM}.md", render_markdown(report, images)),
        "html": atomic_write_text(out_dir / f"{REPORT_STEM}.html", render_html(report, images)),
    }
    return {**paths, **images}


def make_report(prefix: str | Path, out_dir: str | Path, slo: SLO | None = None, plots: bool = True,
                server_metrics: str | Path | None = None) -> tuple[dict[str, Any], dict[str, Path]]:
    """Read the CSVs at ``prefix``, write the report into ``out_dir``; returns the report and its files."""
    report = build_report(prefix, slo, server_metrics)
    return report, write_report(report, out_dir, plots)


def summary_text(report: dict[str, Any]) -> str:
    """The report's headline as plain text (for the terminal)."""
    return "\n".join(line.replace("**", "") for line in _summary_lines(report))

"""Capacity report from Locust's ``--csv`` files: ``verl loadtest-report PREFIX --out DIR``.

Reads ``PREFIX_stats.csv`` (totals per entry), ``PREFIX_stats_history.csv`` (one row per entry per second; needs
``--csv-full-history``), ``PREFIX_failures.csv`` and, when present, ``PREFIX_loadtest.json`` (written by our
locustfile: the step plan and request mix) into one report dict (``build_report``). ``loadtest.render`` turns that
dict into ``capacity_report.{md,html,json}`` and two PNG plots (``make_report`` does both).

How the numbers are made (all from the CSVs, nothing re-measured):

- A *step* is a run of history rows with the same user count. Counts (requests, failures) cover the whole step:
  the difference of the cumulative ``Total Request Count`` between the step's last row and the previous step's
  last row, summed over the HTTP entries (the ``LLM`` custom entries are not requests). So the steps' requests
  add up to the run's HTTP request total in ``_stats.csv``.
- Rates (requests/s, output tokens/s) and percentiles cover the step's *measurement window*: its last ``window_s``
  seconds (the locustfile sets Locust's sliding percentile window to the same ``step_time - settle``); with
  ``--processes`` the rate window's ends snap to the workers' report arrivals (``_rate_window``). Percentiles are
  Locust's own, from the step's last history row: latency from the ``LLM e2e_latency_ms`` entry (successful requests
  of every endpoint; without our entries, the ``Aggregated`` row), TTFT from ``LLM ttft_ms``. Output tokens = count
  x mean of the ``LLM output_tokens`` entry, differenced.
- A step *meets the SLO* when its p95 latency <= ``slo_p95_ms``, its failure rate <= ``max_failure_rate`` and
  (if given) its TTFT p95 <= ``slo_ttft_p95_ms``. *Capacity* = the largest user count such that every step
  up to it meets the SLO (the first failing level ends the search, so a lucky higher level never counts).
  The *planning point* keeps ``headroom`` (default 20%) spare: ``floor(capacity * (1 - headroom))`` users and
  ``(1 - headroom) x`` the requests/s measured at capacity.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest.settings import SLO
from verl.errors import DataError, MissingDependencyError

LLM = "LLM"  # request type of the locustfile's custom entries
LATENCY_ENTRY, TTFT_ENTRY, TOKENS_ENTRY = "e2e_latency_ms", "ttft_ms", "output_tokens"
SESSION_ENTRY, SESSION_TURNS_ENTRY = "session_latency_ms", "session_turns"  # AgentUser: one per finished session
# 1/0 per answer and per session (their means are shares): answers cut at max_tokens (finish_reason "length"), one
# entry per endpoint ("answers_cut_at_max_tokens /v1/completions"), and agent sessions that made no tool call.
CUT_ENTRY, NO_TOOL_ENTRY = "answers_cut_at_max_tokens", "sessions_without_tool_call"
# A share at or above this gets a warning line: the run measured cut answers or sessions that were no agent's.
WARN_SHARE = 0.25
VARIANT_MARK = " @"  # RouteUser names entries "<endpoint> @<model>": requests a route's variant answered
STATS_COLUMNS = ("Type", "Name", "Request Count", "Failure Count", "Median Response Time", "Average Response Time",
                 "Min Response Time", "Max Response Time", "Requests/s", "50%", "95%", "99%")
HISTORY_COLUMNS = ("Timestamp", "User Count", "Type", "Name", "50%", "95%", "99%", "Total Request Count",
                   "Total Failure Count", "Total Average Response Time")
FAILURES_COLUMNS = ("Method", "Name", "Error", "Occurrences")
REPORT_STEM = "capacity_report"
PLOTS = {"latency": "latency_vs_users.png", "throughput": "throughput_vs_users.png"}


@dataclass(frozen=True)
class FleetPlan:
    """How many replicas served the test, and the load to plan replicas for (the per-replica planning line)."""

    replicas: int = 1
    target_rps: float | None = None

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise DataError(f"the number of replicas that served the test must be >= 1 (got {self.replicas})")
        if self.target_rps is not None and self.target_rps <= 0:
            raise DataError(f"the target load must be > 0 requests/s (got {self.target_rps})")


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


class _Row:
    type: str
    name: str

    @property
    def is_http(self) -> bool:
        """An HTTP endpoint row: not Locust's ``Aggregated`` total and not one of our ``LLM`` custom entries."""
        return self.name != "Aggregated" and self.type != LLM


@dataclass
class Entry(_Row):
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


@dataclass
class HistoryRow(_Row):
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
    return LocustRun(prefix, read_stats(Path(f"{prefix}_stats.csv")), read_history(Path(f"{prefix}_stats_history.csv")),
                     read_failures(Path(f"{prefix}_failures.csv")), info)


# ---------------------------------------------------------------- steps and capacity


def segment_steps(snapshots: list[Snapshot], levels: list[int] | None = None) -> list[list[Snapshot]]:
    """Runs of consecutive snapshots with the same (non-zero) user count, in time order.

    With the plan's ``levels`` (our locustfile records them), runs are matched to the levels in order and the others
    dropped: with several Locust processes a level's users start on each worker in turn, and a history row can catch
    the count in between (1 user on the way to 2). A dropped run's requests count toward the next level (each level
    counts from the end of the one before)."""
    runs: list[list[Snapshot]] = []
    for snap in snapshots:
        if snap.users <= 0:
            continue
        if runs and runs[-1][-1].users == snap.users:
            runs[-1].append(snap)
        else:
            runs.append([snap])
    if not levels:
        return runs
    steps, next_level = [], 0
    for run in runs:
        ahead = [i for i in range(next_level, len(levels)) if levels[i] == run[0].users]
        if ahead:  # this level (or a later one, when Locust never showed the levels between)
            steps.append(run)
            next_level = ahead[0] + 1
        elif steps and steps[-1][0].users == run[0].users:
            steps[-1].extend(run)
    return steps


def transient_snapshots(snapshots: list[Snapshot], steps: list[list[Snapshot]]) -> int:
    """History rows with users that belong to no step (users spawning between levels)."""
    kept = {id(snap) for step in steps for snap in step}
    return sum(1 for snap in snapshots if snap.users > 0 and id(snap) not in kept)


def _rate(delta: float, seconds: float) -> float | None:
    return delta / seconds if seconds > 0 else None


def _pct(row: HistoryRow | None) -> tuple[float | None, float | None, float | None]:
    """A row's windowed p50/p95/p99; 0 means "not computed" (Locust writes 0 when its sliding window found no
    snapshot to diff against, e.g. after a long stall) -- no latency here is really 0 ms -- so it becomes None."""
    if row is None:
        return None, None, None
    return tuple(v if v else None for v in (row.p50, row.p95, row.p99))  # type: ignore[return-value]


def window_pct(step: list[Snapshot], entry: Any, window_s: int) -> tuple[float | None, float | None, float | None]:
    """The windowed p50/p95/p99 of ``entry(snapshot)`` at the step's end: from its last row, or, where Locust
    wrote 0 there ("not computed": with worker processes the master's window often finds no snapshot in the
    second after a report), from the latest earlier row of the step within its measuring window. A CI run's first
    level lost its p95 that way (0 at the level's last row, 76 ms a second before) and was judged "no latency"."""
    end = step[-1].timestamp
    for snap in reversed(step):
        if snap.timestamp < end - window_s:
            break
        values = _pct(entry(snap))
        if values[1] is not None:
            return values
    return None, None, None


def _rate_window(rows: list[Snapshot], window_s: int, bursts: bool) -> tuple[Snapshot | None, Snapshot]:
    """The two rows a step's rates are measured between: ``rows`` are the previous step's last row (if any) and the
    step's rows. Base: the last row at least ``window_s`` before the end (else the first). With worker processes
    (``bursts``) the master's totals move only when a worker report arrives (every few seconds), so both ends snap
    to report arrivals, the rows where the HTTP total changed: the window then spans whole report intervals, and a
    window that fell between two reports no longer reads 0 requests/s."""
    points = rows
    if bursts:
        points = [r for i, r in enumerate(rows) if i == 0 or r.http_total() != rows[i - 1].http_total()]
    end = points[-1]
    base = points[0] if len(points) > 1 else None
    for row in points[:-1]:
        if row.timestamp <= end.timestamp - window_s:
            base = row
    return base, end


def step_metrics(steps: list[list[Snapshot]], snapshots: list[Snapshot], window_s: int,
                 bursts: bool = False) -> list[dict]:
    """Per-step numbers (see the module docstring for what each covers); ``bursts``: the run had worker
    processes, whose reports reach the master's totals every few seconds (see ``_rate_window``)."""
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
        base, rate_end = _rate_window(([previous] if previous else []) + step, window_s, bursts)
        seconds = rate_end.timestamp - base.timestamp if base else 0
        base_requests = base.http_total() if base else 0
        base_tokens = base.llm_sum(TOKENS_ENTRY) if base else 0.0
        p50, p95, p99 = window_pct(step, lambda snap: snap.llm(LATENCY_ENTRY) if has_llm else snap.aggregated(),
                                   window_s)
        ttft50, ttft95, _ = window_pct(step, lambda snap: snap.llm(TTFT_ENTRY), window_s)
        session50, session95, _ = window_pct(step, lambda snap: snap.llm(SESSION_ENTRY), window_s)
        sessions_end = rate_end.llm(SESSION_ENTRY).total_requests if rate_end.llm(SESSION_ENTRY) else 0
        sessions_base = base.llm(SESSION_ENTRY).total_requests if base and base.llm(SESSION_ENTRY) else 0
        out.append({
            "index": index,
            "users": end.users,
            "start": step[0].timestamp,
            "end": end.timestamp,
            "window_s": seconds,
            "requests": requests,
            "failures": failures,
            "failure_rate": failures / requests if requests else None,
            "requests_per_s": _rate(rate_end.http_total() - base_requests, seconds),
            "latency_p50_ms": p50,
            "latency_p95_ms": p95,
            "latency_p99_ms": p99,
            "ttft_p50_ms": ttft50,
            "ttft_p95_ms": ttft95,
            "output_tokens_per_s": (_rate(rate_end.llm_sum(TOKENS_ENTRY) - base_tokens, seconds)
                                    if end.llm(TOKENS_ENTRY) else None),
            # Agent sessions (AgentUser): finished sessions per second and their latency over the window.
            "sessions_per_s": _rate(sessions_end - sessions_base, seconds) if end.llm(SESSION_ENTRY) else None,
            "session_latency_p50_ms": session50,
            "session_latency_p95_ms": session95,
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
    if slo.session_p95_ms is not None:
        session = step["session_latency_p95_ms"]
        if session is None:
            reasons.append("no session latency p95 (no agent session finished in the window)")
        elif session > slo.session_p95_ms:
            reasons.append(f"session p95 {session:g} ms > {slo.session_p95_ms:g} ms")
    if slo.ttft_p95_ms is not None:
        ttft = step["ttft_p95_ms"]
        if ttft is None:
            reasons.append("no TTFT p95 (no streamed requests)")
        elif ttft > slo.ttft_p95_ms:
            reasons.append(f"TTFT p95 {ttft:g} ms > {slo.ttft_p95_ms:g} ms")
    return reasons


def capacity(steps: list[dict], slo: SLO, plan: FleetPlan | None = None) -> dict[str, Any]:
    """Largest user count with every level up to it within the SLO, the planning point below it, and per replica:
    the planning load one replica carries (the measured one over ``plan.replicas``) and the replicas a target load
    needs at that rate (linear scaling assumed: the report says so)."""
    plan = plan or FleetPlan()
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
    result.update(replicas_tested=plan.replicas, target_rps=plan.target_rps, per_replica_planning_rps=None,
                  replicas_for_target=None)
    if max_users is None:
        result.update(planning_users=0, rps_at_max=None, planning_rps=None, sessions_per_s_at_max=None,
                      planning_sessions_per_s=None)
        return result
    rates = [s["requests_per_s"] for s in by_level[max_users] if s["requests_per_s"] is not None]
    rps = sum(rates) / len(rates) if rates else None
    session_rates = [s["sessions_per_s"] for s in by_level[max_users] if s.get("sessions_per_s") is not None]
    sessions = sum(session_rates) / len(session_rates) if session_rates else None
    result.update(sessions_per_s_at_max=sessions,
                  planning_sessions_per_s=sessions * fraction if sessions is not None else None)
    # The small epsilon keeps 5 * 0.8 = 4.000000000000001 -> 4 and 10 * 0.8 = 8 exact after float rounding.
    result.update(planning_users=math.floor(max_users * fraction + 1e-9), rps_at_max=rps,
                  planning_rps=rps * fraction if rps is not None else None)
    if rps:
        per_replica = rps * fraction / plan.replicas
        result["per_replica_planning_rps"] = per_replica
        if plan.target_rps is not None:
            # The epsilon: 36 / 12 = 3.0000000000000004 must plan 3 replicas, not 4.
            result["replicas_for_target"] = max(1, math.ceil(plan.target_rps / per_replica - 1e-9))
    return result


def build_report(prefix: str | Path, slo: SLO | None = None, server_metrics: str | Path | None = None,
                 plan: FleetPlan | None = None, server_baseline: str | Path | None = None) -> dict[str, Any]:
    """Everything the report says, as plain data (``capacity_report.json``).

    ``server_metrics``: a saved ``/metrics`` page of the service after the run (``verl loadtest`` saves one), shown
    beside Locust's numbers as a cross-check; ``server_baseline``: the page before the run (a service that was
    already up, ``verl loadtest --url``), so the cross-check counts this run only. ``plan``: the replicas that
    served the test and a target load (the per-replica planning line).
    """
    slo = slo or SLO()
    run = load_run(prefix)
    server = read_server_metrics(server_metrics, server_baseline) if server_metrics is not None else None
    info = run.info or {}
    window = (info.get("plan") or {}).get("window_s") or info.get("percentile_window_s")
    # Without our locustfile's info, assume Locust's default percentile window (10 s).
    window_s = int(window) if window else 10
    levels = (info.get("plan") or {}).get("levels")
    segments = segment_steps(run.snapshots, levels)
    steps = step_metrics(segments, run.snapshots, window_s, bursts=int(info.get("processes") or 1) > 1)
    for step in steps:
        step["why_not"] = judge_step(step, slo)
        step["meets_slo"] = not step["why_not"]
    http = [e for e in run.entries if e.is_http]
    aggregated = next(e for e in run.entries if e.name == "Aggregated")
    final = run.snapshots[-1]
    active = [s.timestamp for s in run.snapshots if s.rows and s.users > 0]
    totals = {"http_requests": sum(e.requests for e in http), "http_failures": sum(e.failures for e in http),
              "locust_aggregated_requests": aggregated.requests,
              "llm_entries": sum(e.requests for e in run.entries if e.type == LLM),
              "history_http_requests": final.http_total(), "steps_requests": sum(s["requests"] for s in steps),
              "output_tokens": round(final.llm_sum(TOKENS_ENTRY)),
              "duration_s": (active[-1] - active[0]) if active else 0}
    notes = []
    transient = transient_snapshots(run.snapshots, segments)
    if transient:
        notes.append(f"{transient} history row(s) caught users spawning between levels (a count not in the plan "
                     f"{levels}); their requests count toward the next level")
    if totals["history_http_requests"] != totals["http_requests"]:
        notes.append(f"_stats_history.csv's last row counts {totals['history_http_requests']} HTTP requests but "
                     f"_stats.csv {totals['http_requests']} (files from different moments?)")
    has_llm = any(s.llm(LATENCY_ENTRY) for s in run.snapshots)
    if not has_llm:
        notes.append("no LLM custom entries (not our locustfile?): latency percentiles come from the Aggregated "
                     "row; TTFT and tokens/s are not available")
    if window is None:
        notes.append(f"no {run.prefix.name}_loadtest.json: assumed Locust's default 10 s percentile window")

    answers = answer_quality(run.entries)
    warnings = quality_warnings(answers, info)

    return {
        "source": {"prefix": str(run.prefix), "run": run.info},
        "slo": {"p95_ms": slo.p95_ms, "max_failure_rate": slo.max_failure_rate, "ttft_p95_ms": slo.ttft_p95_ms,
                "session_p95_ms": slo.session_p95_ms,
                "latency_metric": f"{LLM} {LATENCY_ENTRY}" if has_llm else "Aggregated"},
        "window_s": window_s,
        "totals": totals,
        "steps": steps,
        "capacity": capacity(steps, slo, plan),
        "endpoints": [entry_row(e) for e in http],
        "variants": variants(run.entries),
        "llm": [entry_row(e) for e in run.entries if e.type == LLM],
        "failures": run.failures,
        "server": server,
        "answers": answers,
        "warnings": warnings,
        "notes": notes,
    }


def read_server_metrics(server_metrics: str | Path, server_baseline: str | Path | None) -> dict[str, Any]:
    """The service's saved ``/metrics`` page after the run, less the page before it when given (``build_report``)."""
    path = Path(server_metrics)
    if not path.is_file():
        raise DataError(f"server metrics file '{path}' does not exist (save the service's /metrics page)")
    try:
        baseline = Path(server_baseline).read_text() if server_baseline is not None else None
        return parse_server_metrics(path.read_text(), baseline)
    except ValueError as exc:
        raise DataError(f"'{path}' is not Prometheus text format ({exc})") from None


def entry_row(e: Entry) -> dict[str, Any]:
    """One Locust entry as the report's JSON has it."""
    return {"type": e.type, "name": e.name, "requests": e.requests, "failures": e.failures, "mean": e.mean_ms,
            "p50": e.p50, "p95": e.p95, "p99": e.p99, "max": e.max_ms, "rps": e.rps}


def answer_quality(entries: list[Entry]) -> dict[str, Any]:
    """What the answers were, beside how fast: per endpoint the share cut at ``max_tokens``
    (``cut_at_max_tokens: {endpoint: {share, answers}}``), and for agent users the share of sessions with no tool
    call (``sessions_without_tool_call: {share, sessions}``, None without agent sessions)."""
    cut = {e.name[len(CUT_ENTRY) + 1:]: {"share": e.mean_ms, "answers": e.requests}
           for e in entries if e.type == LLM and e.name.startswith(CUT_ENTRY + " ") and e.requests}
    no_tool = next((e for e in entries if e.type == LLM and e.name == NO_TOOL_ENTRY and e.requests), None)
    return {"cut_at_max_tokens": cut,
            "sessions_without_tool_call": None if no_tool is None else {"share": no_tool.mean_ms,
                                                                        "sessions": no_tool.requests}}


def quality_warnings(answers: dict[str, Any], info: dict[str, Any]) -> list[str]:
    """A line for each share at or above ``WARN_SHARE``, with the fix."""
    budget = info.get("max_tokens")
    flag = f"--max-tokens {budget}" if budget else "--max-tokens"
    lines = []
    for endpoint, cut in answers["cut_at_max_tokens"].items():
        if cut["share"] is not None and cut["share"] >= WARN_SHARE:
            lines.append(f"{cut['share']:.0%} of the {cut['answers']} answers of {endpoint} were cut at max_tokens "
                         f"(finish_reason length): the latencies measure truncated answers; raise {flag} to what "
                         "the model's answers need")
    sessions = answers["sessions_without_tool_call"]
    if sessions and sessions["share"] is not None and sessions["share"] >= WARN_SHARE:
        lines.append(f"{sessions['share']:.0%} of the {sessions['sessions']} agent sessions made no tool call: they "
                     "measured single answers, not agent sessions (answers cut before the call closed? see the cut "
                     f"share above; raise {flag}), or the model served does not call tools")
    return lines


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (95% by default)."""
    if n == 0:
        return (float("nan"), float("nan"))
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def variants(entries: list[Entry]) -> list[dict[str, Any]]:
    """Per variant of a route (RouteUser's ``... @model`` entries): requests, share of the route's answered
    requests with its 95% Wilson interval, failures, and e2e latency from the variant's own LLM entry."""
    counts: dict[str, list[int]] = {}
    for e in entries:
        if e.is_http and VARIANT_MARK in e.name:
            c = counts.setdefault(e.name.rsplit(VARIANT_MARK, 1)[1], [0, 0])
            c[0] += e.requests
            c[1] += e.failures
    total = sum(c[0] for c in counts.values())
    latency = {e.name.rsplit(VARIANT_MARK, 1)[1]: e for e in entries
               if e.type == LLM and e.name.startswith(LATENCY_ENTRY + VARIANT_MARK)}
    rows = []
    for name, (requests, failures) in sorted(counts.items()):
        low, high = wilson_interval(requests, total)
        lat = latency.get(name)
        rows.append({"variant": name, "requests": requests, "failures": failures, "share": requests / total,
                     "share_ci": [low, high], "e2e_mean_ms": lat.mean_ms if lat else None,
                     "e2e_p50_ms": lat.p50 if lat else None, "e2e_p95_ms": lat.p95 if lat else None})
    return rows


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

"""``verl loadtest-report --compare A B``: two open-loop runs (``open_loop.json``, from ``verl loadtest --rate``)
side by side, paired by offered rate: B minus A and B / A for throughput, goodput, rejections and the latency
percentiles, in ``vllm bench serve``'s field names. Rates only one run offered are listed, not paired."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loadtest.open_run import RESULTS_FILE
from loadtest.render import fmt
from verl.errors import DataError
from verl.utils.fs import atomic_write_json, atomic_write_text, ensure_writable_dir

# Compared fields: (name, higher is better?) — None: no better direction (it is context, not a verdict).
FIELDS = (("request_throughput", True), ("request_goodput", True), ("output_throughput", True),
          ("rejection_rate", False), ("median_ttft_ms", False), ("p99_ttft_ms", False), ("median_tpot_ms", False),
          ("p99_tpot_ms", False), ("p99_itl_ms", False), ("median_e2el_ms", False), ("p95_e2el_ms", False),
          ("p99_e2el_ms", False), ("schedule_lag_p99_ms", None))


def load_open_results(path: str | Path) -> dict[str, Any]:
    """An open-loop result file, or the ``--out`` directory holding one."""
    file = Path(path)
    file = file / RESULTS_FILE if file.is_dir() else file
    if not file.is_file():
        raise DataError(f"no {RESULTS_FILE} at '{path}': give the --out directory of `verl loadtest --rate ...` "
                        "or its open_loop.json (a closed-loop capacity run has no rates to pair)")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise DataError(f"{file} is not valid JSON (line {exc.lineno})") from None
    if data.get("mode") != "open-loop" or not isinstance(data.get("runs"), list):
        raise DataError(f"{file} is not an open-loop result (no mode 'open-loop' with runs)")
    return data


def compare_open(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Rows paired by offered rate: ``{rate, fields: {name: {a, b, diff, ratio, better}}}``."""
    by_rate_a = {run["request_rate"]: run for run in a["runs"]}
    by_rate_b = {run["request_rate"]: run for run in b["runs"]}
    rows = []
    for rate in sorted(set(by_rate_a) & set(by_rate_b)):
        ra, rb = by_rate_a[rate], by_rate_b[rate]
        fields = {}
        for name, higher in FIELDS:
            va, vb = ra.get(name), rb.get(name)
            diff = None if va is None or vb is None else vb - va
            ratio = vb / va if diff is not None and va else None
            better = None if diff is None or higher is None or diff == 0 else (diff > 0) == higher
            fields[name] = {"a": va, "b": vb, "diff": diff, "ratio": ratio, "b_better": better}
        rows.append({"rate": rate, "fields": fields,
                     "refused": bool(ra.get("generator_bound") or rb.get("generator_bound"))})
    settings = {k: (a.get(k), b.get(k)) for k in ("model", "max_tokens", "arrival", "burstiness", "duration_s", "seed",
                                                   "goodput_slo_ms") if a.get(k) != b.get(k)}
    return {"rows": rows, "only_a": sorted(set(by_rate_a) - set(by_rate_b)),
            "only_b": sorted(set(by_rate_b) - set(by_rate_a)), "settings_differ": settings}


def compare_line(row: dict[str, Any]) -> str:
    """One console line per paired rate."""
    f = row["fields"]
    return (f"{row['rate']:g} req/s offered: throughput {fmt(f['request_throughput']['a'])} -> "
            f"{fmt(f['request_throughput']['b'])} req/s, goodput {fmt(f['request_goodput']['a'])} -> "
            f"{fmt(f['request_goodput']['b'])}, e2el p99 {fmt(f['p99_e2el_ms']['a'])} -> "
            f"{fmt(f['p99_e2el_ms']['b'])} ms")


def render_compare(report: dict[str, Any], a_name: str, b_name: str) -> str:
    lines = [f"# Open-loop comparison: B = `{b_name}` against A = `{a_name}`", ""]
    if report["settings_differ"]:
        lines += ["Settings that differ (A, B): " + "; ".join(f"{k} {v[0]!r} vs {v[1]!r}"
                                                            for k, v in report["settings_differ"].items()), ""]
    for row in report["rows"]:
        lines += [f"## {row['rate']:g} requests/s offered"
                  + (" (a side's generator fell behind: read with care)" if row["refused"] else ""), "",
                  "| metric | A | B | B - A | B / A |", "|---|---|---|---|---|"]
        for name, f in row["fields"].items():
            mark = "" if f["b_better"] is None else (" (better)" if f["b_better"] else " (worse)")
            lines.append(f"| {name} | {fmt(f['a'])} | {fmt(f['b'])} | {fmt(f['diff'])}{mark} | "
                         f"{fmt(f['ratio'])} |")
        lines.append("")
    for side, rates in (("A", report["only_a"]), ("B", report["only_b"])):
        if rates:
            lines.append(f"Only {side} offered {', '.join(f'{r:g}' for r in rates)} requests/s (not paired).")
    return "\n".join(lines) + "\n"


def compare_runs(path_a: str | Path, path_b: str | Path, out: str | Path) -> tuple[dict[str, Any], dict[str, Path]]:
    a, b = load_open_results(path_a), load_open_results(path_b)
    report = compare_open(a, b)
    if not report["rows"]:
        raise DataError(f"the two runs share no offered rate (A: {[r['request_rate'] for r in a['runs']]}, B: "
                        f"{[r['request_rate'] for r in b['runs']]}); run both with the same --rate")
    out_dir = ensure_writable_dir(out, "the comparison dir (--out)")
    paths = {"json": atomic_write_json(out_dir / "open_loop_compare.json", report),
             "markdown": atomic_write_text(out_dir / "open_loop_compare.md", render_compare(report, str(path_a),
                                                                                          str(path_b)))}
    return report, paths

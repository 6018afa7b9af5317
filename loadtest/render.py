"""The capacity report's rendering: Markdown, HTML (``templates/capacity_report.html``), PNG plots and the
terminal summary, from the report dict ``loadtest.report.build_report`` makes. Nothing here reads Locust's files or
computes a number: every figure comes from the dict.
"""

from __future__ import annotations

import html
import json
import math
from importlib import resources
from pathlib import Path
from string import Template
from typing import Any

from loadtest.report import LATENCY_ENTRY, PLOTS, REPORT_STEM, TTFT_ENTRY, FleetPlan, build_report
from loadtest.settings import SLO
from verl.utils.fs import atomic_path, atomic_write_json, atomic_write_text, ensure_writable_dir


def fmt(value: Any, digits: int = 3) -> str:
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
    if slo.get("session_p95_ms") is not None:
        rule += f" and agent-session p95 <= {slo['session_p95_ms']:g} ms"
    lines = ["Mode: closed loop (each user waits for its answer before the next request; capacity in users; "
             "`verl loadtest --rate` measures an open loop in requests/s).",
             f"SLO: {rule} (latency = {slo['latency_metric']}, over each step's last {report['window_s']} s)."]
    if cap["max_users_within_slo"] is None:
        first = report["steps"][0]["why_not"] if report["steps"] else ["no steps"]
        lines.append(f"**No tested level meets the SLO** (lowest level: {'; '.join(first)}).")
    else:
        share = 1 - cap["headroom"]
        sessions = cap.get("sessions_per_s_at_max")
        lines.append(f"**Capacity: {cap['max_users_within_slo']} users** within the SLO "
                     f"({fmt(cap['rps_at_max'])} requests/s"
                     + (f", {fmt(sessions)} agent sessions/s" if sessions is not None else "") + ").")
        planning = cap["planning_users"]
        tested = cap.get("replicas_tested", 1)
        scope = "per replica" if tested == 1 else f"on the {tested} replicas tested"
        lines.append(f"**Plan for {planning} users** {scope} ({share:.0%} of capacity, {cap['headroom']:.0%} "
                     f"headroom; about {fmt(cap['planning_rps'])} requests/s)"
                     + (" - below one user: the replica has no headroom at 1 user." if planning < 1 else "."))
        per_replica = cap.get("per_replica_planning_rps")
        if per_replica:
            line = (f"**Per replica: about {fmt(per_replica)} requests/s** at the planning point "
                    f"(measured on {tested} replica{'s' if tested > 1 else ''})")
            if cap.get("replicas_for_target") is not None:
                line += (f"; **{cap['target_rps']:g} requests/s needs {cap['replicas_for_target']} replica"
                         f"{'s' if cap['replicas_for_target'] > 1 else ''}** if throughput scales linearly with "
                         "replicas (measure it: benchmarks/fleet_scaling.py).")
            else:
                line += "; --target-rps gives the replicas a target load needs."
            lines.append(line)
        if cap["first_failing_users"] is not None:
            why = next(s["why_not"] for s in report["steps"] if s["users"] == cap["first_failing_users"]
                       and s["why_not"])
            lines.append(f"The next level, {cap['first_failing_users']} users, misses it: {'; '.join(why)}.")
        else:
            lines.append("Every tested level met the SLO: capacity is at least this; test higher levels to find "
                         "the limit.")
    lines.extend(f"**Warning: {w}.**" for w in report.get("warnings", []))
    lines.append(answers_line(report.get("answers")))
    lines.append(f"{totals['http_requests']} HTTP requests ({totals['http_failures']} failed) and "
                 f"{totals['output_tokens']} output tokens in {totals['duration_s']} s. Locust's Aggregated row "
                 f"counts {totals['locust_aggregated_requests']}: the HTTP requests plus "
                 f"{totals['llm_entries']} LLM custom entries.")
    return lines


def answers_line(answers: dict[str, Any] | None) -> str:
    """The answers themselves: the share cut at max_tokens per endpoint, and agent sessions without a tool call."""
    if not answers or not answers["cut_at_max_tokens"]:
        return "Answers: no finish reasons recorded (not our locustfile, or no answer succeeded)."
    parts = [f"{cut['share']:.0%} of {cut['answers']} on {endpoint}"
             for endpoint, cut in answers["cut_at_max_tokens"].items()]
    line = f"Answers cut at max_tokens: {', '.join(parts)}."
    sessions = answers["sessions_without_tool_call"]
    if sessions:
        line += f" Agent sessions without a tool call: {sessions['share']:.0%} of {sessions['sessions']}."
    return line


STEP_HEADERS = ["users", "requests", "requests/s", "failure rate", "p50 ms", "p95 ms", "p99 ms", "TTFT p50 ms",
                "TTFT p95 ms", "output tokens/s", "meets SLO"]


SESSION_HEADERS = ["sessions/s", "session p50 ms", "session p95 ms"]


def _has_sessions(report: dict[str, Any]) -> bool:
    return any(step.get("sessions_per_s") is not None for step in report["steps"])


def _session_cells(step: dict) -> list[str]:
    return [fmt(step.get("sessions_per_s")), fmt(step.get("session_latency_p50_ms")),
            fmt(step.get("session_latency_p95_ms"))]


def _step_row(step: dict) -> list[str]:
    rate = step["failure_rate"]
    return [fmt(step["users"]), fmt(step["requests"]), fmt(step["requests_per_s"]),
            "-" if rate is None else f"{rate:.2%}", fmt(step["latency_p50_ms"]), fmt(step["latency_p95_ms"]),
            fmt(step["latency_p99_ms"]), fmt(step["ttft_p50_ms"]), fmt(step["ttft_p95_ms"]),
            fmt(step["output_tokens_per_s"]), "yes" if step["meets_slo"] else "no: " + "; ".join(step["why_not"])]


ENTRY_HEADERS = ["type", "name", "count", "failures", "mean", "p50", "p95", "p99", "max"]


def _entry_row(e: dict) -> list[str]:
    return [e["type"], e["name"], fmt(e["requests"]), fmt(e["failures"]), fmt(e["mean"]), fmt(e["p50"]),
            fmt(e["p95"]), fmt(e["p99"]), fmt(e["max"])]


def _blocks(report: dict[str, Any], plots: dict[str, Path]) -> list[tuple]:
    blocks: list[tuple] = [("p", line) for line in _summary_lines(report)]
    blocks.append(("h", "Steps"))
    blocks.append(("p", f"Counts cover the whole step; rates and percentiles its last {report['window_s']} s "
                        "(after the users settled)."))
    if _has_sessions(report):  # agent runs: the session columns before the verdict
        blocks.append(("table", [*STEP_HEADERS[:-1], *SESSION_HEADERS, STEP_HEADERS[-1]],
                       [[*_step_row(s)[:-1], *_session_cells(s), _step_row(s)[-1]] for s in report["steps"]]))
    else:
        blocks.append(("table", STEP_HEADERS, [_step_row(s) for s in report["steps"]]))
    for key, title in (("latency", "Latency vs users"), ("throughput", "Throughput vs users")):
        if key in plots:
            blocks.append(("img", plots[key].name, title))
    blocks.append(("h", "Endpoints (whole run, milliseconds)"))
    blocks.append(("table", ENTRY_HEADERS, [_entry_row(e) for e in report["endpoints"]]))
    if report.get("variants"):
        blocks.append(("h", "Variants of the route (whole run)"))
        blocks.append(("p", "Which model answered (the X-Verl-Model header): its share of the route's requests "
                            "with a 95% Wilson interval, and its own end-to-end latency (ms)."))
        blocks.append(("table", ["variant", "requests", "failures", "share", "share 95% CI", "e2e mean", "e2e p50",
                                 "e2e p95"],
                       [[v["variant"], fmt(v["requests"]), fmt(v["failures"]), f"{v['share']:.1%}",
                         f"[{v['share_ci'][0]:.1%}, {v['share_ci'][1]:.1%}]", fmt(v["e2e_mean_ms"]),
                         fmt(v["e2e_p50_ms"]), fmt(v["e2e_p95_ms"])] for v in report["variants"]]))
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
            rows.append([label, fmt(svc["count"]), fmt(svc["mean_ms"]), fmt(svc["p50_ms"]), fmt(svc["p95_ms"]),
                         fmt(client.get("requests")), fmt(client.get("mean")), fmt(client.get("p50")),
                         fmt(client.get("p95"))])
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


def _inline_html(text: str) -> str:
    # The only Markdown our paragraphs use is **bold**.
    parts = html.escape(text).split("**")
    return "".join(f"<b>{p}</b>" if i % 2 else p for i, p in enumerate(parts))


def render_html(report: dict[str, Any], plots: dict[str, Path]) -> str:
    """The blocks as HTML inside the page template (its styles and frame live in the template file)."""
    parts = []
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
    template = resources.files("loadtest").joinpath("templates", "capacity_report.html").read_text()
    return Template(template).substitute(body="\n".join(parts))


def plot_report(report: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    """Latency-vs-users and throughput-vs-users PNGs (written atomically); no steps, no plots."""
    steps = report["steps"]
    if not steps:
        return {}
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

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
    out_dir = ensure_writable_dir(out_dir, "the report dir (--out)")
    images = plot_report(report, out_dir) if plots else {}
    paths = {"json": atomic_write_json(out_dir / f"{REPORT_STEM}.json", report),
             "markdown": atomic_write_text(out_dir / f"{REPORT_STEM}.md", render_markdown(report, images)),
             "html": atomic_write_text(out_dir / f"{REPORT_STEM}.html", render_html(report, images))}
    return {**paths, **images}


def make_report(prefix: str | Path, out_dir: str | Path, slo: SLO | None = None, plots: bool = True,
                server_metrics: str | Path | None = None, plan: FleetPlan | None = None,
                server_baseline: str | Path | None = None) -> tuple[dict[str, Any], dict[str, Path]]:
    """Read the CSVs at ``prefix``, write the report into ``out_dir``; returns the report and its files."""
    report = build_report(prefix, slo, server_metrics, plan, server_baseline)
    return report, write_report(report, out_dir, plots)


def summary_text(report: dict[str, Any]) -> str:
    """The report's headline as plain text (for the terminal)."""
    return "\n".join(line.replace("**", "") for line in _summary_lines(report))

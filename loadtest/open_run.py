"""``verl loadtest --rate R[,R2,...]``: the service up (or ``--url``), one open-loop Locust run per rate
(``OpenLoopUser``), and a report of each rate in ``vllm bench serve``'s terms (loadtest/open_loop.py).

Each rate is its own headless Locust process with the same schedule seed, so two runs of the command send the same
schedule; results go to ``open_loop.json`` (one entry per rate, vLLM's field names), ``open_loop.md`` and a plot of
latency against achieved throughput with the offered rates marked.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest.open_loop import (
    DEFAULT_PERCENTILES,
    MAX_LAG_P99_MS,
    REPLAY_SUFFIX,
    arrival_offsets,
    merge_worker_records,
    read_records,
    replay_schedule,
    summarise,
)
from loadtest.render import fmt
from loadtest.run import LOCUST_CONF, LOCUSTFILE, LoadTestError, _service, run_locust
from loadtest.settings import AGENT_PROMPTS, LoadTestConfig
from verl.errors import ConfigError
from verl.utils.fs import atomic_write_json, atomic_write_text, ensure_writable_dir

RESULTS_FILE, REPORT_FILE, PLOT_FILE = "open_loop.json", "open_loop.md", "open_loop_latency.png"


@dataclass
class OpenLoopConfig:
    """The schedule (``rates`` in requests/s, each held ``duration_s``), the per-request SLOs of goodput (ms, vLLM's
    names: ttft, tpot, itl, e2el) and the service (``service``: model, engine, ``--url``, ``--max-tokens``)."""

    service: LoadTestConfig
    rates: list[float]
    duration_s: float = 30.0
    arrival: str = "poisson"
    burstiness: float = 1.0
    seed: int = 0
    slo: dict[str, float] = field(default_factory=dict)
    max_lag_p99_ms: float = MAX_LAG_P99_MS
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    # --replay: the schedule built from the service's records (open_loop.replay_schedule) and what it said.
    replay: list[dict] | None = None
    replay_notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.replay is not None:
            span = max(self.replay[-1]["offset_s"], 1e-3)
            self.rates, self.duration_s, self.arrival = [len(self.replay) / span], span, "replay"
        if not self.rates:
            raise ConfigError("--rate needs at least one requests/s value")
        for rate in self.rates if self.replay is None else []:  # every schedule is valid before the service starts
            arrival_offsets(rate, self.duration_s, self.arrival, self.burstiness, self.seed)
        if self.service.user_mix not in ("mixed", "open", "agent") or self.service.user_classes:
            raise ConfigError("--rate runs open-loop streamed chats (OpenLoopUser), or agent sessions with --user-mix "
                              "agent; drop --user-mix/--user, or drop --rate for the closed-loop user steps")


@dataclass
class Sweep:
    """``--sweep``: the largest rate whose goodput stays >= ``share`` of the offered rate, found coarse-then-fine:
    the rate doubles from the start until a rate misses (or ``max_rate``), then ``fine_steps`` bisections between
    the last rate that held and the first that did not. Without ``--slo`` a request is good when it succeeds."""

    share: float = 0.95
    max_rate: float = 1024.0
    fine_steps: int = 3

    def __post_init__(self) -> None:
        if not 0 < self.share <= 1:
            raise ConfigError(f"--goodput-share must be in (0, 1] (got {self.share})")
        if self.fine_steps < 0:
            raise ConfigError(f"--fine-steps must be >= 0 (got {self.fine_steps})")


def good_share(run: dict[str, Any]) -> float:
    """Goodput as a share of the offered requests (successes when no SLO was set)."""
    if run["goodput_share_of_offered"] is not None:
        return run["goodput_share_of_offered"]
    return run["completed"] / run["num_prompts"] if run["num_prompts"] else 0.0


def holds(run: dict[str, Any], share: float) -> bool:
    return not run["generator_bound"] and good_share(run) >= share


def find_knee(probe: Any, start: float, sweep: Sweep) -> dict[str, Any]:
    """Search with ``probe(rate) -> result`` (one open-loop run); returns ``{knee_rate, stopped_by, probes}``:
    ``knee_rate`` None when even ``start`` misses; ``stopped_by`` says why the coarse phase ended (a rate that
    missed, the generator falling behind, or ``max_rate``)."""
    probes: list[dict[str, Any]] = []

    def run(rate: float) -> bool:
        result = probe(rate)
        probes.append(result)
        return holds(result, sweep.share)

    good, bad, rate, stopped_by = None, None, start, "max_rate"
    while rate <= sweep.max_rate:
        if run(rate):
            good, rate = rate, rate * 2
            continue
        bad = rate
        stopped_by = "generator" if probes[-1]["generator_bound"] else "goodput"
        break
    if good is not None and bad is not None and stopped_by == "goodput":
        for _ in range(sweep.fine_steps):
            mid = (good + bad) / 2
            if run(mid):
                good = mid
            elif probes[-1]["generator_bound"]:
                stopped_by = "generator"
                break
            else:
                bad = mid
    return {"knee_rate": good, "first_missing_rate": bad, "stopped_by": stopped_by, "share": sweep.share,
            "probes": sorted(probes, key=lambda r: r["request_rate"])}


def replay_config(source: str, speed: float) -> tuple[list[dict], list[str]]:
    """``--replay SOURCE``: the schedule from the service's records, task prompts standing in where none was kept."""
    from loadtest.prompts import DEFAULT_PROMPT_FILE, load_prompts  # noqa: PLC0415
    from verl.data.records import load_records  # noqa: PLC0415 (httpx; only for a replay)

    records = load_records(source)
    task = [p.messages for p in load_prompts(DEFAULT_PROMPT_FILE, "prompt", 10_000)]
    return replay_schedule(records, speed, task)


def open_command(url: str, csv_prefix: Path, rate: float, config: OpenLoopConfig) -> list[str]:
    """The headless Locust command line of one rate."""
    import sys  # noqa: PLC0415

    service = config.service
    command = [sys.executable, "-m", "locust", "--config", str(LOCUST_CONF), "-f", str(LOCUSTFILE), "--headless",
               "-H", url, "--csv", str(csv_prefix), "--html", f"{csv_prefix}.html", "--user-mix", "open",
               "--max-tokens", str(service.max_tokens)]
    if config.replay is not None:
        command += ["--replay-schedule", str(Path(csv_prefix).parent / REPLAY_SUFFIX)]
    else:
        command += ["--rate", f"{rate:g}", "--duration", f"{config.duration_s:g}", "--arrival", config.arrival,
                    "--burstiness", f"{config.burstiness:g}", "--schedule-seed", str(config.seed)]
    if service.processes > 1:  # each Locust worker process sends its share of the one schedule
        command += ["--processes", str(service.processes), "--open-records", str(csv_prefix)]
    if service.user_mix == "agent":  # each arrival starts a session, on questions that need the tool
        command.append("--open-sessions")
        if not any(a.startswith("--prompt-file") for a in service.extra_locust_args):
            command += ["--prompt-file", AGENT_PROMPTS]
    return [*command, *service.extra_locust_args]


def run_open_loop(config: OpenLoopConfig, echo: Any = None, sweep: Sweep | None = None
                  ) -> tuple[dict[str, Any], dict[str, Path]]:
    """Every rate (or, with ``sweep``, the knee search from the first rate) against one service; returns the
    results and the files written."""
    say = echo or (lambda _msg: None)
    out = ensure_writable_dir(config.service.out_dir, "the load test output dir (--out)")
    env = {"LOCUST_API_KEY": config.service.api_key} if config.service.api_key else None
    knee = None
    if config.replay is not None:
        atomic_write_text(out / REPLAY_SUFFIX, "".join(json.dumps(row) + "\n" for row in config.replay))
    with _service(config.service, out, say) as (url, replicas):

        def probe(rate: float) -> dict[str, Any]:
            prefix = out / (f"open_{rate:g}" if config.replay is None else "replay")
            say(f"open loop: {rate:g} requests/s, {config.arrival}"
                + (f" (burstiness {config.burstiness:g})" if config.arrival == "poisson" else "")
                + f", {config.duration_s:g} s")
            log = Path(f"{prefix}.log")
            code = run_locust(open_command(url, prefix, rate, config),
                              config.duration_s + config_timeout(config) + 90, log, env=env)
            records_file = merge_worker_records(prefix, config.service.processes)
            if code not in (0, 1) or not records_file.is_file():
                raise LoadTestError(f"the open-loop run at {rate:g} requests/s ended with code {code} and no "
                                    f"records; see {log}")
            result = summarise(read_records(records_file), rate, config.duration_s, config.slo, config.percentiles,
                               config.arrival, config.burstiness, config.max_lag_p99_ms)
            result["replicas"] = replicas
            say(rate_line(result))
            return result

        if sweep is None:
            runs = [probe(rate) for rate in config.rates]
        else:
            knee = find_knee(probe, config.rates[0], sweep)
            runs = knee.pop("probes")
    results = {"mode": "open-loop", "url": config.service.url or "local", "model": config.service.model,
               "max_tokens": config.service.max_tokens, "processes": config.service.processes,
               "arrival": config.arrival, "burstiness": config.burstiness, "duration_s": config.duration_s,
               "seed": config.seed, "goodput_slo_ms": config.slo, "percentiles": list(config.percentiles),
               "sweep": knee, "runs": runs, "replay_notes": config.replay_notes}
    return results, write_open_report(results, out)


def knee_line(results: dict[str, Any], headroom: float = 0.2) -> str | None:
    """The sweep's answer: the knee and a planning rate below it."""
    knee = results.get("sweep")
    if not knee:
        return None
    target = "goodput" if results["goodput_slo_ms"] else "successes"
    if knee["knee_rate"] is None:
        return (f"No rate held {target} >= {knee['share']:.0%} of the offered rate; the lowest tried, "
                f"{knee['first_missing_rate']:g} requests/s, missed (start lower).")
    why = {"goodput": f"{knee['first_missing_rate']:g} requests/s missed",
           "generator": "above it the generator could not keep its schedule: give Locust more cores to go on",
           "max_rate": "the sweep's --max-rate stopped it"}[knee["stopped_by"]]
    return (f"Knee: {knee['knee_rate']:g} requests/s is the largest rate whose {target} stayed >= "
            f"{knee['share']:.0%} of the offered rate ({why}); plan for {knee['knee_rate'] * (1 - headroom):.3g} "
            f"requests/s ({headroom:.0%} headroom).")


def config_timeout(config: OpenLoopConfig) -> float:
    """The longest a request may run after the schedule ends (the locustfile's --request-timeout default)."""
    args = config.service.extra_locust_args
    for i, arg in enumerate(args):
        if arg.startswith("--request-timeout"):
            value = arg.split("=", 1)[1] if "=" in arg else (args[i + 1] if i + 1 < len(args) else "60")
            return float(value)
    return 60.0


def rate_line(run: dict[str, Any]) -> str:
    """One line per rate, for the console."""
    line = (f"{run['request_rate']:g} req/s offered: {fmt(run['request_throughput'])} req/s done, "
            f"e2el p50/p99 {fmt(run['median_e2el_ms'])}/{fmt(run['p99_e2el_ms'])} ms, "
            f"TTFT p99 {fmt(run['p99_ttft_ms'])} ms, {run['failed']} failed ({run['rejected']} rejected)")
    if run["request_goodput"] is not None:
        line += f", goodput {fmt(run['request_goodput'])} req/s"
    sessions = run.get("sessions")
    if sessions:
        line += (f", sessions: {sessions['turns_mean']:.2g} turns and {sessions['tool_calls_mean']:.2g} tool calls "
                 f"each, {sessions['without_tool_call_share']:.0%} without a call")
    line += f", schedule lag p99 {fmt(run['schedule_lag_p99_ms'])} ms"
    if run["generator_bound"]:
        line += " - REFUSED: the generator fell behind its schedule"
    return line


def write_open_report(results: dict[str, Any], out: Path) -> dict[str, Path]:
    """``open_loop.json``, ``open_loop.md`` and the latency-vs-throughput plot (when matplotlib is there)."""
    paths = {"json": atomic_write_json(out / RESULTS_FILE, results)}
    plot = _plot(results, out / PLOT_FILE)
    if plot is not None:
        paths["plot"] = plot
    paths["markdown"] = atomic_write_text(out / REPORT_FILE, render_open_markdown(results, plot))
    return paths


def render_open_markdown(results: dict[str, Any], plot: Path | None) -> str:
    slo = results["goodput_slo_ms"]
    lines = ["# Open-loop load test", "",
             f"Mode: **open loop** ({results['arrival']} arrivals"
             + (f", burstiness {results['burstiness']:g}" if results["arrival"] == "poisson" else "")
             + f", {results['duration_s']:g} s per rate, schedule seed {results['seed']}): requests are sent on a "
             "schedule that does not wait for answers, and every latency counts from the scheduled send time. "
             f"Streamed chat completions, max_tokens {results['max_tokens']}."
             + (f" Sent by {results['processes']} Locust processes, each every {results['processes']}th arrival of "
                "the one schedule (the lag is each process's own)." if results.get("processes", 1) > 1 else ""), ""]
    if slo:
        limits = ", ".join(f"{k} <= {v:g} ms" for k, v in slo.items())
        lines += [f"Goodput: requests/s that succeeded and met every SLO ({limits}); a rejection (429) or a failure "
                  "counts against it.", ""]
    lines += [f"Replay: {note}." for note in results.get("replay_notes") or []]
    knee = knee_line(results)
    if knee:
        lines += [f"**{knee}**", ""]
    refused = [r for r in results["runs"] if r["generator_bound"]]
    for run in refused:
        lines += [f"**Refused: at {run['request_rate']:g} requests/s the generator itself fell behind (schedule "
                  f"lag p99 {fmt(run['schedule_lag_p99_ms'])} ms > {run['max_lag_p99_ms']:g} ms): its latencies "
                  "measure the client. Use more cores for Locust, or a lower rate.**", ""]
    head = ["offered req/s", "done req/s", "goodput req/s", "output tok/s", "failed", "rejected %",
            "TTFT p50/p99 ms", "TPOT p50/p99 ms", "ITL p50/p99 ms", "E2EL p50/p95/p99 ms", "lag p99 ms"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results["runs"]:
        rej = "-" if r["rejection_rate"] is None else f"{100 * r['rejection_rate']:.1f}"
        lines.append("| " + " | ".join([
            f"{r['request_rate']:g}", fmt(r["request_throughput"]), fmt(r["request_goodput"]),
            fmt(r["output_throughput"]), str(r["failed"]), rej,
            f"{fmt(r['median_ttft_ms'])} / {fmt(r['p99_ttft_ms'])}",
            f"{fmt(r['median_tpot_ms'])} / {fmt(r['p99_tpot_ms'])}",
            f"{fmt(r['median_itl_ms'])} / {fmt(r['p99_itl_ms'])}",
            f"{fmt(r['median_e2el_ms'])} / {fmt(r['p95_e2el_ms'])} / {fmt(r['p99_e2el_ms'])}",
            fmt(r["schedule_lag_p99_ms"])]) + " |")
    for r in results["runs"]:
        if r.get("sessions"):
            sessions = r["sessions"]
            lines += ["", f"At {r['request_rate']:g} sessions/s offered: each arrival was an agent session; E2EL is "
                          f"the session's latency from its scheduled start ({sessions['turns_mean']:.2g} turns and "
                          f"{sessions['tool_calls_mean']:.2g} tool calls on average, "
                          f"{sessions['without_tool_call_share']:.0%} without a call)."]
            if sessions["without_tool_call_share"] >= 0.25:
                lines += ["", f"**Warning: {sessions['without_tool_call_share']:.0%} of the sessions at "
                              f"{r['request_rate']:g}/s made no tool call: they measured single answers, not agent "
                              "sessions (a greedy warm start that never calls? answers cut at max_tokens?).**"]
    cut = [r for r in results["runs"] if (r.get("finish_length_share") or 0) >= 0.25]
    for r in cut:
        lines += ["", f"**Warning: at {r['request_rate']:g} requests/s {r['finish_length_share']:.0%} of the answers "
                      "were cut at max_tokens: the latencies measure truncated answers.**"]
    lines += ["", "Percentiles are over successful requests; rates divide by the run's wall time (the last answer's "
                  "end). Every field of `open_loop.json` is named as `vllm bench serve` names it where it has one."]
    if plot is not None:
        lines += ["", f"![latency vs throughput]({plot.name})"]
    return "\n".join(lines) + "\n"


def _plot(results: dict[str, Any], path: Path) -> Path | None:
    """p50/p95 end-to-end latency against achieved throughput, one point per offered rate (the knee plot)."""
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return None
    runs = [r for r in results["runs"] if r["median_e2el_ms"] is not None]
    if not runs:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    x = [r["request_throughput"] for r in runs]
    for key, label in (("median_e2el_ms", "e2el p50"), ("p95_e2el_ms", "e2el p95")):
        ax.plot(x, [r[key] for r in runs], marker="o", label=label)
    for r in runs:
        ax.annotate(f"{r['request_rate']:g}/s", (r["request_throughput"], r["p95_e2el_ms"]), fontsize=7,
                    textcoords="offset points", xytext=(4, 4))
    knee = (results.get("sweep") or {}).get("knee_rate")
    at_knee = next((r for r in runs if r["request_rate"] == knee), None)
    if at_knee is not None:
        ax.axvline(at_knee["request_throughput"], color="green", linestyle="--", linewidth=1,
                   label=f"knee: {knee:g} req/s offered")
        ax.axvline(at_knee["request_throughput"] * 0.8, color="gray", linestyle=":", linewidth=1,
                   label="planning point (20% headroom)")
    ax.set_xlabel("achieved requests/s")
    ax.set_ylabel("latency from the scheduled send (ms)")
    ax.set_title("open loop: latency vs throughput (offered rate marked)")
    ax.legend()
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
    return path

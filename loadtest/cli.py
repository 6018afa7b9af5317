"""``verl loadtest`` and ``verl loadtest-report``, contributed to the ``verl`` CLI by the ``verl.commands`` entry point.

Only typer is imported at module level: ``verl --help`` must not load Locust, matplotlib or the service. (Locust
also imports this file when given ``-f loadtest/``; it defines no users, so it adds nothing to the test.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from verl.utils.cli import new_console, run_guarded

SLO_HELP = "p95 latency SLO in ms (end-to-end, successful requests of every endpoint)."

# The SLO options both commands take (a run judges its own report; loadtest-report judges saved CSVs).
SloP95 = Annotated[float, typer.Option("--slo-p95-ms", help=SLO_HELP)]
SloTtftP95 = Annotated[float | None, typer.Option("--slo-ttft-p95-ms", help="Also require TTFT p95 <= this (ms).")]
SloSessionP95 = Annotated[float | None, typer.Option(
    "--slo-session-p95-ms", help="Agent runs (AgentUser): also require whole-session p95 <= this (ms).")]
MaxFailureRate = Annotated[float, typer.Option("--max-failure-rate", help="Largest failure fraction a level may have.")]
Headroom = Annotated[float, typer.Option("--headroom", help="Spare share at the planning point.")]
TargetRps = Annotated[float | None, typer.Option(
    "--target-rps", help="A load to plan for: the report gives the replicas it needs at the per-replica rate.")]


def loadtest_command(
    out: Annotated[Path, typer.Option("--out", help="Output dir (CSVs, logs, report).")] = Path(
        "outputs/loadtest"),
    model: Annotated[str | None, typer.Option("--model", help="Model to serve (export dir or builtin:NAME; "
                                                              "default: the service's default).")] = None,
    engine: Annotated[str | None, typer.Option("--engine", help="auto, transformers or vllm.")] = None,
    max_users: Annotated[int, typer.Option("--max-users", help="Levels 1, 2, 4, ... up to this.")] = 8,
    step_users: Annotated[str, typer.Option("--step-users", help="Explicit levels, e.g. 1,2,4,8,12.")] = "",
    step_time: Annotated[float, typer.Option("--step-time", help="Seconds each level is held.")] = 20.0,
    step_settle: Annotated[float, typer.Option(
        "--step-settle", help="Seconds at the start of a level left out of its percentiles.")] = 5.0,
    user_mix: Annotated[str, typer.Option("--user-mix", help="mixed (each user sends all three requests), "
                                                             "classes (one user class per endpoint), agent "
                                                             "(tool-calling sessions, AgentUser) or feedback (chats "
                                                             "without answers, then thumbs up/down: "
                                                             "FeedbackUser).")] = "mixed",
    users: Annotated[list[str] | None, typer.Option(
        "--user", help="Run only these user classes (repeatable): GenerateUser, CompletionUser, "
                       "ChatStreamUser, MixedUser.")] = None,
    max_tokens: Annotated[int | None, typer.Option(
        "--max-tokens", help="max_tokens per request (default 32; --user-mix agent 128: a tool call, the tool's turn "
                             "and the answer must fit).")] = None,
    slo_p95_ms: SloP95 = 1000.0,
    slo_ttft_p95_ms: SloTtftP95 = None,
    slo_session_p95_ms: SloSessionP95 = None,
    max_failure_rate: MaxFailureRate = 0.01,
    headroom: Headroom = 0.2,
    locust_arg: Annotated[list[str] | None, typer.Option(
        "--locust-arg", help="Extra Locust option, repeatable, e.g. --locust-arg=--wait-max=0.5.")] = None,
    url: Annotated[str | None, typer.Option(
        "--url", help="Test a running service (e.g. verl serve --replicas 2) instead of starting one; its "
                      "/health gives the replicas for the per-replica line.")] = None,
    api_key: Annotated[str | None, typer.Option(
        "--api-key", envvar="VERL_SERVE_API_KEY", show_envvar=True,
        help="The running service's key (--url), for the requests and /metrics.")] = None,
    processes: Annotated[int, typer.Option(
        "--processes", help="Locust worker processes generating the load (one core each).")] = 1,
    target_rps: TargetRps = None,
    rate: Annotated[str | None, typer.Option(
        "--rate", help="Open loop instead of user steps: requests/s, comma-separated for several (2,4,8), each "
                       "sent on a schedule that does not wait for answers; latency counts from the scheduled "
                       "send.")] = None,
    arrival: Annotated[str, typer.Option("--arrival", help="--rate: constant or poisson arrivals.")] = "poisson",
    burstiness: Annotated[float, typer.Option(
        "--burstiness", help="--rate poisson: gamma shape of the gaps, as vllm bench serve (1 = Poisson).")] = 1.0,
    duration: Annotated[float, typer.Option("--duration", help="--rate: seconds of sends per rate.")] = 30.0,
    slo: Annotated[str | None, typer.Option(
        "--slo", help="--rate: per-request SLOs for goodput in ms, vLLM's names: ttft:300,tpot:50,itl:100,"
                      "e2el:2000.")] = None,
    max_lag_p99_ms: Annotated[float, typer.Option(
        "--max-lag-p99-ms", help="--rate: refuse a rate whose sends ran this late at p99 (the generator, not the "
                                 "service, was the bottleneck).")] = 10.0,
    schedule_seed: Annotated[int, typer.Option("--schedule-seed", help="--rate: seed of the arrival schedule.")] = 0,
    sweep: Annotated[bool, typer.Option(
        "--sweep", help="--rate R: find the knee, the largest rate whose goodput stays >= --goodput-share of the "
                        "offered rate: double from R until a rate misses, then bisect.")] = False,
    goodput_share: Annotated[float, typer.Option("--goodput-share", help="--sweep: the share to hold.")] = 0.95,
    max_rate: Annotated[float, typer.Option("--max-rate", help="--sweep: the highest rate tried.")] = 1024.0,
    replay: Annotated[str | None, typer.Option(
        "--replay", help="Open loop on the service's own traffic: its records (a records_path file, or a "
                         "service URL's /admin/records with VERL_SERVE_ADMIN_API_KEY), at the recorded arrival times, "
                         "prompts (where kept) and output lengths.")] = None,
    replay_speed: Annotated[float, typer.Option(
        "--replay-speed", help="--replay: divide the recorded gaps by this (2 = twice the recorded rate).")] = 1.0,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Only the summary.")] = False,
) -> None:
    """Start the service on 127.0.0.1 (or test the one at --url), run a stepped Locust test (or open-loop rates
    with --rate), stop the service, write a capacity report."""

    def _run() -> None:
        from loadtest.render import summary_text
        from loadtest.report import SLO
        from loadtest.run import LoadTestConfig, run_loadtest
        from verl.errors import ConfigError

        if user_mix not in ("mixed", "classes", "agent", "feedback"):
            raise ConfigError(f"--user-mix must be mixed, classes, agent or feedback (got {user_mix!r})")
        console = new_console()
        config = LoadTestConfig(
            out_dir=out, model=model, engine=engine, max_users=max_users, step_users=step_users,
            step_time_s=step_time, step_settle_s=step_settle, user_mix=user_mix, user_classes=users or [],
            max_tokens=max_tokens, extra_locust_args=locust_arg or [],
            slo=SLO(slo_p95_ms, max_failure_rate, slo_ttft_p95_ms, headroom, slo_session_p95_ms),
            url=url, api_key=api_key if url else None, processes=processes, target_rps=target_rps,
        )
        try:
            config.plan()
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if rate is not None or replay is not None:
            _run_open_loop(config, console, quiet, headroom, rate=rate, replay=replay, replay_speed=replay_speed,
                           duration=duration, arrival=arrival, burstiness=burstiness, schedule_seed=schedule_seed,
                           slo=slo, max_lag_p99_ms=max_lag_p99_ms, sweep=sweep, goodput_share=goodput_share,
                           max_rate=max_rate)
            return
        if slo is not None:
            raise ConfigError("--slo sets goodput's per-request limits of an open-loop run: add --rate, or use "
                              "--slo-p95-ms for the user steps")
        report, paths = run_loadtest(config, echo=None if quiet else (
            lambda line: console.print(line, soft_wrap=True)))
        console.print(summary_text(report), soft_wrap=True)
        console.print(f"report: {paths['markdown']} (also .html, .json and plots in {out})")

    run_guarded(_run)


def _run_open_loop(config: Any, console: Any, quiet: bool, headroom: float, *, rate: str | None, replay: str | None,
                   replay_speed: float, duration: float, arrival: str, burstiness: float, schedule_seed: int,
                   slo: str | None, max_lag_p99_ms: float, sweep: bool, goodput_share: float, max_rate: float
                   ) -> None:
    """``verl loadtest --rate`` / ``--replay``: the open-loop runs (loadtest/open_run.py) and their console lines."""
    from loadtest.open_loop import parse_rates, parse_slo
    from loadtest.open_run import OpenLoopConfig, Sweep, knee_line, rate_line, replay_config, run_open_loop
    from verl.errors import ConfigError

    if rate is not None and replay is not None:
        raise ConfigError("--rate and --replay both set the schedule: give one")
    if sweep and replay is not None:
        raise ConfigError("--sweep searches rates; a --replay keeps the recorded times (use --replay-speed)")
    rates = parse_rates(rate) if rate else []
    if sweep and len(rates) > 1:
        raise ConfigError("--sweep starts from one --rate and finds the others itself; give one rate")
    schedule, notes = replay_config(replay, replay_speed) if replay is not None else (None, [])
    open_config = OpenLoopConfig(config, rates, duration, arrival, burstiness, schedule_seed, parse_slo(slo),
                                 max_lag_p99_ms, replay=schedule, replay_notes=notes)
    results, paths = run_open_loop(open_config, echo=None if quiet else (
        lambda line: console.print(line, soft_wrap=True)), sweep=Sweep(goodput_share, max_rate) if sweep else None)
    if quiet:
        for run in results["runs"]:
            console.print(rate_line(run), soft_wrap=True)
    knee = knee_line(results, headroom)
    if knee:
        console.print(knee, soft_wrap=True)
    console.print(f"report: {paths['markdown']} (results: {paths['json']})")
    if not sweep and any(run["generator_bound"] for run in results["runs"]):
        raise ConfigError("the load generator fell behind its schedule (see the REFUSED lines): its latencies "
                          "measure the client; lower the rate or give Locust more cores")


def loadtest_report_command(
    csv_prefix: Annotated[Path | None, typer.Argument(help="Locust's --csv prefix (out/run for out/run_stats.csv), "
                                                           "one of its files, or their directory.")] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Report dir (default: beside the CSVs).")] = None,
    compare: Annotated[tuple[Path, Path] | None, typer.Option(
        "--compare", help="Two open-loop runs (their --out dirs or open_loop.json), A then B: paired by offered "
                          "rate.")] = None,
    slo_p95_ms: SloP95 = 1000.0,
    slo_ttft_p95_ms: SloTtftP95 = None,
    slo_session_p95_ms: SloSessionP95 = None,
    max_failure_rate: MaxFailureRate = 0.01,
    headroom: Headroom = 0.2,
    server_metrics: Annotated[Path | None, typer.Option(
        "--server-metrics", help="The service's /metrics saved after the run (shown as a cross-check).")] = None,
    no_plots: Annotated[bool, typer.Option("--no-plots", help="Skip the PNGs (no matplotlib needed).")] = False,
    replicas: Annotated[int, typer.Option("--replicas", help="Replicas that served the test.")] = 1,
    target_rps: TargetRps = None,
) -> None:
    """Capacity report (Markdown, HTML, JSON, PNG) from Locust's CSVs: per-step numbers and max users in SLO."""

    def _run() -> None:
        from loadtest.render import make_report, summary_text
        from loadtest.report import SLO, FleetPlan, resolve_prefix
        from verl.errors import ConfigError

        if compare is not None:
            from loadtest.compare import compare_line, compare_runs

            if csv_prefix is not None:
                raise ConfigError("give either a Locust CSV prefix or --compare A B, not both")
            second = Path(compare[1])
            report, paths = compare_runs(compare[0], second, out or (second if second.is_dir() else second.parent))
            console = new_console()
            for row in report["rows"]:
                console.print(compare_line(row), soft_wrap=True)
            console.print(f"comparison: {paths['markdown']} (also .json)")
            return
        if csv_prefix is None:
            raise ConfigError("give a Locust CSV prefix (or --compare A B for two open-loop runs)")
        prefix = resolve_prefix(csv_prefix)
        slo = SLO(slo_p95_ms, max_failure_rate, slo_ttft_p95_ms, headroom, slo_session_p95_ms)
        report, paths = make_report(prefix, out or prefix.parent, slo, plots=not no_plots,
                                    server_metrics=server_metrics, plan=FleetPlan(replicas, target_rps))
        console = new_console()
        console.print(summary_text(report), soft_wrap=True)
        console.print(f"report: {paths['markdown']} (also .html and .json)")

    run_guarded(_run)


def register(app: typer.Typer) -> None:
    """Attach this module's commands to the ``verl`` app."""
    app.command("loadtest")(loadtest_command)
    app.command("loadtest-report")(loadtest_report_command)

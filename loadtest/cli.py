"""``verl loadtest`` and ``verl loadtest-report``, contributed to the ``verl`` CLI by the ``verl.commands`` entry point;
their options are the fields of ``LoadTestSettings`` and ``ReportSettings`` (loadtest/settings.py).

Only typer and that light module at module level: ``verl --help`` must not load Locust, matplotlib or the service.
(Locust also imports this file when given ``-f loadtest/``; it defines no users, so it adds nothing to the test.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from loadtest.settings import LoadTestConfig, LoadTestSettings, OpenLoopOptions, ReportSettings
from verl.utils.cli import command, new_console


def run_loadtest_command(settings: LoadTestSettings) -> None:
    """Start the service on 127.0.0.1 (or test the one at --url), run a stepped Locust test (or open-loop rates
    with --rate), stop the service, write a capacity report."""
    from loadtest.render import summary_text
    from loadtest.run import run_loadtest
    from verl.errors import ConfigError

    config, console = settings.config, new_console()
    try:
        config.plan()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if settings.open_loop.chosen:
        _run_open_loop(config, settings.open_loop, console, settings.quiet)
        return
    report, paths = run_loadtest(config, echo=None if settings.quiet else (
        lambda line: console.print(line, soft_wrap=True)))
    console.print(summary_text(report), soft_wrap=True)
    console.print(f"report: {paths['markdown']} (also .html, .json and plots in {config.out_dir})")


def _run_open_loop(config: LoadTestConfig, options: OpenLoopOptions, console: Any, quiet: bool) -> None:
    """``verl loadtest --rate`` / ``--replay``: the open-loop runs (loadtest/open_run.py) and their console lines."""
    from loadtest.open_loop import parse_rates, parse_slo
    from loadtest.open_run import OpenLoopConfig, Sweep, knee_line, rate_line, replay_config, run_open_loop
    from verl.errors import ConfigError

    rates = parse_rates(options.rate) if options.rate else []
    if options.sweep and len(rates) > 1:
        raise ConfigError("--sweep starts from one --rate and finds the others itself; give one rate")
    schedule, notes = replay_config(options.replay, options.replay_speed) if options.replay is not None else (None, [])
    open_config = OpenLoopConfig(config, rates, options.duration, options.arrival, options.burstiness,
                                 options.schedule_seed, parse_slo(options.goodput_slo), options.max_lag_p99_ms,
                                 replay=schedule, replay_notes=notes)
    sweep = Sweep(options.goodput_share, options.max_rate) if options.sweep else None
    results, paths = run_open_loop(open_config, echo=None if quiet else (
        lambda line: console.print(line, soft_wrap=True)), sweep=sweep)
    if quiet:
        for run in results["runs"]:
            console.print(rate_line(run), soft_wrap=True)
    knee = knee_line(results, config.slo.headroom)
    if knee:
        console.print(knee, soft_wrap=True)
    console.print(f"report: {paths['markdown']} (results: {paths['json']})")
    if sweep is None and any(run["generator_bound"] for run in results["runs"]):
        raise ConfigError("the load generator fell behind its schedule (see the REFUSED lines): its latencies "
                          "measure the client; lower the rate or give Locust more cores")


def run_loadtest_report_command(settings: ReportSettings) -> None:
    """Capacity report (Markdown, HTML, JSON, PNG) from Locust's CSVs: per-step numbers and max users in SLO."""
    from loadtest.render import make_report, summary_text
    from loadtest.report import FleetPlan, resolve_prefix

    console = new_console()
    if settings.compare is not None:
        from loadtest.compare import compare_line, compare_runs

        second = Path(settings.compare[1])
        report, paths = compare_runs(settings.compare[0], second,
                                     settings.out or (second if second.is_dir() else second.parent))
        for row in report["rows"]:
            console.print(compare_line(row), soft_wrap=True)
        console.print(f"comparison: {paths['markdown']} (also .json)")
        return
    prefix = resolve_prefix(settings.csv_prefix)
    report, paths = make_report(prefix, settings.out or prefix.parent, settings.slo, plots=not settings.no_plots,
                                server_metrics=settings.server_metrics,
                                plan=FleetPlan(settings.replicas, settings.target_rps))
    console.print(summary_text(report), soft_wrap=True)
    console.print(f"report: {paths['markdown']} (also .html and .json)")


loadtest_command = command(run_loadtest_command, LoadTestSettings)
loadtest_report_command = command(run_loadtest_report_command, ReportSettings)


def register(app: typer.Typer) -> None:
    """Attach this module's commands to the ``verl`` app."""
    app.command("loadtest")(loadtest_command)
    app.command("loadtest-report")(loadtest_report_command)

"""``verl ship`` (registered on the ``verl`` CLI by ``eval.cli.register``); only typer at module level."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from verl.utils.cli import run_guarded


def ship_command(
    run: Annotated[str, typer.Argument(help="The candidate's training run (its best checkpoint ships).")],
    service: Annotated[str, typer.Option("--service", help="The running service's URL.")],
    route: Annotated[str, typer.Option("--route", help="The route to ship on.")] = "default",
    ckpt: Annotated[str | None, typer.Option("--ckpt", help="Ship this checkpoint instead of the best.")] = None,
    name: Annotated[str | None, typer.Option("--name", help="The candidate's model name in the service "
                                                            "(default: RUN-stepN).")] = None,
    admin_key: Annotated[str | None, typer.Option("--admin-key", envvar="VERL_SERVE_ADMIN_API_KEY",
                                                  help="The service's admin key.")] = None,
    api_key: Annotated[str | None, typer.Option("--api-key", envvar="VERL_SERVE_API_KEY",
                                                help="The service's request key (capacity gate).")] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Audit log and report dir (default: "
                                                           "RUN/ship/<id>).")] = None,
    stages: Annotated[str, typer.Option(
        "--stages", help="The candidate's route shares, rising, e.g. 0.05,0.25,0.5 (then 100% on promote).")
    ] = "0.05,0.25,0.5",
    min_per_stage: Annotated[int, typer.Option("--min-per-stage", help="Rewarded candidate requests a stage "
                                                                       "needs before stepping up.")] = 40,
    margin: Annotated[float, typer.Option("--margin", help="Non-inferiority margin on reward / the gate "
                                                           "metric (absolute).")] = 0.05,
    alpha: Annotated[float, typer.Option("--alpha", help="One error budget for the whole decision: identical "
                                                         "models rolled back, or a candidate worse by the margin "
                                                         "promoted, each at most this often (split across the "
                                                         "tests as the plan prints).")] = 0.05,
    test: Annotated[str, typer.Option("--test", help="The reward test: betting (rewards in [0, 1]; exact at "
                                                     "every n) or mixture (normal mixture; asymptotic, any "
                                                     "scale).")] = "betting",
    min_per_arm: Annotated[int, typer.Option("--min-per-arm", help="No canary decision before this many "
                                                                   "rewarded requests on each side.")] = 30,
    max_error_increase: Annotated[float, typer.Option("--max-error-increase", help="Guardrail: the candidate's "
                                                      "error rate above the incumbent's by more rolls back.")]
    = 0.02,
    max_missing_increase: Annotated[float, typer.Option(
        "--max-missing-increase", help="Guardrail: the candidate's share of requests whose reward never came "
        "(errors, rewards past --reward-timeout-s) above the incumbent's by more rolls back.")] = 0.02,
    reward_source: Annotated[str, typer.Option("--reward-source", help="The canary's rewards: rule (requests "
                                               "that carry an answer), feedback (users' POST /v1/feedback), "
                                               "rm:NAME or judge:NAME (a scorer's reward rows).")] = "rule",
    reward_timeout_s: Annotated[float, typer.Option("--reward-timeout-s", help="A reward not in this long after "
                                                    "its answer counts as missing.")] = 60.0,
    slo_p95_ms: Annotated[float, typer.Option("--slo-p95-ms", help="Guardrail (a sequential test that the "
                                                                   "candidate's p95 is above it) and capacity "
                                                                   "gate: p95 latency SLO (ms).")] = 1000.0,
    budget_requests: Annotated[int, typer.Option("--budget-requests", help="Canary requests (both models) "
                                                                           "before 'inconclusive'.")] = 10_000,
    budget_s: Annotated[float, typer.Option("--budget-s", help="Canary seconds before 'inconclusive'.")] = 600.0,
    poll_s: Annotated[float, typer.Option("--poll-s", help="Seconds between two looks at the records.")] = 1.0,
    offline: Annotated[bool, typer.Option("--offline/--skip-offline", help="Run the offline gates.")] = True,
    capacity: Annotated[bool, typer.Option("--capacity/--skip-capacity", help="Run the capacity gate.")] = True,
    capacity_users: Annotated[int, typer.Option("--capacity-users", help="Users in the capacity gate.")] = 2,
    capacity_s: Annotated[float, typer.Option("--capacity-s", help="Seconds of the capacity gate.")] = 10.0,
    gate_data: Annotated[list[str] | None, typer.Option(
        "--gate-data", help="Offline gate prompts (parquet or builtin:TASK/SPLIT; repeatable). Default: the "
        "built-in task's test split, which the run's checkpoint selection never saw.")] = None,
    max_samples: Annotated[int | None, typer.Option("--max-samples", help="Offline gate: the first N "
                                                                          "prompts.")] = None,
    max_kl: Annotated[float | None, typer.Option("--max-kl", help="Offline guardrail: refuse a candidate whose "
                                                                   "exact KL to its base model is above this "
                                                                   "(default: reported only).")] = None,
    shadow: Annotated[float, typer.Option("--shadow", help="Before the canary, mirror this share of the route "
                                                            "to the candidate (recorded, never returned); 0: "
                                                            "no shadow stage.")] = 0.0,
    shadow_requests: Annotated[int, typer.Option("--shadow-requests", help="Mirrored, rewarded answers the "
                                                                           "shadow stage needs.")] = 50,
    strict: Annotated[bool, typer.Option("--strict", help="Offline gate: refuse when its prompts overlap the run's "
                                         "training data (exactly or by a 13-gram) instead of reporting it.")
                      ] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan, the alpha split and the canary's "
                                                            "power for the route's observed traffic; change "
                                                            "nothing.")] = False,
) -> None:
    """Ship a run's best checkpoint: offline gates, a canary with an always-valid sequential test, then
    promote or roll back (exit 0 when promoted, 10 when refused, rolled back or inconclusive)."""

    def _run() -> None:
        from eval.ship.canary import CanarySettings
        from eval.ship.run import ShipSettings, ship
        from verl.errors import ConfigError

        try:
            shares = tuple(float(s) for s in stages.split(",") if s.strip())
            canary = CanarySettings(stages=shares, min_per_stage=min_per_stage, margin=margin, alpha=alpha,
                                    test=test, min_per_arm=min_per_arm, max_error_increase=max_error_increase,
                                    max_missing_increase=max_missing_increase, slo_p95_ms=slo_p95_ms,
                                    reward_timeout_s=reward_timeout_s, budget_requests=budget_requests,
                                    budget_s=budget_s, poll_s=poll_s, shadow=shadow > 0,
                                    capacity=capacity, reward_source=reward_source)
        except ValueError as exc:
            raise ConfigError(f"verl ship: {exc}") from None
        if not 0.0 <= shadow <= 1.0:
            raise ConfigError(f"--shadow is a share of the route's requests: 0 (no shadow stage) to 1 "
                              f"(got {shadow})")
        settings = ShipSettings(run=run, service=service, route=route, ckpt=ckpt, name=name, admin_key=admin_key,
                                api_key=api_key, out=out, canary=canary, offline=offline, capacity=capacity,
                                capacity_users=capacity_users, capacity_s=capacity_s, slo_p95_ms=slo_p95_ms,
                                max_samples=max_samples, max_kl=max_kl, shadow_fraction=shadow,
                                shadow_requests=shadow_requests, gate_data=gate_data, dry_run=dry_run,
                                strict=strict)
        code, _ = ship(settings, say=lambda line: typer.echo(line, err=True))
        raise typer.Exit(code)

    run_guarded(_run)


def register(app: typer.Typer) -> None:
    """Attach this module's commands to the ``verl`` app."""
    app.command("ship")(ship_command)

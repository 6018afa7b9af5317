"""``verl eval`` and ``verl compare`` (contributed to the ``verl`` CLI through the ``verl.commands`` entry point).

Only typer is imported at module level: ``verl --help`` must work without torch models or matplotlib loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from eval.settings import EvalSettings, joined_specs
from eval.ship.cli import register as register_ship
from verl.utils.cli import command, new_console, parameter, run_guarded


def run_eval_command(ckpt: str, out: Path | None, watch: bool, settings: EvalSettings) -> None:
    """Evaluate a checkpoint (or every checkpoint of a run): metrics with 95% CIs, samples, report, plots."""
    from eval.runner import run_eval
    from verl.utils.fs import ensure_writable_dir
    from verl.utils.log import quiet_hf

    quiet_hf()
    if out is not None:  # before the model loads, not after the generation
        ensure_writable_dir(out, "--out")
    if watch:
        from eval.watch import watch_run

        watch_run(ckpt, settings, out, new_console())
        return
    run_eval(ckpt, settings, out, new_console())


# `verl eval`: the checkpoint, where results go and --watch, then one option per EvalSettings field.
eval_command = command(
    run_eval_command, EvalSettings,
    parameter("ckpt", str, typer.Option("--ckpt", help="Checkpoint dir, run dir (every checkpoint), HF model dir or "
                                                       "builtin:NAME.")),
    parameter("out", Path | None, typer.Option("--out", help="Output dir (default: <run>/eval/<checkpoint>)."), None),
    parameter("watch", bool, typer.Option("--watch", help="--ckpt RUN: evaluate each checkpoint as it lands while the "
                                          "run trains (the run dir may not exist yet); exits when the run finishes, "
                                          "with the run summary and best.json."), False))


def compare_command(
    runs: Annotated[list[str] | None, typer.Argument(help="Two or more run dirs, checkpoint dirs or eval result "
                                                          "dirs; the first is the baseline.")] = None,
    ckpt: Annotated[str, typer.Option("--ckpt", help="Which checkpoint of a run dir: best, latest or "
                                                     "global_step_N.")] = "best",
    out: Annotated[Path | None, typer.Option("--out", help="Report dir (default: outputs/compare/A-vs-B).")] = None,
    alpha: Annotated[float, typer.Option("--alpha", help="Significance level of the verdicts.")] = 0.05,
    metric: Annotated[str, typer.Option("--metric", help="Metric for 'best' and hyper-parameter importance.")
                      ] = "eval/accuracy:max",
    bootstrap: Annotated[int, typer.Option("--bootstrap", help="Paired bootstrap replicates.")] = 2000,
    seed: Annotated[int | None, typer.Option("--seed", help="Sampling seed when runs must be evaluated, and the "
                                                           "bootstrap seed.")] = None,
    data: Annotated[list[str] | None, typer.Option("--data", help="Prompts when runs must be evaluated.")] = None,
    n: Annotated[int | None, typer.Option("--n", help="Samples per prompt when runs must be evaluated.")] = None,
    temperature: Annotated[float | None, typer.Option("--temperature")] = None,
    max_samples: Annotated[int | None, typer.Option("--max-samples")] = None,
    max_prompt_length: Annotated[int | None, typer.Option("--max-prompt-length")] = None,
    evaluators: Annotated[list[str] | None, typer.Option("--evaluators", "-e")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q")] = False,
    online: Annotated[str | None, typer.Option("--online", help="Instead of runs: the models of a running service "
                                               "(its URL) or its records_path JSONL file, compared from the "
                                               "service's per-request records.")] = None,
    baseline: Annotated[str | None, typer.Option("--baseline", help="--online: the baseline model (default: "
                                                 "the one with the most requests).")] = None,
    models: Annotated[list[str] | None, typer.Option("--model", help="--online: compare only these models "
                                                     "(repeatable).")] = None,
    since: Annotated[float | None, typer.Option("--since", help="--online: only records after this Unix "
                                                "time.")] = None,
    reward_source: Annotated[str | None, typer.Option("--reward-source", help="--online: the rewards to compare: "
                                                      "rule, feedback, rm:NAME or judge:NAME (needed when the "
                                                      "records hold several).")] = None,
    admin_key: Annotated[str | None, typer.Option("--admin-key", help="--online URL: the service's "
                                                  "admin_api_key (default: $VERL_SERVE_ADMIN_API_KEY).")] = None,
) -> None:
    """Compare runs pairwise against the first: paired bootstrap CIs, McNemar, config diff, training curves.
    With --online: the models a service serves side by side, from its records (reward, latency, errors)."""
    if online is not None:
        run_guarded(_compare_online, online, out, baseline, models, alpha, bootstrap, seed, since, admin_key,
                    reward_source)
        return
    if not runs or len(runs) < 2:
        run_guarded(_usage_error, "verl compare needs at least two runs (A B ...), or --online URL|FILE")

    def _run():
        from eval.compare import compare
        from eval.runner import EvalSettings
        from verl.utils.fs import ensure_writable_dir
        from verl.utils.log import quiet_hf

        quiet_hf()
        if out is not None:
            ensure_writable_dir(out, "--out")
        settings = EvalSettings(data=data or None, evaluators=joined_specs(evaluators), n=n, temperature=temperature,
                                seed=seed, max_samples=max_samples, select=metric, quiet=quiet,
                                max_prompt_length=max_prompt_length)
        compare(runs, ckpt=ckpt, out=out, alpha=alpha, settings=settings, n_boot=bootstrap,
                seed=seed if seed is not None else 0, console=new_console())

    run_guarded(_run)


def register(app: typer.Typer) -> None:
    """Attach this module's commands to the ``verl`` app."""
    register_ship(app)
    app.command("eval")(eval_command)
    app.command("compare")(compare_command)


def _usage_error(message: str) -> None:
    from verl.errors import ConfigError

    raise ConfigError(message)


def _compare_online(source: str, out: Path | None, baseline: str | None, models: list[str] | None, alpha: float,
                    n_boot: int, seed: int | None, since: float | None, admin_key: str | None,
                    reward_source: str | None = None) -> None:
    from eval.online import compare_online

    out_dir = out or Path("outputs/compare/online")
    report = compare_online(source, out_dir, baseline, models, alpha, n_boot, seed or 0, since, admin_key,
                            reward_source)
    printer = new_console(stderr=False)
    printer.print(f"rewards: {report['reward_source'] or 'none recorded'}")
    for name, s in report["models"].items():
        reward = "–" if s["reward_mean"] is None else f"{s['reward_mean']:.3f} (n={s['rewarded']})"
        e2e = "–" if s["e2e_mean"] is None else f"{s['e2e_mean']:.3f}"
        printer.print(f"{name}: {s['requests']} requests, {s['errors']} errors, {s['aborted']} aborted, reward "
                      f"{reward}, e2e mean {e2e} s")
    for pair in report["comparisons"]:
        reward = pair["reward"]["verdict"] if pair["reward"] else "no rewards recorded"
        printer.print(f"{pair['candidate']} vs {pair['baseline']}: reward {reward}; latency {pair['e2e']['verdict']}")
    printer.print(f"report: {out_dir / 'report.md'}")

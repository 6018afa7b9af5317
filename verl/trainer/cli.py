"""``verl train``: RL post-training from a config and dotted overrides.

Here, in the trainer package, so ``python3 -m verl.trainer.main_ppo`` (verl's launch line) runs the very same command
without the ``verl`` app that collects every package's commands.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from verl.utils.cli import OVERRIDE_CONTEXT, err, run_guarded, split_overrides
from verl.utils.log import quiet_hf


def train_command(
    ctx: typer.Context,
    config: Annotated[Path | None, typer.Option("--config", "-c", help="YAML config (default: built-in GRPO).")] = None,
    log_dir: Annotated[Path | None,
                       typer.Option("--log_dir", "--log-dir", help="Directory for verl_logs.jsonl.")] = None,
    log_level: Annotated[str | None, typer.Option("--log_level", "--log-level", help="INFO or DEBUG.")] = None,
    dry_run: Annotated[bool,
                       typer.Option("--dry-run", help="Resolve the config and check shapes; load no weights.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No console lines.")] = False,
) -> None:
    """RL post-training (PPO / GRPO / RLOO / REINFORCE++ / ReMax). Extra args are key=value overrides."""

    def _run():
        from verl.trainer.resume import load_train_config

        overrides = split_overrides(list(ctx.args))
        if log_dir is not None:
            overrides.append(f"trainer.log_dir={log_dir}")
        if log_level is not None:
            overrides.append(f"trainer.log_level={log_level.upper()}")
        cfg, resume = load_train_config(config, overrides)
        if resume is not None:
            err.print(resume.summary(), soft_wrap=True, markup=False)
        if dry_run:
            from verl.trainer.dry_run import dry_run as check

            err.print(check(cfg))
            return
        from verl.utils.fs import ensure_writable_dir

        ensure_writable_dir(cfg.trainer.output_dir, "trainer.output_dir")  # before minutes of model loading
        quiet_hf()
        from verl.trainer.factory import build_trainer

        trainer = build_trainer(cfg, quiet=quiet)
        try:
            metrics = trainer.fit()
        finally:
            trainer.shutdown()
        summary = {k: round(v, 4) for k, v in metrics.items() if k.startswith(("eval/accuracy", "rollout/reward_mean"))}
        err.print(f"run directory: {cfg.run_dir()}  {summary}")

    run_guarded(_run)


def train_app(prog_name: str) -> typer.Typer:
    """An app whose one command is ``verl train`` (for ``main_ppo``)."""
    app = typer.Typer(name=prog_name, add_completion=False, pretty_exceptions_enable=False,
                      context_settings={"help_option_names": ["-h", "--help"]})
    app.command(context_settings=OVERRIDE_CONTEXT)(train_command)
    return app

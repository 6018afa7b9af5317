"""``verl ship`` (registered on the ``verl`` CLI by ``eval.cli.register``); its options are ``ShipSettings``' fields
(eval/ship/settings.py); only typer and that light module at module level."""

from __future__ import annotations

import typer

from eval.ship.settings import ShipSettings
from verl.utils.cli import command


def run_ship_command(settings: ShipSettings) -> None:
    """Ship a run's best checkpoint: offline gates, a canary with an always-valid sequential test, then
    promote or roll back (exit 0 when promoted, 10 when refused, rolled back or inconclusive)."""
    from eval.ship.run import ship

    code, _ = ship(settings, say=lambda line: typer.echo(line, err=True))
    raise typer.Exit(code)


ship_command = command(run_ship_command, ShipSettings)


def register(app: typer.Typer) -> None:
    """Attach this module's commands to the ``verl`` app."""
    app.command("ship")(ship_command)

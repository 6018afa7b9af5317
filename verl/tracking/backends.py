"""Built-in tracker backends. ``console`` prints one compact line per step."""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console

from verl.tracking.base import Tracker, register_tracker

# (metric key, short label) shown on the console line, in order, when present.
CONSOLE_FIELDS = (
    ("rollout/reward_mean", "reward"),
    ("rollout/acc", "acc"),
    ("eval/accuracy", "val_acc"),
    ("ppo/policy_loss", "pg_loss"),
    ("critic/value_loss", "v_loss"),
    ("ppo/kl_div", "kl"),
    ("ppo/entropy", "ent"),
    ("rollout/response_length_mean", "len"),
    ("timing/total", "s/step"),
)


@register_tracker("console")
class ConsoleTracker(Tracker):
    name = "console"

    def __init__(self, total_steps: int | None = None, quiet: bool = False, **_: Any):
        self.total_steps = total_steps
        self.quiet = quiet
        self.console = Console(file=sys.stderr, highlight=False)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self.quiet or not metrics:
            return
        parts = [f"step {step}" + (f"/{self.total_steps}" if self.total_steps else "")]
        for key, label in CONSOLE_FIELDS:
            if key in metrics:
                parts.append(f"{label} {metrics[key]:.4g}")
        self.console.print(" | ".join(parts))

    def log_alert(self, alert: dict[str, Any], step: int) -> None:
        self.console.print(f"[bold yellow]ALERT[/] step {step}: {alert.get('rule')}: {alert.get('message')}")

"""Built-in tracker backends.

``console`` prints one compact line per step; ``jsonl`` adds histogram rows to ``verl_logs.jsonl``. The
tensorboard, wandb, mlflow and swanlab backends live in their own modules and are imported only when named, so
their (heavy, optional) packages are loaded only by runs that use them.
"""

from __future__ import annotations

from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn, TimeRemainingColumn
from rich.text import Text

from verl.tracking.base import Tracker
from verl.tracking.common import histogram_summary
from verl.utils import log
from verl.utils.cli import new_console

# (metric key, short label) shown on the console line, in order, when present.
CONSOLE_FIELDS = (("rollout/reward_mean", "reward"), ("rollout/acc", "acc"), ("eval/accuracy", "val_acc"),
                  ("ppo/policy_loss", "pg_loss"), ("critic/value_loss", "v_loss"), ("ppo/kl_div", "kl"),
                  ("ppo/entropy", "ent"), ("rollout/response_length_mean", "len"), ("timing/total", "s/step"))


class ConsoleTracker(Tracker):
    name = "console"

    def __init__(self, total_steps: int | None = None, quiet: bool = False, **_: Any):
        self.total_steps = total_steps
        self.quiet = quiet
        self.console = new_console()
        self.progress = None
        # On a terminal a progress bar (steps, elapsed, ETA) stays under the step lines; piped output gets the
        # lines alone, so log files stay clean.
        if not quiet and total_steps and self.console.is_terminal:
            self.progress = Progress("train", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), "eta",
                                     TimeRemainingColumn(), console=self.console, transient=True)
            self.task = self.progress.add_task("train", total=total_steps)
            self.progress.start()

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self.quiet or not metrics:
            return
        parts = [f"step {step}" + (f"/{self.total_steps}" if self.total_steps else "")]
        for key, label in CONSOLE_FIELDS:
            if key in metrics:
                parts.append(f"{label} {metrics[key]:.4g}")
        self.console.print(" | ".join(parts), soft_wrap=True)  # one line per step, also in a log file
        if self.progress is not None:
            self.progress.update(self.task, completed=step)

    def finish(self) -> None:
        if self.progress is not None:
            self.progress.stop()

    def log_alert(self, alert: dict[str, Any], step: int) -> None:
        if not self.quiet:
            self.console.print(Text.assemble(("ALERT", "bold yellow"), f" step {step}: {alert.get('rule')}: "
                                             f"{alert.get('message')}"),
                               soft_wrap=True)


class JsonlTracker(Tracker):
    """The part of ``verl_logs.jsonl`` the run logger does not write itself: distributions.

    Each distribution becomes one ``histogram`` row with a fixed number of buckets::

        {"scope": "histogram", "step": 3, "tag": "rollout/rewards", "min": 0.0, "max": 1.0, "num": 16, "sum": 4.0,
         "sum_squares": 4.0, "bucket_limits": [...], "bucket_counts": [...]}

    ``verl tensorboard`` turns these rows into TensorBoard histograms.
    """

    name = "jsonl"

    def __init__(self, **_: Any):
        pass

    def log_histograms(self, values: dict[str, list[float]], step: int) -> None:
        logger = log.get_active()
        if logger is None:
            return
        for tag, data in values.items():
            summary = histogram_summary(data)
            if summary is not None:
                logger.event("histogram", step=step, tag=tag, **summary)

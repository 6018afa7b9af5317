"""TensorBoard tracker: scalars, histograms, sampled generations as text, and the run's hyper-parameters.

Event files go to ``trainer.tracking.tensorboard.log_dir`` (default ``<run_dir>/tensorboard``); view them with
``tensorboard --logdir outputs/<project>``. Tags are the ``scope/name`` keys of ``verl_logs.jsonl``, the same tags
``verl tensorboard`` writes when it converts a log afterwards.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from verl.errors import ConfigError
from verl.tracking.base import Tracker
from verl.tracking.common import backend_settings, flatten_config, histogram_summary, require, samples_markdown

# Metrics the HParams dashboard shows next to each run's hyper-parameters.
HPARAM_METRICS = ("rollout/reward_mean", "eval/accuracy", "ppo/kl_div", "ppo/entropy")


class TensorBoardTracker(Tracker):
    name = "tensorboard"

    def __init__(self, config: Any = None, run_dir: str | Path | None = None, log_dir: str | Path | None = None,
                 resumed_step: int | None = None, **_: Any):
        """``resumed_step``: the checkpoint step a resumed run continues from (the trainer knows it)."""
        tb = require("torch.utils.tensorboard", "tensorboard", "tensorboard")
        settings = backend_settings(config, "tensorboard")
        chosen = log_dir or settings.log_dir or (Path(run_dir) / "tensorboard" if run_dir else None)
        if chosen is None:
            raise ConfigError("the tensorboard tracker needs a run directory or trainer.tracking.tensorboard.log_dir")
        self.log_dir = Path(chosen)
        # On resume, hide the points a crashed attempt logged after the checkpoint (they are logged again).
        self.writer = tb.SummaryWriter(str(self.log_dir), purge_step=None if resumed_step is None else resumed_step + 1,
                                       flush_secs=30)

    def log_config(self, config: dict[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams

        experiment, start, end = hparams(flatten_config(config), dict.fromkeys(HPARAM_METRICS, 0.0))
        for summary in (experiment, start, end):
            self.writer.file_writer.add_summary(summary)
        self.writer.add_text("config", "```yaml\n" + yaml.safe_dump(config, sort_keys=False) + "```", 0)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # one flush per step keeps a live TensorBoard current at negligible cost

    def log_histograms(self, values: dict[str, list[float]], step: int) -> None:
        for tag, data in values.items():
            summary = histogram_summary(data)
            if summary is not None:
                write_histogram(self.writer, tag, summary, step)

    def log_samples(self, samples: list[dict[str, Any]], step: int) -> None:
        by_split: dict[str, list[dict[str, Any]]] = {}
        for row in samples:
            by_split.setdefault(str(row.get("split", "train")), []).append(row)
        for split, rows in by_split.items():
            self.writer.add_text(f"samples/{split}", samples_markdown(rows, step=step), step)

    def log_alert(self, alert: dict[str, Any], step: int) -> None:
        self.writer.add_text("alerts", f"**{alert.get('rule')}**: {alert.get('message')}", step)
        self.writer.flush()

    def log_checkpoint(self, path: str, step: int, metadata: dict[str, Any]) -> None:
        self.writer.add_text("checkpoints", f"`{path}`", step)

    def finish(self) -> None:
        self.writer.close()


def write_histogram(writer: Any, tag: str, summary: dict[str, Any], step: int) -> None:
    """Write a ``histogram_summary`` (also the JSONL ``histogram`` row fields) as a TensorBoard histogram."""
    writer.add_histogram_raw(tag, min=summary["min"], max=summary["max"], num=summary["num"], sum=summary["sum"],
                             sum_squares=summary["sum_squares"], bucket_limits=summary["bucket_limits"],
                             bucket_counts=summary["bucket_counts"], global_step=step)

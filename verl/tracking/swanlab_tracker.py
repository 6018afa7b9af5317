"""SwanLab tracker (optional; ``pip install swanlab``).

Not part of the ``tracking`` extra: swanlab 0.10 pins ``protobuf<7``, which would downgrade the protobuf that
tensorboard, wandb and mlflow share, so it is installed only by those who use it (ideally in its own environment).
Project / run name follow ``trainer.project_name`` / ``trainer.experiment_name``; the mode comes from
``SWANLAB_MODE`` (``offline`` and ``local`` need no account). Runs are written to ``<run_dir>/swanlog``. Scalars,
the config, sampled generations (``swanlab.Text``) and alerts (text) are logged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from verl.tracking.base import Tracker
from verl.tracking.common import exiting_with_error, require, run_names, samples_markdown


class SwanlabTracker(Tracker):
    name = "swanlab"

    def __init__(self, config: Any = None, run_dir: str | Path | None = None, **_: Any):
        self.swanlab = require("swanlab", "swanlab", "swanlab")
        project, experiment = run_names(config, run_dir)
        self.run = self.swanlab.init(project=project, name=experiment,
                                     log_dir=str(Path(run_dir) / "swanlog") if run_dir else None, reinit=True)

    def log_config(self, config: dict[str, Any]) -> None:
        self.run.config.update(config)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if metrics:
            self.run.log(dict(metrics), step=step)

    def log_samples(self, samples: list[dict[str, Any]], step: int) -> None:
        by_split: dict[str, list[dict[str, Any]]] = {}
        for row in samples:
            by_split.setdefault(str(row.get("split", "train")), []).append(row)
        self.run.log({f"samples/{split}": self.swanlab.Text(samples_markdown(rows, step=step), caption=f"step {step}")
                      for split, rows in by_split.items()}, step=step)

    def log_alert(self, alert: dict[str, Any], step: int) -> None:
        self.run.log({"alerts": self.swanlab.Text(f"{alert.get('rule')}: {alert.get('message')}",
                                                  caption=f"step {step}")}, step=step)

    def finish(self) -> None:
        ending = exiting_with_error()
        self.run.finish(state={None: "success", "killed": "aborted", "failed": "crashed"}[ending])

"""Weights & Biases tracker.

``trainer.project_name`` -> wandb project, ``trainer.experiment_name`` -> run name, ``trainer.tracking.wandb``:
``entity``, ``group``, ``tags``, ``mode`` (online/offline/disabled; ``WANDB_MODE`` otherwise), ``log_artifacts``
(each checkpoint becomes a ``model`` artifact with aliases ``step-<N>`` and ``latest``). The resolved config is the
run config; sampled generations are ``wandb.Table``s (``samples/train``, ``samples/val``); alerts are wandb alerts
(e-mail/Slack in online mode) and rows of an ``alerts`` table. The run id is kept in ``<run_dir>/tracking.json``,
so a resumed verl run continues the same wandb run. Offline runs land in ``<run_dir>/wandb/`` (``wandb sync`` them).
Under a sweep agent (``configs/sweeps/``) the agent's run id, project and parameters apply.
"""

from __future__ import annotations

import netrc
import os
import re
import secrets
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from verl.errors import ConfigError
from verl.tracking.base import Tracker
from verl.tracking.common import SAMPLE_COLUMNS, RunIds, backend_settings, exiting_with_error, require, run_names

ALERT_COLUMNS = ("step", "rule", "severity", "message", "value", "threshold", "action")


def _logged_in() -> bool:
    """Whether online wandb has credentials: ``WANDB_API_KEY`` or a netrc entry for the wandb host."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
    try:  # wandb's own reader knows its netrc location rules; its module path moves between releases
        from wandb.sdk.lib.wbauth import read_netrc_auth

        return bool(read_netrc_auth(host=host))
    except ImportError:
        path = os.environ.get("NETRC") or str(Path.home() / ".netrc")
        try:
            return netrc.netrc(path).authenticators(urlsplit(host).netloc) is not None
        except (OSError, netrc.NetrcParseError):
            return False


def preflight(config: Any = None) -> None:
    """Fail before the run directory exists when wandb cannot start: package missing, or online with no login."""
    require("wandb", "wandb", "wandb")
    settings = backend_settings(config, "wandb")
    mode = settings.mode or os.environ.get("WANDB_MODE") or "online"
    if mode in ("offline", "disabled", "dryrun") or os.environ.get("WANDB_DISABLED", "").lower() in ("1", "true"):
        return
    if not _logged_in():
        raise ConfigError(
            "trainer.logger has wandb in online mode, but wandb is not logged in: run `wandb login` (or set "
            "WANDB_API_KEY), or log locally with WANDB_MODE=offline (or trainer.tracking.wandb.mode=offline) "
            "and `wandb sync` the run later"
        )


class WandbTracker(Tracker):
    name = "wandb"

    def __init__(self, config: Any = None, run_dir: str | Path | None = None, **_: Any):
        self.wandb = require("wandb", "wandb", "wandb")
        self.settings = backend_settings(config, "wandb")
        project, experiment = run_names(config, run_dir)
        self.experiment = experiment
        ids = RunIds(run_dir) if run_dir else None
        # A sweep agent (or the user) assigns the run id through WANDB_RUN_ID; otherwise reuse this run's own id.
        run_id = (os.environ.get("WANDB_RUN_ID") or (ids.get("wandb") if ids else None)
                  or secrets.token_hex(4))  # wandb ids: short, lowercase
        self.run = self.wandb.init(project=project, name=experiment, group=self.settings.group,
                                   entity=self.settings.entity, tags=self.settings.tags or None,
                                   dir=str(run_dir) if run_dir else None, id=run_id, resume="allow",
                                   mode=self.settings.mode, reinit="create_new")
        if ids is not None:
            ids.set("wandb", run_id)
        self.sample_rows: dict[str, list[list[Any]]] = {}
        self.alert_rows: list[list[Any]] = []

    def log_config(self, config: dict[str, Any]) -> None:
        self.run.config.update(config, allow_val_change=True)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if metrics:
            self.run.log(metrics, step=step)

    def log_histograms(self, values: dict[str, list[float]], step: int) -> None:
        logged = {}
        for tag, data in values.items():
            array = np.asarray(data, dtype=np.float64)
            array = array[np.isfinite(array)]
            if array.size:
                logged[tag] = self.wandb.Histogram(array)
        if logged:
            self.run.log(logged, step=step)

    def log_samples(self, samples: list[dict[str, Any]], step: int) -> None:
        touched = set()
        for row in samples:
            split = str(row.get("split", "train"))
            rows = self.sample_rows.setdefault(split, [])
            rows.append([step if c == "step" else row.get(c, "") for c in SAMPLE_COLUMNS])
            # Keep the newest rows: a logged table is immutable, so each step logs the whole (bounded) table.
            del rows[: max(0, len(rows) - self.settings.max_sample_rows)]
            touched.add(split)
        if touched:
            self.run.log({f"samples/{split}": self.wandb.Table(columns=list(SAMPLE_COLUMNS),
                                                               data=self.sample_rows[split])
                          for split in touched}, step=step)

    def log_alert(self, alert: dict[str, Any], step: int) -> None:
        self.alert_rows.append([step, *(alert.get(c) for c in ALERT_COLUMNS[1:])])
        self.alert_rows = [[str(v) if v is not None else "" for v in row] for row in self.alert_rows]
        self.run.log({"alerts": self.wandb.Table(columns=list(ALERT_COLUMNS), data=self.alert_rows)}, step=step)
        level = self.wandb.AlertLevel.ERROR if alert.get("severity") == "critical" else self.wandb.AlertLevel.WARN
        try:
            self.run.alert(title=f"verl {self.experiment}: {alert.get('rule')}", text=str(alert.get("message")),
                           level=level)
        except Exception as exc:  # a notification that cannot be sent must not stop training
            self.run.log({"alerts/send_error": str(exc)}, step=step)

    def log_checkpoint(self, path: str, step: int, metadata: dict[str, Any]) -> None:
        if not self.settings.log_artifacts:
            return
        name = re.sub(r"[^A-Za-z0-9._-]", "-", f"{self.experiment}-model")
        artifact = self.wandb.Artifact(name=name, type="model",
                                       metadata={"step": step, "path": path, **{k: v for k, v in metadata.items()
                                                                                if isinstance(v, (int, float))}})
        artifact.add_dir(path)
        self.run.log_artifact(artifact, aliases=[f"step-{step}", "latest"])

    def finish(self) -> None:
        ending = exiting_with_error()
        self.run.finish(exit_code=0 if ending is None else (255 if ending == "killed" else 1))

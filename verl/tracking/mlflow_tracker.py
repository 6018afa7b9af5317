"""MLflow tracker (through ``MlflowClient``, so no process-global "active run" is touched).

Store: ``trainer.tracking.mlflow.tracking_uri``, else ``$MLFLOW_TRACKING_URI``, else
``sqlite:///<output_dir>/mlflow.db`` with artifacts in ``<output_dir>/mlartifacts`` (MLflow 3 keeps the plain
``./mlruns`` file store in maintenance mode). Experiment: ``trainer.tracking.mlflow.experiment_name`` or
``trainer.project_name``; run name: ``trainer.experiment_name``. Logged: the flattened config as params, every
metric with its step, sampled generations as JSON artifacts (``samples/<split>/step_<N>.json`` as they come, and
one ``samples.json`` table at the end), alerts as ``alerts.json`` plus an ``alerts/count`` metric, and the latest
checkpoint path as a tag. Browse with ``mlflow ui --backend-store-uri sqlite:///outputs/mlflow.db``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from verl.tracking.base import Tracker
from verl.tracking.common import RunIds, backend_settings, exiting_with_error, flatten_config, require, run_names

MAX_PARAM_VALUE = 6000  # MLflow's limit on a param value's length
BATCH_PARAMS = 100  # MLflow's limit on params per log_batch call
BATCH_METRICS = 1000


def default_tracking_uri(config: Any, run_dir: str | Path | None) -> str:
    output_dir = getattr(getattr(config, "trainer", None), "output_dir", None)
    root = Path(output_dir) if output_dir else (Path(run_dir).parent.parent if run_dir else Path("outputs"))
    root.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{root.resolve() / 'mlflow.db'}"


def sqlite_artifact_location(uri: str) -> str | None:
    """For a sqlite store, keep artifacts next to the database (MLflow's default is ./mlartifacts in the CWD)."""
    if not uri.startswith("sqlite:///"):
        return None
    db = Path(uri.removeprefix("sqlite:///"))
    return (db.parent / "mlartifacts").resolve().as_uri()


class MlflowTracker(Tracker):
    name = "mlflow"

    def __init__(self, config: Any = None, run_dir: str | Path | None = None, **_: Any):
        require("mlflow", "mlflow", "mlflow")
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        settings = backend_settings(config, "mlflow")
        project, experiment = run_names(config, run_dir)
        self.tracking_uri = settings.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri(
            config, run_dir)
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        experiment_name = settings.experiment_name or project
        found = self.client.get_experiment_by_name(experiment_name)
        if found is None:
            try:
                experiment_id = self.client.create_experiment(
                    experiment_name, artifact_location=sqlite_artifact_location(self.tracking_uri))
            except MlflowException:  # another run created it between our lookup and create
                experiment_id = self.client.get_experiment_by_name(experiment_name).experiment_id
        else:
            experiment_id = found.experiment_id
        self.experiment_id = experiment_id
        ids = RunIds(run_dir) if run_dir else None
        self.run_id = self._resume_run(ids.get("mlflow") if ids else None)
        if self.run_id is None:
            run = self.client.create_run(experiment_id, run_name=experiment,
                                         tags={"verl.run_dir": str(Path(run_dir).resolve()) if run_dir else ""})
            self.run_id = run.info.run_id
        if ids is not None:
            ids.set("mlflow", self.run_id)
        self.samples: list[dict[str, Any]] = []
        self.alerts: list[dict[str, Any]] = []

    def _resume_run(self, run_id: str | None) -> str | None:
        if not run_id:
            return None
        from mlflow.exceptions import MlflowException

        try:
            run = self.client.get_run(run_id)
        except MlflowException:
            return None  # the store was moved or wiped: start a new run
        if run.info.experiment_id != self.experiment_id:
            return None
        self.client.update_run(run_id, status="RUNNING")
        return run_id

    def log_config(self, config: dict[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException

        existing = self.client.get_run(self.run_id).data.params
        params = [Param(k, str(v)[:MAX_PARAM_VALUE]) for k, v in flatten_config(config).items()
                  if k not in existing]  # a resumed run keeps its first params; MLflow forbids changing them
        for start in range(0, len(params), BATCH_PARAMS):
            try:
                self.client.log_batch(self.run_id, params=params[start:start + BATCH_PARAMS])
            except MlflowException as exc:
                self.client.set_tag(self.run_id, "verl.param_error", str(exc)[:500])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(key, float(value), now, step) for key, value in metrics.items()]
        for start in range(0, len(batch), BATCH_METRICS):
            self.client.log_batch(self.run_id, metrics=batch[start:start + BATCH_METRICS])

    def log_samples(self, samples: list[dict[str, Any]], step: int) -> None:
        by_split: dict[str, list[dict[str, Any]]] = {}
        for row in samples:
            by_split.setdefault(str(row.get("split", "train")), []).append(row)
            self.samples.append({"step": step, **row})
        for split, rows in by_split.items():
            self.client.log_dict(self.run_id, {"step": step, "split": split, "samples": rows},
                                 f"samples/{split}/step_{step:06d}.json")

    def log_alert(self, alert: dict[str, Any], step: int) -> None:
        self.alerts.append({"step": step, **alert})
        self.client.log_dict(self.run_id, self.alerts, "alerts.json")
        self.log_metrics({"alerts/count": float(len(self.alerts))}, step)

    def log_checkpoint(self, path: str, step: int, metadata: dict[str, Any]) -> None:
        self.client.set_tag(self.run_id, "verl.latest_checkpoint", path)

    def finish(self) -> None:
        if self.samples:
            columns = list(dict.fromkeys(key for row in self.samples for key in row))
            table = {"columns": columns, "data": [[row.get(c) for c in columns] for row in self.samples]}
            self.client.log_dict(self.run_id, table, "samples.json")
        ending = exiting_with_error()
        status = {None: "FINISHED", "killed": "KILLED", "failed": "FAILED"}[ending]
        self.client.set_terminated(self.run_id, status=status)

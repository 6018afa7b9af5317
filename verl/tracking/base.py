"""The tracker interface, the registry, and the fan-out the trainer talks to.

``trainer.logger=[console,jsonl,tensorboard,wandb,mlflow,swanlab]`` names trackers; ``jsonl`` (always on) is the
run logger's ``verl_logs.jsonl``. Every backend is created at run start, so a missing package fails before the first
step with the install command, never mid-run. A new backend is a ``Tracker`` subclass (or factory) registered with
``@register_tracker("name")``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from verl.errors import ConfigError
from verl.registry import Registry, load_target
from verl.tracking.common import require


class Tracker:
    """One experiment-tracking backend. Metric keys are ``scope/name``."""

    name = "base"

    def log_config(self, config: dict[str, Any]) -> None:
        """Record the run's resolved config / hyper-parameters."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Record the numeric metrics of one step."""

    def log_samples(self, samples: list[dict[str, Any]], step: int) -> None:
        """Record sampled generations: dicts with prompt, response, ground_truth, score."""

    def log_histograms(self, values: dict[str, list[float]], step: int) -> None:
        """Record distributions (rewards, advantages, response lengths)."""

    def log_alert(self, alert: dict[str, Any], step: int) -> None:
        """Record a health alert."""

    def log_checkpoint(self, path: str, step: int, metadata: dict[str, Any]) -> None:
        """Record that a checkpoint was written."""

    def finish(self) -> None:
        """Flush and close."""


# Every entry is a Tracker class or factory called with the run's context keywords (``create_trackers``). The
# built-in backends are imported only when a run names them, so their (heavy, optional) packages load only for runs
# that use them, and this module imports none of them (they import it).
TRACKERS: Registry[Callable[..., Tracker]] = Registry("tracker", key="trainer.logger")
for _name, _target in {"console": "verl.tracking.backends:ConsoleTracker",
                       "jsonl": "verl.tracking.backends:JsonlTracker",
                       "tensorboard": "verl.tracking.tensorboard_tracker:TensorBoardTracker",
                       "wandb": "verl.tracking.wandb_tracker:WandbTracker",
                       "mlflow": "verl.tracking.mlflow_tracker:MlflowTracker",
                       "swanlab": "verl.tracking.swanlab_tracker:SwanlabTracker"}.items():
    TRACKERS.lazy(_name, _target)


def register_tracker(name: str) -> Callable[[Callable[..., Tracker]], Callable[..., Tracker]]:
    """Register a Tracker class or factory as ``trainer.logger=[NAME]``; a taken name raises."""
    return TRACKERS.register(name)


# Checks that need no run directory, run before one is made: "module:function(config)", or the (module, package)
# a tracker needs installed.
PREFLIGHTS = {"wandb": "verl.tracking.wandb_tracker:preflight", "mlflow": ("mlflow", "mlflow"),
              "tensorboard": ("torch.utils.tensorboard", "tensorboard"), "swanlab": ("swanlab", "swanlab")}


def _check_names(names: list[str]) -> None:
    known = set(TRACKERS)
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ConfigError(
            f"trainer.logger: unknown tracker(s) {unknown}; available: {', '.join(sorted(known))} "
            "(e.g. trainer.logger=[console,jsonl,tensorboard])"
        )


def check_trackers(names: list[str], config: Any = None) -> None:
    """Everything about the named trackers that can fail without a run: unknown names, missing packages, no
    wandb login. The trainer calls this before it creates the run directory, so such a failure leaves nothing."""
    _check_names(names)
    for name in dict.fromkeys(names):
        check = PREFLIGHTS.get(name)
        if isinstance(check, str):
            load_target(check)(config)
        elif check is not None:
            require(*check, name)


def create_trackers(names: list[str], **context: Any) -> list[Tracker]:
    """Instantiate the named trackers, all of them now, so a missing package fails before the first step.

    ``context`` carries what backends may need: ``config`` (the run's config model), ``run_dir``,
    ``total_steps``, ``quiet``, ``resumed_step`` (the checkpoint step a resumed run continues from). ``jsonl``
    maps to a tracker that adds histogram rows to the run's JSONL
    (its metric rows are written by the run logger itself).
    """
    _check_names(names)
    trackers: list[Tracker] = []
    try:
        for name in dict.fromkeys(names):  # a name given twice would log every point twice
            trackers.append(TRACKERS[name](**context))
    except BaseException:
        for tracker in trackers:  # e.g. close a wandb run already started when mlflow is missing
            tracker.finish()
        raise
    return trackers

"""What a resumed run runs with: the run's own ``config.yaml``, with the keys given on this command on top.

``verl train trainer.experiment_name=ppo-a trainer.resume=auto`` continues run ``ppo-a`` as it was configured:
its saved ``config.yaml`` is the base, and only the keys this command gives (its ``--config`` file and its
``key=value`` overrides) change it. The changes are listed in one line. A change that makes the checkpoint mean
something else (another algorithm, model, critic on/off, batch shape, data) is refused with one line naming the
keys, unless ``trainer.resume_allow_changes=true`` is given on that command.

The same check runs again when ``fit()`` starts, so a ``VerlConfig`` built in Python is held to it too.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verl.config import (
    TrainerConfig,
    VerlConfig,
    build_config,
    explicit_settings,
    flatten,
    load_config,
    load_yaml,
    set_dotted,
)
from verl.errors import ConfigError
from verl.trainer.checkpoint import find_resume_checkpoint

CONFIG_FILE = "config.yaml"
ALLOW_KEY = "trainer.resume_allow_changes"

# Keys whose change makes the saved weights, optimizer state or data position mean something else. A dotted
# prefix covers the keys under it. Everything else (total_steps, learning rate, loggers, save/test cadence ...)
# may change on resume.
NOT_RESUMABLE = ("algorithm.adv_estimator", "model.path", "model.tokenizer_path", "model.dtype", "model.lora",
                 "critic.model_path", "data.train_files", "data.train_batch_size", "data.max_prompt_length",
                 "data.max_response_length", "rollout.n", "actor.ppo_mini_batch_size", "actor.strategy",
                 "trainer.executor", "trainer.n_workers")


@dataclass
class ResumeInfo:
    """A resume found at config-load time: the checkpoint and the keys this command changed."""

    run_dir: Path
    checkpoint: Path
    changes: list[tuple[str, Any, Any]] = field(default_factory=list)

    def summary(self) -> str:
        """The one line a user sees before a resumed run starts."""
        head = f"resuming {self.run_dir} from {self.checkpoint.name} with its {CONFIG_FILE}"
        if not self.changes:
            return head + "; no keys changed"
        return head + "; changed: " + ", ".join(f"{k} {old!r} -> {new!r}" for k, old, new in self.changes)


def config_changes(saved: VerlConfig, new: VerlConfig) -> list[tuple[str, Any, Any]]:
    """``(key, saved value, new value)`` for every key that differs, in schema order."""
    before = flatten(saved.model_dump(mode="json"))
    after = flatten(new.model_dump(mode="json"))
    return [(k, before.get(k), after[k]) for k in after if k != ALLOW_KEY and before.get(k) != after[k]]


def refused_changes(saved: VerlConfig, new: VerlConfig, changes: list[tuple[str, Any, Any]]) -> list[str]:
    refused = [k for k, _, _ in changes if any(k == p or k.startswith(p + ".") for p in NOT_RESUMABLE)]
    if saved.use_critic != new.use_critic:
        refused.append(f"critic {'on' if saved.use_critic else 'off'} -> {'on' if new.use_critic else 'off'}")
    return refused


def check_resumable(run_dir: Path, saved: VerlConfig, new: VerlConfig) -> list[tuple[str, Any, Any]]:
    """The changes from ``saved`` to ``new``; raises ``ConfigError`` for a change a checkpoint cannot take."""
    changes = config_changes(saved, new)
    refused = refused_changes(saved, new, changes)
    if refused and not new.trainer.resume_allow_changes:
        detail = {k: (old, value) for k, old, value in changes}
        named = ", ".join(f"{k} ({detail[k][0]!r} -> {detail[k][1]!r})" if k in detail else k for k in refused)
        raise ConfigError(
            f"cannot resume {run_dir}: this command changes {named}, which its checkpoints were not trained with; "
            f"start a new run (another trainer.experiment_name), or pass {ALLOW_KEY}=true to resume anyway"
        )
    return changes


def saved_config(run_dir: Path) -> VerlConfig | None:
    """The run's own config, or None when the run has none yet."""
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        return None
    return build_config(load_yaml(path), str(path))


def load_train_config(path: str | Path | None = None,
                      overrides: list[str] | None = None) -> tuple[VerlConfig, ResumeInfo | None]:
    """The config ``verl train`` runs with: the given one for a new run; for a resume, the run's ``config.yaml``
    with this command's explicit keys on top (checked with ``check_resumable``).

    The command's keys are only validated merged: ``data.train_batch_size=2`` alone may not divide the default
    mini-batch, yet be right on top of the run's own config.
    """
    explicit = explicit_settings(path, overrides)
    defaults = TrainerConfig.model_fields
    resume = explicit.get("trainer.resume", defaults["resume"].default)
    name = explicit.get("trainer.experiment_name")
    if name and resume != "disable":
        run_dir = (Path(str(explicit.get("trainer.output_dir", defaults["output_dir"].default)))
                   / str(explicit.get("trainer.project_name", defaults["project_name"].default)) / str(name))
        checkpoint = find_resume_checkpoint(run_dir, str(resume))
        saved = saved_config(run_dir) if checkpoint is not None else None
        if saved is not None:
            merged = copy.deepcopy(saved.model_dump(mode="json"))
            set_dotted(merged, ALLOW_KEY, False)  # never carried over from an earlier resume
            for key, value in explicit.items():
                set_dotted(merged, key, value)
            resumed = build_config(merged, f"{run_dir / CONFIG_FILE} + this command's keys")
            changes = check_resumable(run_dir, saved, resumed)
            return resumed, ResumeInfo(run_dir, checkpoint, changes)
    return load_config(path, overrides), None

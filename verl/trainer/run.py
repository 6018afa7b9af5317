"""A training run's outputs, which every trainer shares (``verl train``'s ``PPOTrainer``, ``verl sft``, ``verl rm``).

``Run`` owns the run directory (``trainer.output_dir / project / experiment``), the config snapshot
(``config.yaml``), the trackers ``trainer.logger`` names and the JSONL logger (``verl_logs.jsonl``), the
checkpoints written into ``checkpoints/`` and the time-to-target clock (``trainer.target``, verl/trainer/target.py).
Its life: ``open`` (the directory, the snapshot, the trackers and the logger; leftovers of checkpoints a killed run
was writing removed), ``bound`` around ``fit`` (``log.info`` from callbacks, reward functions and tools writes into
this run's rows: a context variable, ``verl.utils.log``), then ``close`` (trackers finished, the log closed), also
after a start-up failure part-way through ``open``.

The layout is what every other command reads (``verl eval`` on a run, ``verl compare``, the dashboard, resume).
"""

from __future__ import annotations

import contextlib
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from verl.config import dump_config
from verl.models.loader import load_tokenizer, pick_device
from verl.tracking import create_trackers
from verl.trainer.checkpoint import (
    checkpoint_step,
    find_resume_checkpoint,
    remove_stale_temp_dirs,
    save_checkpoint,
    write_checkpoint,
)
from verl.trainer.resume import check_resumable, saved_config
from verl.trainer.target import TARGET_SCOPE, Target, TargetClock
from verl.utils import log
from verl.utils.fs import atomic_write_text, ensure_writable_dir
from verl.utils.seeding import seed_everything, set_num_threads


def set_up(config: Any) -> tuple[Any, Any]:
    """The start a one-model trainer makes (``verl sft``, ``verl rm``): ``trainer.num_threads`` and ``trainer.seed``
    applied, then (the torch device, the tokenizer of ``model.tokenizer_path`` or ``model.path``)."""
    set_num_threads(config.trainer.num_threads)
    seed_everything(config.trainer.seed)
    return pick_device(config.trainer.device), load_tokenizer(config.model.tokenizer_path or config.model.path)


class Run:
    """One run's directory, config snapshot, trackers and logger (see the module docstring). ``config``: a
    ``VerlConfig``, ``SFTConfig`` or ``RMConfig`` (each has ``run_dir()``, ``log_path()`` and ``trainer``)."""

    def __init__(self, config: Any, quiet: bool = False):
        self.config, self.quiet = config, quiet
        self.dir: Path = config.run_dir()
        self.trackers: list[Any] = []
        self.logger: log.RunLogger | None = None
        target = getattr(config.trainer, "target", None)  # PPO's; SFT and RM have none
        self.clock = TargetClock(Target.parse(target) if target else None)

    def open(self, resumed_step: int | None = None) -> Run:
        """Create (or reopen) the directory — a clear error when it cannot be written — write ``config.yaml`` and
        start the trackers and the logger. ``resumed_step``: the checkpoint step a resumed run continues from."""
        cfg = self.config
        ensure_writable_dir(self.dir, "the run directory (trainer.output_dir)")
        remove_stale_temp_dirs(self.dir)
        atomic_write_text(self.dir / "config.yaml", dump_config(cfg))
        self.trackers = create_trackers(cfg.trainer.logger, total_steps=cfg.trainer.total_steps, quiet=self.quiet,
                                        config=cfg, run_dir=self.dir, resumed_step=resumed_step)
        self.logger = log.RunLogger(cfg.log_path(), self.trackers, cfg.trainer.log_level)
        return self

    def resume_point(self) -> tuple[Path | None, list[tuple[str, Any, Any]]]:
        """The checkpoint ``trainer.resume`` continues from (None: a new run) and the keys this run changes from the
        run's own ``config.yaml`` (refusing what a checkpoint cannot take)."""
        resume_from = find_resume_checkpoint(self.dir, self.config.trainer.resume)
        saved = saved_config(self.dir) if resume_from is not None else None
        return resume_from, check_resumable(self.dir, saved, self.config) if saved is not None else []

    @contextlib.contextmanager
    def opening(self, resume_from: Path | None) -> Iterator[Run]:
        """``open`` for a run resumed from ``resume_from`` (or new), then the caller's own start-up inside the block;
        a failure in either closes what was opened and removes a directory this made, so nothing half-made stays."""
        fresh = not self.dir.exists()
        try:
            self.open(resumed_step=None if resume_from is None else checkpoint_step(resume_from))
            yield self
        except BaseException:
            self.close()
            if fresh:
                shutil.rmtree(self.dir, ignore_errors=True)
            raise

    @contextlib.contextmanager
    def bound(self) -> Iterator[log.RunLogger]:
        """``verl.utils.log``'s module functions write to this run's logger inside the block (``fit``)."""
        token = log.bind(self.logger)
        try:
            yield self.logger
        finally:
            log.unbind(token)

    def save_checkpoint(self, step: int, model: Any, tokenizer: Any, state: dict[str, Any],
                        metrics: dict[str, float] | None = None) -> Path:
        """``checkpoints/global_step_<step>``: one model (HF layout), its tokenizer, ``state`` and ``metrics``
        (``latest`` points at it). The policy trainer's roles write their own parts (``write_checkpoint``)."""
        return save_checkpoint(self.dir, step, model, tokenizer, state, metrics)

    def checkpoint(self, step: int, write_parts: Callable[[Path], None], state: dict[str, Any],
                   metrics: dict[str, float]) -> Path:
        """A checkpoint whose parts ``write_parts`` writes (the policy trainer's roles), ``latest`` pointing at it
        and the oldest beyond ``trainer.max_ckpt_to_keep`` removed; logged as a ``train`` event and to trackers."""
        path = write_checkpoint(self.dir, step, write_parts, state, metrics, self.config.trainer.max_ckpt_to_keep)
        self.logger.event("train", step=step, checkpoint=str(path))
        for tracker in self.trackers:
            tracker.log_checkpoint(str(path), step, metrics)
        return path

    def reach_target(self, step: int, metrics: dict[str, float]) -> dict[str, Any] | None:
        """The time-to-target record the first time ``metrics`` reach ``trainer.target``, logged (one ``target`` row
        in verl_logs.jsonl, which verl compare and the dashboard read; its numbers to the trackers); else None."""
        record = self.clock.check(step, metrics)
        if record is not None:
            self.logger.log_step(step, {f"{TARGET_SCOPE}/{k}": v for k, v in record.items() if k != "step"})
            if not self.quiet:
                print(f"target {record['target']} reached at step {step} ({record['metric']} = "
                      f"{record['value']:.4g}): {record['minutes']:.2f} min of training to that step's update, "
                      f"validation {record['validation_seconds']:.1f} s apart", file=sys.stderr, flush=True)
        return record

    def clock_state(self) -> dict[str, Any]:
        """The clock's part of a checkpoint's trainer state (nothing without a target)."""
        return {"target_clock": self.clock.state_dict()} if self.clock.target is not None else {}

    def load_clock_state(self, state: dict[str, Any]) -> None:
        if self.clock.target is not None and "target_clock" in state:
            self.clock.load_state_dict(state["target_clock"])

    def close(self) -> None:
        """Finish the trackers and close the log (idempotent; what ``open`` got to, after a failure in it)."""
        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []
        if self.logger is not None:
            self.logger.close()

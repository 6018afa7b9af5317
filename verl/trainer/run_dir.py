"""A one-model run's directory and log (``verl sft``, ``verl rm``): the layout every other command reads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from verl.config import dump_config
from verl.tracking import create_trackers
from verl.utils import log
from verl.utils.fs import atomic_write_text, ensure_writable_dir


def open_run(config: Any, quiet: bool) -> tuple[Path, log.RunLogger]:
    """Create ``config.run_dir()`` (a clear error when it cannot be written), write its ``config.yaml``, and start
    the run's logger with the trackers ``trainer.logger`` names. ``config``: an ``SFTConfig`` or ``RMConfig``."""
    run_dir = config.run_dir()
    ensure_writable_dir(run_dir, "the run directory (trainer.output_dir)")
    atomic_write_text(run_dir / "config.yaml", dump_config(config))
    trackers = create_trackers(config.trainer.logger, total_steps=config.trainer.total_steps, quiet=quiet,
                               config=config, run_dir=run_dir)
    return run_dir, log.RunLogger(config.log_path(), trackers, config.trainer.log_level)

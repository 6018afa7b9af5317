"""``verl tensorboard``: convert ``verl_logs.jsonl`` into TensorBoard event files, following it as it grows.

    verl tensorboard --log_dir outputs/verl/my-run --tb_dir tb_logs/my-run --interval 30
    tensorboard --logdir tb_logs

Every ``interval`` seconds the new complete rows are converted: numeric fields of metric rows become scalars
(``scope/name``, the tags the live TensorBoard tracker uses), ``histogram`` rows become histograms, ``sample`` rows
become a Markdown table per step and split (``samples/train``, ``samples/val``), ``alert`` rows become text
(``alerts``). The byte offset reached is saved in ``<tb_dir>/.verl_tb_state.json`` after the events are flushed, so
a restarted converter continues where it stopped and never writes a point twice. Ctrl-C (or SIGTERM) converts
what is complete, closes the event file and exits 0.
"""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from verl.errors import ConfigError
from verl.tracking.common import require, samples_markdown
from verl.tracking.follow import LogFollower, resolve_log_path, row_kind, row_metrics
from verl.tracking.tensorboard_tracker import write_histogram
from verl.utils.fs import atomic_write_json

STATE_FILE = ".verl_tb_state.json"


class TensorBoardConverter:
    """Incremental JSONL -> TensorBoard conversion with a persisted read offset (see the module docstring)."""

    def __init__(self, log_path: str | Path, tb_dir: str | Path):
        tb = require("torch.utils.tensorboard", "tensorboard", "verl tensorboard (the converter)")
        self.log_path = Path(log_path).resolve()
        self.tb_dir = Path(tb_dir)
        self.state_path = self.tb_dir / STATE_FILE
        state = self._load_state()
        if state and state.get("source") != str(self.log_path):
            raise ConfigError(
                f"--tb_dir {self.tb_dir} already holds the conversion of {state.get('source')}; converting "
                f"{self.log_path} there would mix two runs: pick another --tb_dir (one per run)"
            )
        self.follower = LogFollower(self.log_path, int(state.get("offset", 0)) if state else 0)
        self.counts = {k: int(v) for k, v in (state or {}).get("counts", {}).items()}
        self.tb_dir.mkdir(parents=True, exist_ok=True)
        self._summary_writer_cls = tb.SummaryWriter
        self._writer: Any = None
        self.finished = False

    @property
    def writer(self) -> Any:
        # Opened on first use: a pass that finds nothing new leaves no empty event file behind.
        if self._writer is None:
            self._writer = self._summary_writer_cls(str(self.tb_dir), flush_secs=3600)  # flushed before each save
        return self._writer

    def _load_state(self) -> dict[str, Any] | None:
        if not self.state_path.is_file():
            return None
        try:
            state = json.loads(self.state_path.read_text())
        except ValueError:
            raise ConfigError(f"{self.state_path} is corrupt; delete it (and the event files next to it) to "
                              "convert the log again from the start") from None
        return state if isinstance(state, dict) else None

    def _count(self, kind: str, n: int = 1) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + n

    def _write_samples(self, key: tuple[int, str], rows: list[dict[str, Any]], written: dict[str, int]) -> None:
        step, split = key
        self.writer.add_text(f"samples/{split}", samples_markdown(rows, step=step), step)
        written["texts"] = written.get("texts", 0) + 1
        self._count("texts")

    def convert(self, final: bool = False) -> dict[str, int]:
        """Convert the rows appended since the last call; returns how many items of each kind were written.

        Sample rows of the step at the end of the log are held back (the trainer may still be adding to that
        table) unless ``final`` or the run has finished; the saved offset then points at their start.
        """
        rows, truncated = self.follower.poll()
        if truncated:
            self._count("restarts")
        written: dict[str, int] = {}

        def count(kind: str) -> None:
            written[kind] = written.get(kind, 0) + 1
            self._count(kind)

        commit = self.follower.offset
        group_key: tuple[int, str] | None = None  # the (step, split) table being collected
        group: list[dict[str, Any]] = []
        group_start = commit
        for start, _end, row in rows:
            kind = row_kind(row)
            step = int(row.get("step", 0) or 0)
            if kind == "sample":
                key = (step, str(row.get("split", "train")))
                if key != group_key and group_key is not None:
                    self._write_samples(group_key, group, written)
                    group = []
                if not group:
                    group_key, group_start = key, start
                group.append(row)
                continue
            if group_key is not None:
                self._write_samples(group_key, group, written)
                group, group_key = [], None
            if kind == "metrics":
                for tag, value in row_metrics(row).items():
                    self.writer.add_scalar(tag, value, step)
                    count("scalars")
            elif kind == "histogram" and isinstance(row.get("bucket_counts"), list):
                write_histogram(self.writer, str(row.get("tag", "histogram")), row, step)
                count("histograms")
            elif kind == "alert":
                self.writer.add_text("alerts", f"**{row.get('rule')}**: {row.get('message')}", step)
                count("texts")
            elif kind == "event" and row.get("status") == "finished":
                self.finished = True
        if group_key is not None:
            if final or self.finished:
                self._write_samples(group_key, group, written)
            else:
                commit = group_start  # re-read these rows next time, when the table is complete
                self.follower.offset = group_start
        if self._writer is not None:
            self._writer.flush()
        atomic_write_json(self.state_path, {"source": str(self.log_path), "offset": commit, "counts": self.counts})
        return written

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def follow(log_path: str | Path, tb_dir: str | Path, interval: float = 30.0, once: bool = False,
           report: Callable[[str], None] | None = None) -> TensorBoardConverter:
    """Convert now, then every ``interval`` seconds until Ctrl-C/SIGTERM (or at once with ``once``).

    ``log_path`` is a run directory, a ``--log_dir`` of ``verl train``, or the ``verl_logs.jsonl`` itself.
    """
    if interval <= 0:
        raise ConfigError(f"--interval must be > 0 seconds, got {interval}")
    log_path = resolve_log_path(log_path, must_exist=once)
    converter = TensorBoardConverter(log_path, tb_dir)
    stop = threading.Event()
    previous = None
    previous_int = None
    if threading.current_thread() is threading.main_thread():
        # SIGTERM (e.g. from a process manager) and Ctrl-C only set the stop flag: a KeyboardInterrupt raised in
        # the middle of an event-file write could leave the writer's lock held and hang the final close.
        previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
        previous_int = signal.signal(signal.SIGINT, lambda *_: stop.set())
    waiting_reported = False
    try:
        while True:
            if not log_path.is_file() and not waiting_reported and report:
                report(f"waiting for {log_path} to appear ...")
                waiting_reported = True
            written = converter.convert(final=once)
            if written and report:
                report(f"{converter.log_path.name}: +" + ", +".join(f"{n} {k}" for k, n in sorted(written.items()))
                       + f" (offset {converter.follower.offset})")
            if once or stop.wait(interval):
                break
    except KeyboardInterrupt:
        pass  # Ctrl-C: fall through to the final pass and a clean close
    finally:
        try:
            converter.convert(final=False)
        finally:
            converter.close()
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            if previous_int is not None:
                signal.signal(signal.SIGINT, previous_int)
    return converter

"""Time to target (``trainer.target``): the wall time until the model first reaches a quality mark.

MLPerf's training benchmarks measure time-to-train: from the start of the run to the first evaluation that reaches
the target, with the evaluation's own time left out. Here the clock is read at each step's weight update
(``mark_update``); validation time (every ``validate`` call, the one before training included) is subtracted and
reported apart. A target on a validation metric (``eval/accuracy:0.25``) is judged on the step whose checkpoint was
validated, so its time is that step's update, not the end of the validation that found it. A target on a
training metric (``rollout/reward_mean:0.8``) is judged as soon as the step logs it.

Spelling: ``METRIC:VALUE`` (reached when the metric is >= VALUE) or ``METRIC:VALUE:min`` (<= VALUE, e.g. a loss).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from verl.utils.target_spec import Target

TARGET_SCOPE = "target"  # the verl_logs.jsonl event written when the target is first reached


class TargetClock:
    """Training wall time counted to each step's update, validation excluded; the first step to reach the target.

    ``now`` is injectable for tests. State survives a resume (``state_dict``): time spent before the resume counts.
    With no target (``None``) it keeps time and never reports one reached.
    """

    def __init__(self, target: Target | None, now: Any = time.perf_counter):
        self.target, self.now = target, now
        self.started: float | None = None
        self.carried = 0.0  # seconds (validation included) from before a resume
        self.validation_seconds = 0.0
        self.update_seconds: dict[int, float] = {}  # step -> training seconds at its update (validation excluded)
        self.reached: dict[str, Any] | None = None

    def start(self) -> None:
        self.started = self.now()

    def wall_seconds(self) -> float:
        return self.carried + (self.now() - self.started if self.started is not None else 0.0)

    def add_validation(self, seconds: float) -> None:
        self.validation_seconds += seconds

    def mark_update(self, step: int) -> float:
        """The step's weights are updated: record its training time (wall time so far minus validation)."""
        seconds = self.wall_seconds() - self.validation_seconds
        self.update_seconds[step] = seconds
        return seconds

    def check(self, step: int, metrics: dict[str, Any]) -> dict[str, Any] | None:
        """The target record the first time ``metrics`` (step ``step``'s logged ones) reach it; else None."""
        if self.target is None or self.reached is not None or self.target.metric not in metrics:
            return None
        value = metrics[self.target.metric]
        if not isinstance(value, (int, float)) or not self.target.reached(float(value)):
            return None
        # A step never updated (the validation before training) reached it at no training time at all.
        seconds = self.update_seconds.get(step, 0.0)
        self.reached = {"target": self.target.spec, "metric": self.target.metric, "threshold": self.target.value,
                        "mode": self.target.mode, "value": float(value), "step": step, "seconds": round(seconds, 3),
                        "minutes": round(seconds / 60, 3), "validation_seconds": round(self.validation_seconds, 3),
                        "wall_seconds": round(self.wall_seconds(), 3)}
        return self.reached

    def state_dict(self) -> dict[str, Any]:
        return {"wall_seconds": self.wall_seconds(), "validation_seconds": self.validation_seconds,
                "update_seconds": {str(k): v for k, v in self.update_seconds.items()}, "reached": self.reached}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.carried = float(state.get("wall_seconds", 0.0))
        self.validation_seconds = float(state.get("validation_seconds", 0.0))
        self.update_seconds = {int(k): float(v) for k, v in (state.get("update_seconds") or {}).items()}
        self.reached = state.get("reached")
        if self.started is not None:
            self.started = self.now()


def read_target(run_dir: str | Path) -> dict[str, Any] | None:
    """The run's time-to-target record (the first ``target`` event in its verl_logs.jsonl), or None."""
    path = Path(run_dir) / "verl_logs.jsonl"
    if not path.is_file():
        return None
    with path.open() as handle:
        for line in handle:
            if f'"scope": "{TARGET_SCOPE}"' not in line and f'"scope":"{TARGET_SCOPE}"' not in line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if row.get("scope") == TARGET_SCOPE and "seconds" in row:
                return row
    return None

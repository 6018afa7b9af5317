"""The step plan for capacity search: 1, 2, 4, ... N users, each level held for a fixed time.

Each level is held ``step_time`` seconds. The first ``settle`` seconds of a level (users spawning, queues filling)
are left out of its percentiles: the locustfile sets Locust's sliding percentile window to ``step_time - settle``,
so the ``_stats_history.csv`` row written at the end of a level carries that level's steady-state percentiles.
``report.py`` reads them from there.

The plan is a pure function of the options (``StepPlan.from_options``), so the report and tests can rebuild it.
The Locust shape that follows it is ``StepShape`` in ``locustfile.py``: this module must not import Locust,
which monkey-patches the whole process with gevent on import (``verl loadtest`` and pytest import this module).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any


def doubling_levels(max_users: int) -> list[int]:
    """``[1, 2, 4, ..., max_users]``: powers of two below ``max_users``, then ``max_users`` itself."""
    if max_users < 1:
        raise ValueError(f"max users must be >= 1 (got {max_users})")
    levels, users = [], 1
    while users < max_users:
        levels.append(users)
        users *= 2
    levels.append(max_users)
    return levels


def parse_levels(text: str) -> list[int]:
    """``"1,2,4,8"`` -> ``[1, 2, 4, 8]``; levels must be positive integers (any order, repeats allowed)."""
    try:
        levels = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise ValueError(f"--step-users must be comma-separated integers like 1,2,4,8 (got {text!r})") from None
    if not levels or any(level < 1 for level in levels):
        raise ValueError(f"--step-users needs at least one level and every level >= 1 (got {text!r})")
    return levels


@dataclass(frozen=True)
class StepPlan:
    """User levels and how long each is held; ``window_s`` is the part of a level its percentiles cover."""

    levels: tuple[int, ...]
    step_time_s: float
    settle_s: float

    def __post_init__(self) -> None:
        if self.step_time_s <= 0:
            raise ValueError(f"--step-time must be > 0 seconds (got {self.step_time_s})")
        if not 0 <= self.settle_s < self.step_time_s:
            raise ValueError(f"--step-settle must be >= 0 and below --step-time ({self.step_time_s} s); "
                             f"got {self.settle_s}")

    @property
    def window_s(self) -> int:
        # Locust's window is whole seconds; never below 1 or it would look at the current second only.
        return max(1, math.floor(self.step_time_s - self.settle_s))

    @property
    def duration_s(self) -> float:
        return len(self.levels) * self.step_time_s

    def users_at(self, run_time: float) -> int | None:
        """Users for a moment ``run_time`` seconds into the test; ``None`` once every level has been held."""
        index = int(run_time // self.step_time_s)
        return self.levels[index] if index < len(self.levels) else None

    @classmethod
    def from_options(cls, options: Any) -> StepPlan:
        """Build from Locust's parsed options (``--step-users`` wins over ``--max-users``)."""
        levels = parse_levels(options.step_users) if options.step_users else doubling_levels(options.max_users)
        return cls(tuple(levels), float(options.step_time), float(options.step_settle))

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "levels": list(self.levels), "window_s": self.window_s, "duration_s": self.duration_s}

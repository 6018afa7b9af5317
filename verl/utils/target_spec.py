"""The spelling of a quality mark (``trainer.target``): ``METRIC:VALUE`` (reached when the metric is >= VALUE) or
``METRIC:VALUE:min`` (<= VALUE, e.g. a loss). Here, below the config that validates it; the clock that times the
run to it is ``verl.trainer.target``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Target:
    metric: str
    value: float
    mode: Literal["max", "min"] = "max"

    @classmethod
    def parse(cls, spec: str) -> Target:
        """``eval/accuracy:0.25`` or ``critic/loss:0.1:min``; a ``ValueError`` says what is wrong and the fix."""
        parts = spec.strip().split(":")
        hint = "write METRIC:VALUE or METRIC:VALUE:min, e.g. trainer.target=eval/accuracy:0.25"
        if len(parts) not in (2, 3) or not parts[0]:
            raise ValueError(f"trainer.target={spec!r} is not a target: {hint}")
        metric = parts[0]
        if "/" not in metric:
            raise ValueError(f"trainer.target's metric {metric!r} has no scope: name a logged metric as scope/name "
                             f"(eval/accuracy, rollout/reward_mean); {hint}")
        try:
            value = float(parts[1])
        except ValueError:
            raise ValueError(f"trainer.target's value {parts[1]!r} is not a number; {hint}") from None
        if not math.isfinite(value):
            raise ValueError(f"trainer.target's value must be finite (got {parts[1]}); {hint}")
        mode = parts[2] if len(parts) == 3 else "max"
        if mode not in ("max", "min"):
            raise ValueError(f"trainer.target's direction must be max or min (got {mode!r}); {hint}")
        return cls(metric, value, mode)  # type: ignore[arg-type]

    @property
    def spec(self) -> str:
        return f"{self.metric}:{self.value:g}" + (":min" if self.mode == "min" else "")

    def reached(self, value: float | None) -> bool:
        if value is None or not math.isfinite(value):
            return False
        return value >= self.value if self.mode == "max" else value <= self.value

"""Per-stage wall-clock timing for the training step (``timing/gen``, ``timing/ref`` ...)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from verl.utils.profiling import stage_range


class StageTimer:
    """Accumulates seconds per named stage; ``with timer("gen"): ...``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.profiling = False  # while a step is profiled, each stage is also a named range in the trace

    @contextlib.contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            if self.profiling:
                with stage_range(stage):
                    yield
            else:
                yield
        finally:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - start

    def pop(self) -> dict[str, float]:
        out, self.seconds = self.seconds, {}
        return out

"""Timing and machine-limit probes shared by the benchmarks (run as scripts: ``from probes import ...`` works
because a script's own directory is first on ``sys.path``).

- ``median_time``: median wall seconds of a callable after one warm-up;
- ``gemm_gflops``: a plain fp32 GEMM of a given shape, the compute reference a model's achieved GFLOP/s is compared
  with (timed in the same run, on the same threads);
- ``read_gbs``: the read bandwidth of summing a buffer of a given size (the floor for streaming weights).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def median_time(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gemm_gflops(rows: int, k: int, n: int, repeats: int = 200) -> float:
    """GFLOP/s of an fp32 ``(rows, k) @ (k, n)`` product."""
    a, b = torch.randn(rows, k), torch.randn(k, n)
    return 2 * rows * k * n / median_time(lambda: a @ b, repeats) / 1e9


def read_gbs(num_bytes: int, repeats: int = 10) -> float:
    """GB/s of reading ``num_bytes`` of fp32 once (a sum over a buffer that size)."""
    buffer = torch.randn(max(1, num_bytes // 4))
    return buffer.numel() * 4 / median_time(buffer.sum, repeats) / 1e9

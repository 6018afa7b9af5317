"""Timing and machine-limit probes shared by the benchmarks (run as scripts: ``from probes import ...`` works
because a script's own directory is first on ``sys.path``).

- ``median_time``: median wall seconds of a callable after one warm-up;
- ``gemm_gflops``: a plain fp32 GEMM of a given shape, the compute reference a model's achieved GFLOP/s is compared
  with (timed in the same run, on the same threads), by the faster of the two library paths below (until 2026-11-25
  it was MKL's alone, which on AMD CPUs with AVX-512 reads under half of what oneDNN does);
- ``library_gemm_gflops``: the same GEMM by each of the CPU's two library paths (MKL's sgemm, which ``a @ b``
  takes, and oneDNN with a pre-packed weight, which the model's frozen layers take) and the faster of the two: on
  some CPUs (AMD with AVX-512) MKL runs its AVX2 path at under half of oneDNN's rate, so ``a @ b`` alone would
  understate the machine;
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
    """GFLOP/s of an fp32 ``(rows, k) @ (k, n)`` product: the faster of MKL and oneDNN (``library_gemm_gflops``)."""
    return library_gemm_gflops(rows, k, n, repeats)["best"]


def library_gemm_gflops(rows: int, k: int, n: int, repeats: int = 50) -> dict[str, float]:
    """GFLOP/s of an fp32 ``(rows, k) @ (k, n)`` product by MKL and by oneDNN (packed weight), and the best."""
    a, weight = torch.randn(rows, k), torch.randn(n, k)
    flop = 2 * rows * k * n
    mkl = flop / median_time(lambda: a @ weight.t(), repeats) / 1e9
    out = {"mkl": mkl, "onednn": 0.0}
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
        out["onednn"] = flop / median_time(
            lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""), repeats) / 1e9
    out["best"] = max(out["mkl"], out["onednn"])
    return out


def read_gbs(num_bytes: int, repeats: int = 10) -> float:
    """GB/s of reading ``num_bytes`` of fp32 once (a sum over a buffer that size)."""
    buffer = torch.randn(max(1, num_bytes // 4))
    return buffer.numel() * 4 / median_time(buffer.sum, repeats) / 1e9


def linear_weight_count(model: torch.nn.Module) -> int:
    """Parameters a token is multiplied by: every ``nn.Linear`` weight, the LM head included (an embedding lookup
    costs no FLOPs). A decoded token costs ``2 x`` this many FLOPs."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def decode_limits(model: torch.nn.Module, rows: int, repeats: int = 100) -> dict[str, float]:
    """The machine's limits for decoding ``rows`` sequences at once with ``model`` (fp32, this thread count):

    - ``gemm_gflops``: a ``rows x hidden x intermediate`` GEMM, the compute reference;
    - ``read_floor_tok_s``: tokens/s if every decode step only read the linear weights once at ``read_gbs``.
    """
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    weights = linear_weight_count(model)
    read = read_gbs(weights * 4)
    return {"gemm_gflops": gemm_gflops(rows, config.hidden_size, config.intermediate_size, repeats),
            "gemm_shape": f"{rows}x{config.hidden_size}x{config.intermediate_size}", "read_gbs": read,
            "flop_per_token": 2.0 * weights, "read_floor_tok_s": rows / (weights * 4 / (read * 1e9))}


def decode_efficiency(tok_s: float, limits: dict[str, float]) -> str:
    """``"<GFLOP/s> (<% of the GEMM>, <% of the read floor>)"`` for a decode rate of ``tok_s``."""
    gflops = tok_s * limits["flop_per_token"] / 1e9
    return (f"{gflops:.1f} ({100 * gflops / limits['gemm_gflops']:.0f}% of GEMM, "
            f"{100 * tok_s / limits['read_floor_tok_s']:.0f}% of read floor)")

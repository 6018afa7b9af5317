"""``trainer.profile_steps``: record chosen training steps with torch.profiler (verl users know this as the
trainer's profiler option), so the question "where does a step go" has an answer without extra tools.

For each profiled step the run directory gets ``profile/step_N.trace.json`` (a Chrome trace: open it in
chrome://tracing or Perfetto; every stage of the step — gen, ref, update_actor ... — is a named range) and
``profile/step_N.md``: the stages' wall time, the operators by self time, and the matrix products by shape with
their achieved GFLOP/s (the number to hold against a plain GEMM of the machine: ``benchmarks/probes.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from verl.utils.fs import atomic_write_text

STAGE_PREFIX = "stage/"
MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise"}


def stage_range(stage: str) -> contextlib.AbstractContextManager:
    """A named range for the profiler's trace (cheap when no profiler is running)."""
    return record_function(STAGE_PREFIX + stage)


@contextlib.contextmanager
def profile_step(run_dir: Path, step: int, stage_seconds: dict[str, float]) -> Iterator[None]:
    """Profile the enclosed step; on exit write its trace and tables under ``run_dir/profile``.
    ``stage_seconds`` is read at exit (the step's ``StageTimer`` seconds) for the stage table."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, record_shapes=True) as prof:
        yield
    out = run_dir / "profile"
    out.mkdir(parents=True, exist_ok=True)
    trace = out / f"step_{step}.trace.json"
    tmp = trace.with_suffix(".tmp")
    prof.export_chrome_trace(str(tmp))
    tmp.replace(trace)
    atomic_write_text(out / f"step_{step}.md", report(prof, step, dict(stage_seconds)))


def report(prof, step: int, stage_seconds: dict[str, float], top: int = 25) -> str:
    """Markdown: stage wall times, top operators by self CPU time, matrix products by shape."""
    lines = [f"# Profile of step {step}", "", "| stage | wall s |", "|---|---|"]
    lines += [f"| {name} | {seconds:.3f} |" for name, seconds in stage_seconds.items()]
    averages = prof.key_averages()
    total_us = sum(e.self_cpu_time_total for e in averages) or 1
    lines += ["", f"## Operators by self CPU time (top {top})", "", "| op | calls | self CPU ms | share |",
              "|---|---|---|---|"]
    for e in sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]:
        lines.append(f"| {e.key} | {e.count} | {e.self_cpu_time_total / 1000:.1f} | "
                     f"{e.self_cpu_time_total / total_us:.1%} |")
    rows = []
    for e in prof.key_averages(group_by_input_shape=True):
        shapes = e.input_shapes or []
        if e.key not in MATMUL_OPS or not e.self_cpu_time_total:
            continue
        flops = matmul_flops(e.key, shapes)
        if flops is None:
            continue
        ms = e.self_cpu_time_total / 1000
        rows.append((ms, f"| {e.key} | {' x '.join(str(tuple(s)) for s in shapes if s)} | {e.count} | {ms:.1f} | "
                         f"{flops * e.count / ms / 1e6:.1f} |"))
    lines += ["", "## Matrix products by shape", "", "| op | input shapes | calls | self CPU ms | GFLOP/s |",
              "|---|---|---|---|---|"]
    lines += [row for _, row in sorted(rows, reverse=True)]
    return "\n".join(lines) + "\n"


def matmul_flops(op: str, shapes: list[list[int]]) -> int | None:
    """FLOPs of one call from its input shapes (mm: (m,k)x(k,n); addmm: bias,(m,k),(k,n); bmm: (b,m,k)x(b,k,n);
    oneDNN's packed linear: (..., k) x (n, k))."""
    try:
        if op == "aten::mm":
            (m, k), (_, n) = shapes[0], shapes[1]
            return 2 * m * k * n
        if op == "aten::addmm":
            (m, k), (_, n) = shapes[1], shapes[2]
            return 2 * m * k * n
        if op == "aten::bmm":
            (b, m, k), (_, _, n) = shapes[0], shapes[1]
            return 2 * b * m * k * n
        if op == "mkldnn::_linear_pointwise":
            rows = 1
            for size in shapes[0][:-1]:
                rows *= size
            (n, k) = shapes[1]
            return 2 * rows * k * n
    except (ValueError, IndexError, TypeError):
        return None
    return None

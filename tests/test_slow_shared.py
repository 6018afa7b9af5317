"""Artefacts the slow group's two parts share (tests/shared.py): trained once across processes behind a lock, reused
by every later caller, trained again after a failed attempt; per session without the shared dir."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.readme import REPO
from tests.shared import ARTEFACTS, SHARED_DIR_ENV, TRAINED_MARKER, shared_artifact


class Trainer:
    """Stands in for the README's two commands (3 min of real training): records its calls, slow enough that a
    second caller arrives while the first holds the lock."""

    def __init__(self, fail_first: bool = False):
        self.calls: list[Path] = []
        self.fail_first = fail_first

    def __call__(self, root: Path) -> Path:
        self.calls.append(root)
        root.mkdir(parents=True)
        (root / "half-written").write_text("x")
        time.sleep(0.3)
        if self.fail_first and len(self.calls) == 1:
            raise RuntimeError("verl rm failed")
        (root / "model").write_text(str(len(self.calls)))
        return root


def test_callers_at_once_train_it_once_and_share_it(tmp_path, monkeypatch):
    monkeypatch.setenv(SHARED_DIR_ENV, str(tmp_path / "shared"))
    train = Trainer()
    got: list[Path] = []
    threads = [threading.Thread(target=lambda: got.append(shared_artifact(
        "readme-rm", lambda: pytest.fail("no session dir with a shared dir"), train))) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert train.calls == [tmp_path / "shared" / "readme-rm"]
    assert got == [tmp_path / "shared" / "readme-rm"] * 3
    assert (got[0] / TRAINED_MARKER).is_file() and (got[0] / "model").read_text() == "1"


def test_a_failed_attempt_is_not_reused(tmp_path, monkeypatch):
    monkeypatch.setenv(SHARED_DIR_ENV, str(tmp_path / "shared"))
    train = Trainer(fail_first=True)
    with pytest.raises(RuntimeError, match="verl rm failed"):
        shared_artifact("readme-rm", lambda: tmp_path, train)
    root = shared_artifact("readme-rm", lambda: tmp_path, train)
    assert len(train.calls) == 2 and (root / "model").read_text() == "2" and (root / TRAINED_MARKER).is_file()


def test_without_the_shared_dir_each_session_trains_its_own(tmp_path, monkeypatch):
    monkeypatch.delenv(SHARED_DIR_ENV, raising=False)
    train = Trainer()
    assert shared_artifact("readme-rm", lambda: tmp_path / "session", train) == tmp_path / "session"
    assert train.calls == [tmp_path / "session"] and not (tmp_path / "session" / TRAINED_MARKER).exists()


def test_the_module_run_needs_the_shared_dir(monkeypatch):
    monkeypatch.delenv(SHARED_DIR_ENV, raising=False)
    done = subprocess.run([sys.executable, "-m", "tests.shared"], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1 and f"set {SHARED_DIR_ENV}" in done.stderr


def test_the_registry_names_what_the_fixtures_ask_for():
    assert set(ARTEFACTS) == {"readme-rm", "ship-runs"}

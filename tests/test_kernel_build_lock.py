"""The CPU kernels' build lock (verl/models/cpu_kernels.py: build_lock): a process killed inside torch's builder
used to leave torch's ``lock`` file behind, and every later model load waited on it forever (a CI run hung that way
after a test SIGKILLed a trainer). verl's own lock is an flock the kernel releases when its holder dies, and under it
a leftover torch lock is removed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from verl.models.cpu_kernels import build_lock, use_packaged_ninja

HOLD = """
import sys, time
from pathlib import Path
from verl.models.cpu_kernels import build_lock, use_packaged_ninja
with build_lock(Path(sys.argv[1])):
    (Path(sys.argv[1]) / "lock").write_text("")  # as torch's builder does, then dies before removing it
    print("holding", flush=True)
    time.sleep(600)
"""


def test_a_holder_killed_inside_the_builder_blocks_nobody(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "holding"
    entered, stale_lock_seen = threading.Event(), []

    def second() -> None:
        with build_lock(tmp_path):
            stale_lock_seen.append((tmp_path / "lock").exists())
            entered.set()

    waiter = threading.Thread(target=second, daemon=True)
    waiter.start()
    time.sleep(0.5)
    assert not entered.is_set()  # a live holder is waited for
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait(timeout=30)
    assert entered.wait(timeout=30)  # its lock died with it
    waiter.join(timeout=30)
    assert stale_lock_seen == [False]  # the dead holder's torch lock was removed before the build would run


def test_the_build_always_runs_the_packaged_ninja(tmp_path, monkeypatch):
    """A ninja found first on PATH (Debian's 1.11 in /usr/bin) hashes the build log's commands differently from the
    package's 1.13: processes that found different ninjas rebuilt the kernels for each other, three times in one
    README story. The builder's PATH now starts with the package's binary whatever came first."""
    import shutil

    import ninja

    other = tmp_path / "bin"
    other.mkdir()
    (other / "ninja").write_text("#!/bin/sh\necho 1.11.1\n")
    (other / "ninja").chmod(0o755)
    monkeypatch.setenv("PATH", f"{other}{os.pathsep}{os.environ['PATH']}")
    assert shutil.which("ninja") == str(other / "ninja")
    use_packaged_ninja()
    assert shutil.which("ninja") == os.path.join(ninja.BIN_DIR, "ninja")
    once = os.environ["PATH"]
    use_packaged_ninja()  # PATH is not grown on every load
    assert os.environ["PATH"] == once

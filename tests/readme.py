"""The README's code blocks, for the slow tests that run them as written, and the one artefact three of them share.

``python -m tests.readme`` trains that artefact, the README's reward model, into ``$VERL_TEST_SHARED_DIR``: `make
test-slow` runs it first in its second part (nice 19), so the serial part, the group's critical path, finds it
trained instead of spending ~3.2 min on it (the second part ends minutes before the serial part).
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README_RM_HEADING = "## Reward models: rewards without answers"
# Where the README's `verl rm --config configs/rm_tiny.yaml trainer.experiment_name=rm-a` leaves its reward model.
README_RM_CHECKPOINT = "outputs/verl-rm/rm-a/checkpoints/global_step_700"
# A directory the processes of one `make test-slow` share (the Makefile makes a fresh one per run and removes it).
SHARED_DIR_ENV = "VERL_TEST_SHARED_DIR"
TRAINED_MARKER = ".trained"  # written last: a directory without it is a failed or unfinished attempt


def readme_block(heading: str) -> str:
    """The first ```bash block after ``heading`` in README.md."""
    text = (REPO / "README.md").read_text()
    section = text[text.index(heading):]
    return re.search(r"```bash\n(.*?)```", section, re.DOTALL).group(1)


def readme_rm_commands() -> tuple[str, str]:
    """The reward-model story's first two commands: the warm start's own answers as pairs, and `verl rm` on them."""
    pairs, train = readme_block(README_RM_HEADING).splitlines()[:2]
    assert pairs.startswith("verl data pairs ") and train.startswith("verl rm --config configs/rm_tiny.yaml"), \
        (pairs, train)
    return pairs, train


def train_readme_reward_model(root: Path) -> Path:
    """Run the README's two reward-model commands as written in ``root`` (~3.2 min on the 2-core box); returns
    ``root``, which then holds ``data/pairs-tiny`` and ``outputs/verl-rm/rm-a``."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "configs").mkdir(exist_ok=True)
    (root / "configs" / "rm_tiny.yaml").write_text((REPO / "configs" / "rm_tiny.yaml").read_text())
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONUNBUFFERED": "1",
           "VERL_CACHE_DIR": os.environ.get("VERL_CACHE_DIR", str(REPO / ".cache"))}
    script = "\n".join(readme_rm_commands()) + "\n"
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=root, env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    assert (root / README_RM_CHECKPOINT).is_dir()
    return root


def shared_readme_reward_model(session_dir: Callable[[], Path],
                               train: Callable[[Path], Path] = train_readme_reward_model) -> Path:
    """The README's reward model, trained once per `make test-slow` across its processes, else once per session.

    With ``$VERL_TEST_SHARED_DIR`` set, the first caller takes an exclusive lock on ``readme-rm.lock`` there, trains
    into ``readme-rm`` and marks it trained; every other caller (another process or thread) waits on the lock and
    reuses it. A failed attempt leaves no marker: the next caller removes what it left and trains again (and fails
    the same way, with its own output). Without the variable, ``train(session_dir())`` as before."""
    shared = os.environ.get(SHARED_DIR_ENV)
    if not shared:
        return train(session_dir())
    root = Path(shared) / "readme-rm"
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / "readme-rm.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also when training raises
        if not (root / TRAINED_MARKER).is_file():
            shutil.rmtree(root, ignore_errors=True)
            train(root)
            (root / TRAINED_MARKER).touch()
    return root


if __name__ == "__main__":
    if not os.environ.get(SHARED_DIR_ENV):
        sys.exit(f"python -m tests.readme: set {SHARED_DIR_ENV} to the directory the slow group's processes share")
    print(f"the README's reward model: {shared_readme_reward_model(lambda: Path())}", flush=True)

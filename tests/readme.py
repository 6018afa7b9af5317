"""The README's code blocks, for the slow tests that run them as written, and the one artefact three of them share.

``python -m tests.readme DIR`` trains that artefact (the README's reward model) into ``DIR`` ahead of the tests that
use it: `make test-slow` runs it beside its serial part, which finds it there (``VERL_TEST_SHARED_DIR``)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from filelock import FileLock

REPO = Path(__file__).resolve().parents[1]
README_RM_HEADING = "## Reward models: rewards without answers"
# Where the README's `verl rm --config configs/rm_tiny.yaml trainer.experiment_name=rm-a` leaves its reward model.
README_RM_CHECKPOINT = "outputs/verl-rm/rm-a/checkpoints/global_step_700"
# A directory every pytest process of one `make test-slow` sees (the Makefile sets it): artefacts trained once for all.
SHARED_DIR_ENV = "VERL_TEST_SHARED_DIR"


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
    # ~3.2 min alone; `make test-slow` runs it beside the serial tests and two pytest workers, where a CI box at
    # nice 19 gave it a third of a core: over 900 s (2026-12-01; it runs at nice 10 now). The limit only catches a hang.
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=root, env=env, capture_output=True,
                          text=True, timeout=2400)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    assert (root / README_RM_CHECKPOINT).is_dir()
    return root


def shared_readme_reward_model(shared: Path) -> Path:
    """The README's reward model in ``shared/readme-rm``, trained by whichever process asks first: the others wait on
    its lock, then reuse it (a run that failed or was killed leaves no ``.done`` mark, so the next asker trains it
    again). Returns the directory, as :func:`train_readme_reward_model` does."""
    shared.mkdir(parents=True, exist_ok=True)
    root, done = shared / "readme-rm", shared / "readme-rm.done"
    with FileLock(str(shared / "readme-rm.lock")):
        if not done.exists():
            shutil.rmtree(root, ignore_errors=True)
            train_readme_reward_model(root)
            done.touch()
    return root


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m tests.readme SHARED_DIR  (trains the README's reward model into SHARED_DIR)")
    print(f"README reward model: {shared_readme_reward_model(Path(sys.argv[1]))}")

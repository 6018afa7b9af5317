"""The README's code blocks, for the slow tests that run them as written, and the one artefact two of them share."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README_RM_HEADING = "## Reward models: rewards without answers"
# Where the README's `verl rm --config configs/rm_tiny.yaml trainer.experiment_name=rm-a` leaves its reward model.
README_RM_CHECKPOINT = "outputs/verl-rm/rm-a/checkpoints/global_step_700"


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

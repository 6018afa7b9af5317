"""The ship tests' CLI call and the three LoRA runs they ship (tests/ship/test_ship_e2e.py), trained by the real CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.readme import REPO

# name -> (lr, steps): the incumbent (~22% strict accuracy), a deliberately worse run (the warm start's ~0.4%) and a
# sound one (~90%).
SHIP_RUNS = {"inc": ("1e-3", 5), "bad": ("2e-4", 2), "good": ("1e-3", 10)}


def verl(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "verl.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def train_lora(root: Path, name: str, lr: str, steps: int = 10, seed: int = 1) -> Path:
    done = verl("train", "model.lora.rank=16", "model.lora.alpha=32", f"actor.optim.lr={lr}",
                f"trainer.total_steps={steps}", f"trainer.save_freq={steps}", f"trainer.test_freq={steps}",
                "trainer.val_before_train=false",
                "data.val_max_samples=64", f"trainer.seed={seed}", "trainer.logger=[jsonl]",
                f"trainer.output_dir={root}", f"trainer.experiment_name={name}", "--quiet")
    assert done.returncode == 0, done.stderr[-3000:]
    return root / "verl" / name


def train_ship_runs(root: Path) -> Path:
    """``SHIP_RUNS`` under ``root/verl/<name>`` (~50 s); returns ``root``."""
    for name, (lr, steps) in SHIP_RUNS.items():
        train_lora(root, name, lr, steps=steps)
    return root

"""Helpers for tests that run the real `verl` CLI in a subprocess with tiny settings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

VERL = str(Path(sys.executable).parent / "verl")

# A few seconds per step on one thread: 4 prompts x 2 samples, 16 validation prompts.
TINY = [
    "data.train_batch_size=4",
    "actor.ppo_mini_batch_size=4",
    "rollout.n=2",
    "data.val_max_samples=16",
    "trainer.test_freq=2",
    "trainer.num_samples_to_log=2",
]


def run_cli(args: list[str], timeout: int = 300, **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.update(kwargs.pop("env", {}))
    return subprocess.run([VERL, *args], capture_output=True, text=True, timeout=timeout, env=env, **kwargs)


def rows(path: Path, scope: str | None = None) -> list[dict]:
    out = []
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        if scope is None or row["scope"] == scope:
            out.append(row)
    return out


def rows_by_step(run_dir: Path, scope: str) -> dict[int, dict]:
    """The run's ``scope`` rows keyed by step (one row per step and scope)."""
    return {r["step"]: r for r in rows(Path(run_dir) / "verl_logs.jsonl", scope)}


def fit_and_shutdown(trainer):
    """``trainer.fit()``, releasing its workers and engines even when it fails."""
    try:
        return trainer.fit()
    finally:
        trainer.shutdown()

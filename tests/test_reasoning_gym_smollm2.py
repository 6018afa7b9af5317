"""A 2-step smoke of the reasoning-gym study's config (configs/reasoning_gym_smollm2.yaml) on the real SmolLM2: the
mix trains, the four validation tasks report per task, disjoint from the training mix. The study itself (cold
start, 3 seeds) is the benchmark in benchmarks/RESULTS.md; this proves the config runs as shipped."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO, require_reasoning_gym
from verl.utils.log import read_jsonl

require_reasoning_gym()

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.mark.budget(160)  # measured 155 s alone (model load, 2 steps, 2 validations of 16)
def test_the_study_config_trains_two_steps_and_reports_every_task(tmp_path):
    done = subprocess.run([sys.executable, "-m", "verl.cli", "train", "--config", "configs/reasoning_gym_smollm2.yaml",
                           "trainer.total_steps=2", "trainer.test_freq=2", "trainer.save_freq=2",
                           "data.val_max_samples=16", "trainer.val_before_train=false", "trainer.logger=[jsonl]",
                           f"trainer.output_dir={tmp_path}", "trainer.experiment_name=smoke"],
                          cwd=REPO, capture_output=True, text=True, timeout=800)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "after the training items" in done.stderr  # the validation sources moved past the mix's items
    rows = read_jsonl(tmp_path / "verl" / "smoke" / "verl_logs.jsonl")
    contamination = next(r for r in rows if r.get("scope") == "contamination")
    assert contamination["exact"] == 0  # no validation question is a training question
    evals = [r for r in rows if r.get("scope") == "eval"]
    assert evals and any(k.startswith("kind/") and k.endswith("/accuracy") for k in evals[-1])
    assert [r["step"] for r in rows if r.get("scope") == "rollout"] == [1, 2]

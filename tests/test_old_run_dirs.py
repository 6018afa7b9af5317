"""A run directory written before the architecture's fourth round (issue 61: the registries, the removed
``trainer.alerts`` / ``trainer.callbacks.early_stop`` sections) still resumes and evaluates. ``tests/data/
run_before_issue61`` was written by commit 9a6571f: one GRPO step of the tiny model with a rank-2 LoRA (so the
checkpoint is 400 KB), its config.yaml holding both removed sections at their defaults."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from tests.trainer_utils import rows, run_cli

pytestmark = pytest.mark.e2e  # real trainer and evaluation processes

OLD_RUN = Path(__file__).parent / "data" / "run_before_issue61"


def test_the_committed_run_holds_what_it_tests():
    config = yaml.safe_load((OLD_RUN / "config.yaml").read_text())
    assert "alerts" in config["trainer"] and "early_stop" in config["trainer"]["callbacks"]
    assert (OLD_RUN / "checkpoints" / "latest").read_text().strip() == "global_step_1"


def test_a_run_from_before_resumes_and_evaluates(tmp_path):
    run_dir = tmp_path / "verl" / "before-61"
    shutil.copytree(OLD_RUN, run_dir)
    resumed = run_cli(["train", f"trainer.output_dir={tmp_path}", "trainer.experiment_name=before-61",
                       "trainer.total_steps=2", "trainer.test_freq=-1", "--quiet"], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming" in resumed.stderr and "from global_step_1" in resumed.stderr
    assert [r["step"] for r in rows(run_dir / "verl_logs.jsonl", "ppo")] == [1, 2]  # step 2 continued step 1
    evaluated = run_cli(["eval", "--ckpt", str(run_dir / "checkpoints" / "global_step_1"), "--max-samples", "8",
                         "--evaluators", "accuracy", "--out", str(tmp_path / "eval"), "--quiet"], cwd=tmp_path)
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    assert "does not match the current schema" not in evaluated.stderr  # the run's own config was read
    results = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert results["metrics"]["eval/accuracy"]["n"] == 8 and results["contamination"]["checked"] == 8

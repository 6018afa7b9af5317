"""The learning demos the foundation promises (slow group: `pytest -m slow`).

Each runs the real `verl train` CLI and reads validation accuracy (strict `>> N` format, greedy) from
verl_logs.jsonl: the first eval row is before training (val_before_train), the last one after the final step.
Wall time is printed for the record, never asserted.
"""

from __future__ import annotations

import time

import pytest

from tests.trainer_utils import rows, run_cli

pytestmark = pytest.mark.slow


def _train(tmp_path, name, *overrides):
    start = time.perf_counter()
    result = run_cli(["train", f"trainer.output_dir={tmp_path}", f"trainer.experiment_name={name}", "--quiet",
                      *overrides], timeout=1800)
    seconds = time.perf_counter() - start
    assert result.returncode == 0, result.stderr
    evals = rows(tmp_path / "verl" / name / "verl_logs.jsonl", "eval")
    first, last = evals[0], evals[-1]
    print(f"{name}: accuracy {first['accuracy']:.3f} -> {last['accuracy']:.3f} "
          f"(flexible {first['accuracy_flexible']:.3f} -> {last['accuracy_flexible']:.3f}) in {seconds:.0f} s")
    assert first["step"] == 0
    return first, last


@pytest.mark.budget(40)
def test_default_grpo_learns_the_format(tmp_path):
    first, last = _train(tmp_path, "grpo")
    assert first["accuracy"] < 0.6
    assert last["accuracy"] - first["accuracy"] >= 0.5


@pytest.mark.budget(70)
def test_ppo_with_critic_learns(tmp_path):
    first, last = _train(tmp_path, "ppo", "--config", "configs/ppo_tiny.yaml")
    assert first["accuracy"] < 0.6
    assert last["accuracy"] - first["accuracy"] >= 0.3


@pytest.mark.budget(35)
@pytest.mark.parametrize("estimator", ["rloo", "reinforce_plus_plus"])
def test_other_estimators_learn(tmp_path, estimator):
    first, last = _train(tmp_path, estimator, f"algorithm.adv_estimator={estimator}")
    assert last["accuracy"] - first["accuracy"] >= 0.3


@pytest.mark.budget(40)
def test_lora_learns_and_checkpoints_keep_the_adapter(tmp_path):
    first, last = _train(tmp_path, "lora", "model.lora.rank=16", "model.lora.alpha=32", "actor.optim.lr=1e-3",
                         "trainer.total_steps=30")
    assert last["accuracy"] - first["accuracy"] >= 0.3
    checkpoint = tmp_path / "verl" / "lora" / "checkpoints" / "global_step_30"
    names = {p.name for p in checkpoint.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= names and "model.safetensors" not in names
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint)  # base + adapter through transformers' PEFT support
    assert hasattr(model, "peft_config")


@pytest.mark.budget(55)
@pytest.mark.serial  # a Ray cluster: one at a time
def test_two_ray_workers_learn_like_the_local_executor(tmp_path):
    """Rollouts are seeded per prompt and gradients summed exactly, so the runs track each other closely."""
    pytest.importorskip("ray")
    local_first, local_last = _train(tmp_path, "local", "trainer.total_steps=30")
    ray_first, ray_last = _train(tmp_path, "ray", "trainer.total_steps=30", "trainer.executor=ray",
                                 "trainer.n_workers=2")
    assert ray_first["accuracy"] == local_first["accuracy"]
    assert ray_last["accuracy"] - ray_first["accuracy"] >= 0.5
    assert abs(ray_last["accuracy"] - local_last["accuracy"]) <= 0.05


# The tiny agent's learning claim (configs/agent_tiny.yaml) is checked on the README's own run of that config:
# tests/test_readme_agents.py (one training, not two).

"""The real `verl train` CLI end to end with tiny settings: run layout, logs, checkpoints, errors."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.trainer_utils import TINY, rows, run_cli

pytestmark = pytest.mark.e2e  # a real process, server, cluster or trainer run: `make test-fast` skips it


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    result = run_cli(["train", f"trainer.output_dir={out}", "trainer.experiment_name=e2e", "trainer.total_steps=2",
                      "trainer.save_freq=1", *TINY])
    assert result.returncode == 0, result.stderr
    return out / "verl" / "e2e", result


def test_run_directory_layout(grpo_run):
    run_dir, _ = grpo_run
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["trainer"]["experiment_name"] == "e2e"  # the resolved config, as run
    assert config["data"]["train_batch_size"] == 4
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "global_step_2"
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names == ["global_step_1", "global_step_2", "latest"]


def test_jsonl_rows_follow_the_design(grpo_run):
    run_dir, _ = grpo_run
    log = run_dir / "verl_logs.jsonl"
    all_rows = rows(log)
    for row in all_rows:
        assert {"timestamp", "level", "scope", "step"} <= set(row)
    scopes = {r["scope"] for r in all_rows}
    assert {"train", "rollout", "ppo", "timing", "eval", "sample", "system", "throughput"} <= scopes
    rollout = rows(log, "rollout")
    assert [r["step"] for r in rollout] == [1, 2]
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in rollout)
    assert all(r["num_responses"] == 8 for r in rollout)  # 4 prompts x n=2
    evals = rows(log, "eval")
    # val_before_train (step 0) and test_freq=2 (step 2, also the last step)
    assert [r["step"] for r in evals] == [0, 2]
    assert all("accuracy" in r and "accuracy_flexible" in r for r in evals)
    assert all(r["num_samples"] == 16 for r in evals)
    ppo = rows(log, "ppo")
    assert all(r["kl_coef"] == pytest.approx(0.04) for r in ppo)
    timing = rows(log, "timing")
    assert all({"gen", "ref", "update_actor", "total"} <= set(r) for r in timing)
    samples = rows(log, "sample")
    assert samples and all({"prompt", "response", "ground_truth", "score"} <= set(s) for s in samples)


def test_every_checkpoint_loads_and_generates(grpo_run):
    run_dir, _ = grpo_run
    for step in (1, 2):
        path = run_dir / "checkpoints" / f"global_step_{step}"
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path)
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+3?"}],
                                               add_generation_prompt=True, return_tensors="pt", return_dict=True)
        out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
        text = tokenizer.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
        assert text.strip(), "the checkpoint generated nothing"
        meta = json.loads((path / "meta.json").read_text())
        assert meta["step"] == step


def test_log_dir_and_debug_rows(tmp_path):
    log_dir = tmp_path / "logs"
    result = run_cli(["train", f"trainer.output_dir={tmp_path}", "trainer.experiment_name=dbg", "trainer.total_steps=1",
                      "trainer.val_before_train=false", "trainer.test_freq=0", f"--log_dir={log_dir}",
                      "--log_level", "DEBUG", *TINY[:3]])
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "verl" / "dbg" / "verl_logs.jsonl").exists()
    debug = [r for r in rows(log_dir / "verl_logs.jsonl") if r["level"] == "DEBUG"]
    assert {"placement", "timing"} <= {r["scope"] for r in debug}
    placement = next(r for r in debug if r["scope"] == "placement")
    assert placement["device"] == "cpu" and placement["threads"] == 1


def _assert_one_clear_line(result, *needles):
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1, result.stderr
    for needle in needles:
        assert needle in result.stderr.replace("\n", " "), result.stderr


def test_misspelt_key_names_the_closest_valid_key(tmp_path):
    result = run_cli(["train", f"trainer.output_dir={tmp_path}", "actor.optim.learning_rate=1e-5"])
    _assert_one_clear_line(result, "actor.optim.learning_rate", "did you mean 'actor.optim.lr'")


def test_impossible_batch_is_rejected(tmp_path):
    result = run_cli(["train", f"trainer.output_dir={tmp_path}", "data.train_batch_size=10"])
    _assert_one_clear_line(result, "data.train_batch_size (10)", "actor.ppo_mini_batch_size (16)")


def test_wrong_type_is_rejected(tmp_path):
    result = run_cli(["train", f"trainer.output_dir={tmp_path}", "rollout.n=many"])
    _assert_one_clear_line(result, "rollout.n", "'many'")


def test_missing_dataset_file(tmp_path):
    result = run_cli(["train", f"trainer.output_dir={tmp_path}", f"data.train_files=[{tmp_path}/nope.parquet]"])
    _assert_one_clear_line(result, "data.train_files", "nope.parquet", "does not exist")


def test_dataset_without_prompt_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "What is 1+1?", "answer": "2"}] * 8), bad)
    result = run_cli(["train", f"trainer.output_dir={tmp_path}", f"data.train_files=[{bad}]"])
    _assert_one_clear_line(result, "no prompt column 'prompt'", "data.prompt_key", "question")


def test_debug_flag_shows_the_traceback(tmp_path):
    result = run_cli(["--debug", "train", f"trainer.output_dir={tmp_path}", "trainer.nope=1"])
    assert result.returncode != 0 and "Traceback" in result.stderr


def test_dry_run_loads_no_weights(tmp_path):
    result = run_cli(["train", "--dry-run", "--config", "configs/ppo_tiny.yaml"])
    assert result.returncode == 0, result.stderr
    assert "critic" in result.stderr and "64 prompts x 1 = 64 responses" in result.stderr
    too_long = run_cli(["train", "--dry-run", "data.max_prompt_length=250", "data.max_response_length=16"])
    _assert_one_clear_line(too_long, "exceeds the model's context")


def test_ppo_config_runs_critic_and_saves_it(tmp_path):
    result = run_cli(["train", "--config", "configs/ppo_tiny.yaml", f"trainer.output_dir={tmp_path}",
                      "trainer.experiment_name=ppo", "trainer.total_steps=1", "data.train_batch_size=4",
                      "actor.ppo_mini_batch_size=2", "trainer.test_freq=0", "trainer.val_before_train=false"])
    assert result.returncode == 0, result.stderr
    run_dir = tmp_path / "verl" / "ppo"
    critic_rows = rows(run_dir / "verl_logs.jsonl", "critic")
    assert critic_rows and "value_loss" in critic_rows[0]
    timing = rows(run_dir / "verl_logs.jsonl", "timing")[0]
    assert {"old_log_prob", "ref", "values", "update_critic", "update_actor"} <= set(timing)
    critic_dir = run_dir / "checkpoints" / "global_step_1" / "critic"
    assert (critic_dir / "model.safetensors").is_file()
    from transformers import AutoModelForTokenClassification

    critic = AutoModelForTokenClassification.from_pretrained(critic_dir)
    assert critic.config.num_labels == 1
    assert torch.isfinite(critic(torch.tensor([[1, 5, 40]])).logits).all()

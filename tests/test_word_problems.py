"""The built-in word_problems task: deterministic, held-out number pairs, scored like GSM8K."""

from __future__ import annotations

import pyarrow.parquet as pq

from verl.data.builtin import resolve_data_file
from verl.data.tasks.word_problems import INSTRUCTION, WordProblemSpec, generate_splits
from verl.rewards.registry import reward_for_data_source


def test_splits_are_deterministic_and_validation_pairs_are_unseen():
    spec = WordProblemSpec(num_train=400, num_val=50)
    first, again = generate_splits(spec), generate_splits(spec)
    assert first == again
    train_pairs = {r["extra_info"]["question"] for r in first["train"]}
    val_pairs = {r["extra_info"]["question"] for r in first["val"]}
    assert val_pairs and not train_pairs & val_pairs  # held out: arithmetic the policy is never rewarded for
    row = first["val"][0]
    a, b = map(int, row["extra_info"]["question"].split("+"))
    assert row["reward_model"]["ground_truth"] == str(a + b)
    assert row["prompt"][0]["content"].endswith(INSTRUCTION) and f"has {a} " in row["prompt"][0]["content"]
    assert len({r["prompt"][0]["content"] for r in first["train"]}) == 400  # no duplicate stories


def test_builtin_files_and_the_gsm8k_reward(tmp_path, monkeypatch):
    monkeypatch.setenv("VERL_CACHE_DIR", str(tmp_path))
    rows = pq.read_table(resolve_data_file("builtin:word_problems/val")).to_pylist()
    assert len(rows) == WordProblemSpec().num_val and rows[0]["data_source"] == "gsm8k"
    score = reward_for_data_source("gsm8k")
    truth = rows[0]["reward_model"]["ground_truth"]
    assert score("gsm8k", f"Some working.\n#### {truth}", truth)["score"] == 1.0
    assert score("gsm8k", f"The answer is {truth}.", truth)["score"] == 0.0  # strict: only #### N counts

"""The built-in word_problems task: deterministic, held-out number pairs, scored like GSM8K."""

from __future__ import annotations

import pyarrow.parquet as pq

from verl.data.sources import resolve_data_file
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


def test_tool_word_problems_hold_out_wordings_and_their_expressions_give_the_answers(tmp_path, monkeypatch):
    """Stories of six kinds; validation uses wordings no training story uses; each row's calculator expression
    gives its ground truth; the SFT conversations call the calculator with it and answer with its result."""
    import json
    import re

    from verl.data.tasks import tool_word_problems as task
    from verl.tools.calculator import calculator

    splits = task.generate_splits(task.ToolWordProblemSpec(num_train=120, num_val=36, num_sft=12))
    assert splits == task.generate_splits(task.ToolWordProblemSpec(num_train=120, num_val=36, num_sft=12))

    def wording(text: str) -> str:  # the template: numbers, names and items blanked out
        text = re.sub(r"\d+", "#", text)
        for word in (*task.NAMES, *task.ITEMS):
            text = text.replace(word, "_")
        return text

    train = {wording(r["prompt"][0]["content"]) for r in splits["train"]}
    wide = {wording(r["prompt"][0]["content"]) for r in splits["train_wide"]}
    val = {wording(r["prompt"][0]["content"]) for r in splits["val"]}
    assert len(val) == len(task.VAL_TEMPLATES) and not train & val
    # train_wide: train's wordings and two more per kind (120 stories draw all 24), none of them validation's
    assert train < wide and len(wide) == 4 * len(task.KINDS) and not wide & val
    assert [r["extra_info"]["kind"] for r in splits["train_wide"]] == [r["extra_info"]["kind"] for r in splits["train"]]
    assert {r["extra_info"]["kind"] for r in splits["val"]} == set(task.KINDS)
    for row in splits["train"] + splits["train_wide"] + splits["val"]:
        assert calculator(row["extra_info"]["expression"]) == row["reward_model"]["ground_truth"]
        assert json.loads(row["tools"])[0]["function"]["name"] == "calculator"
    messages = json.loads(splits["sft_train"][0]["messages"])
    call = messages[1]["tool_calls"][0]["function"]
    assert calculator(**call["arguments"]) == messages[2]["content"]
    assert messages[3]["content"] == f"#### {messages[2]['content']}"
    monkeypatch.setenv("VERL_CACHE_DIR", str(tmp_path))
    rows = pq.read_table(resolve_data_file("builtin:tool_word_problems/val")).to_pylist()
    assert len(rows) == task.ToolWordProblemSpec().num_val and rows[0]["data_source"] == "gsm8k"


def test_tool_word_problems_splits_are_the_ones_every_measured_number_was_taken_on():
    """The cold start, the study and the shipped agent config were measured on these exact rows: a change to the
    generator (a new split, a template) must not move them. Digests of the default spec's splits (JSON, sorted keys)."""
    import hashlib
    import json

    from verl.data.tasks import tool_word_problems as task

    splits = task.generate_splits(task.ToolWordProblemSpec())
    digests = {name: hashlib.sha256(json.dumps(splits[name], sort_keys=True).encode()).hexdigest()[:16]
               for name in ("train", "val", "sft_train", "train_wide")}
    assert digests == {"train": "05b74ae16a7e132c", "val": "35cca1ecf8c24136", "sft_train": "10f7d4bb45e396fd",
                       "train_wide": "459b1721bcbb3549"}

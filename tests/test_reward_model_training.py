"""`verl rm`: preference pairs in TRL's layouts, the Bradley–Terry loss against hand-computed values, the built-in
pairs, and short real runs whose checkpoints load as ``AutoModelForSequenceClassification`` and score as the trainer
scored (the learning claim itself is the slow test at the end)."""

from __future__ import annotations

import json
import math
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForSequenceClassification

from tests.trainer_utils import rows, run_cli
from verl.config import RMConfig, build_config
from verl.data.pairs import read_pair
from verl.data.sources import resolve_data_file
from verl.data.tasks.arithmetic import near_miss, wrong_answer
from verl.errors import DataError
from verl.models.loader import load_tokenizer
from verl.rewards import get_reward_fn
from verl.trainer.checkpoint import read_pointer
from verl.trainer.rm import RewardModelTrainer, pair_metrics, pairwise_loss


def test_pairwise_loss_is_bradley_terry_nll_by_hand():
    chosen, rejected = torch.tensor([2.0, 0.0, -1.0]), torch.tensor([0.0, 0.0, 1.0])
    # -log sigmoid(d) = log(1 + exp(-d)) for d = 2, 0, -2
    expected = (math.log(1 + math.exp(-2)) + math.log(2) + math.log(1 + math.exp(2))) / 3
    assert float(pairwise_loss(chosen, rejected)) == pytest.approx(expected, rel=1e-6)
    metrics = pair_metrics(chosen, rejected)
    assert metrics["accuracy"] == pytest.approx(1 / 3)  # the tie counts as wrong
    assert metrics["margin"] == pytest.approx(0.0) and metrics["reward_chosen"] == pytest.approx(1 / 3)


def test_near_miss_changes_one_digit_and_keeps_the_shape():
    rng = random.Random(0)
    for truth in ["0", "7", "10", "502", "1998", "-45"]:
        for _ in range(50):
            wrong = near_miss(truth, rng)
            assert wrong != truth and len(wrong) == len(truth)
            assert sum(a != b for a, b in zip(wrong, truth, strict=True)) == 1
            digits = wrong.lstrip("-")
            assert wrong.startswith("-") == truth.startswith("-") and (len(digits) == 1 or digits[0] != "0")


def test_wrong_answers_have_the_true_answers_shape():
    rng = random.Random(0)
    for truth in ["0", "7", "10", "502", "1998", "-45"]:
        for _ in range(50):
            wrong = wrong_answer(truth, rng)
            digits = wrong.lstrip("-")
            assert wrong != truth and len(wrong) == len(truth) and wrong.startswith("-") == truth.startswith("-")
            assert len(digits) == 1 or digits[0] != "0"


def test_builtin_pairs_differ_in_correctness_not_format():
    table = pq.read_table(resolve_data_file("builtin:arithmetic/pairs_train")).to_pylist()
    val = pq.read_table(resolve_data_file("builtin:arithmetic/pairs_val")).to_pylist()
    assert len(table) == 20000 and len(val) == 512
    for row in table[:500] + val:
        truth = row["reward_model"]["ground_truth"]
        assert row["chosen"] == f">> {truth}"
        assert row["rejected"].startswith(">> ") and row["rejected"] != row["chosen"]
    train_prompts = {r["prompt"][0]["content"] for r in table}
    assert not train_prompts & {r["prompt"][0]["content"] for r in val}  # held-out problems
    near = pq.read_table(resolve_data_file("builtin:arithmetic/pairs_near_val")).to_pylist()
    assert len(near) == 512 and all(sum(a != b for a, b in zip(r["chosen"], r["rejected"], strict=True)) == 1
                                    for r in near)  # the harder check: one digit apart


@pytest.fixture(scope="module")
def tokenizer(warm_start_dir):
    return load_tokenizer(warm_start_dir)


def row(**fields):
    return {"__source_file__": "pairs.parquet", "__row__": 3, **fields}


def test_pairs_in_every_trl_layout(tokenizer):
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "What is 1+2?"}],
                                             add_generation_prompt=True, tokenize=False)
    explicit = read_pair(row(prompt="What is 1+2?", chosen=">> 3", rejected=">> 4"), tokenizer, "prompt", "chosen",
                         "rejected")
    assert (explicit.prompt, explicit.chosen, explicit.rejected) == (rendered, ">> 3", ">> 4")
    messages = read_pair(row(prompt=[{"role": "user", "content": "What is 1+2?"}],
                             chosen=[{"role": "assistant", "content": ">> 3"}],
                             rejected=json.dumps([{"role": "assistant", "content": ">> 4"}])),
                         tokenizer, "prompt", "chosen", "rejected")
    assert messages == explicit
    user = {"role": "user", "content": "What is 1+2?"}
    implicit = read_pair(row(chosen=[user, {"role": "assistant", "content": ">> 3"}],
                             rejected=[user, {"role": "assistant", "content": ">> 4"}]),
                         tokenizer, "prompt", "chosen", "rejected")
    assert implicit == explicit
    texts = read_pair(row(chosen="a good text", rejected="a bad text"), tokenizer, "prompt", "chosen", "rejected")
    assert (texts.prompt, texts.chosen, texts.rejected) == ("", "a good text", "a bad text")


@pytest.mark.parametrize(("fields", "said"), [
    ({"prompt": "x", "good": ">> 3", "rejected": ">> 4"}, "need columns 'chosen' and 'rejected'"),
    ({"chosen": "text", "rejected": [{"role": "user", "content": "x"}]}, "must both be texts or both conversations"),
    ({"chosen": [{"role": "user", "content": "a"}], "rejected": [{"role": "user", "content": "b"}]},
     "share no leading message"),
    ({"prompt": "x", "chosen": [{"text": "no role or content"}], "rejected": ">> 4"}, "list of {role, content}"),
])
def test_bad_pairs_name_the_file_row_and_fix(tokenizer, fields, said):
    with pytest.raises(DataError, match="pairs.parquet row 3") as info:
        read_pair(row(**fields), tokenizer, "prompt", "chosen", "rejected")
    assert said in str(info.value)


def short_config(tmp_path, **trainer) -> RMConfig:
    return build_config({"data": {"train_max_samples": 128, "val_max_samples": 32},
                         "trainer": {"output_dir": str(tmp_path), "experiment_name": "rm", "total_steps": 4,
                                     "test_freq": 2, "logger": ["jsonl"], **trainer}}, schema=RMConfig)


@pytest.mark.parametrize("lora", [0, 8])
def test_checkpoints_load_as_sequence_classifiers_and_score_as_trained(tmp_path, lora):
    config = short_config(tmp_path)
    config.model.lora.rank = lora
    trainer = RewardModelTrainer(config, quiet=True)
    final = trainer.fit()
    assert read_pointer(trainer.run_dir, "latest") == final and read_pointer(trainer.run_dir, "best") == final
    assert not (final / "adapter_config.json").exists()  # LoRA runs are merged: no peft needed to load them
    loaded = AutoModelForSequenceClassification.from_pretrained(final).eval()
    batch = trainer.val_data.batch(list(range(8)))
    with torch.no_grad():
        ours = torch.cat(trainer.scores(batch))
        theirs = loaded(**batch).logits[:, 0]
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=1e-4)
    logged = rows(trainer.run_dir / "verl_logs.jsonl", "eval")
    assert [r["step"] for r in logged] == [0, 2, 4]
    assert {"pairwise_accuracy", "margin", "loss"} <= set(logged[-1])


def test_pairs_too_long_for_max_length_are_an_error_not_an_empty_run(tmp_path):
    config = short_config(tmp_path)
    config.data.max_length = 3
    with pytest.raises(DataError, match="no pair fits data.max_length=3"):
        RewardModelTrainer(config, quiet=True)


def test_cli_reads_a_users_parquet_and_names_a_missing_column(tmp_path):
    pairs = tmp_path / "pairs.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "What is 1+2?", "good": ">> 3", "bad": ">> 4"}] * 8), pairs)
    args = ["rm", f"data.train_files=[{pairs}]", f"data.val_files=[{pairs}]", f"trainer.output_dir={tmp_path}",
            "trainer.total_steps=2", "trainer.logger=[jsonl]", "--quiet"]
    failed = run_cli(args)
    assert failed.returncode == 1 and "Traceback" not in failed.stderr
    assert "need columns 'chosen' and 'rejected'" in failed.stderr and "row 0" in failed.stderr
    done = run_cli([*args, "data.chosen_key=good", "data.rejected_key=bad"])
    assert done.returncode == 0, done.stderr
    assert "best held-out pairwise accuracy" in " ".join(done.stderr.split())


def test_pairs_from_the_models_own_answers_are_rule_checked_and_split_by_prompt(tmp_path):
    out = tmp_path / "pairs"
    done = run_cli(["data", "pairs", "--model", "builtin:tiny-arith", "--out", str(out), "--max-prompts", "64",
                    "--n", "4", "--val-fraction", "0.25"])
    assert done.returncode == 0, done.stderr
    said = " ".join(done.stderr.split())
    assert "64 prompts, 256 answers" in said and "pairs" in said
    train = pq.read_table(out / "train.parquet").to_pylist()
    val = pq.read_table(out / "val.parquet").to_pylist()
    assert train and val
    assert not {str(r["prompt"]) for r in train} & {str(r["prompt"]) for r in val}
    rule = get_reward_fn("arithmetic")
    for pair in train + val:
        truth = pair["reward_model"]["ground_truth"]
        assert rule("arithmetic", pair["chosen"], truth, {})["acc"] == 1.0
        assert rule("arithmetic", pair["rejected"], truth, {})["acc"] == 0.0
        assert pair["extra_info"]["chosen_score"] > pair["extra_info"]["rejected_score"]
    # The same file trains a reward model.
    trained = run_cli(["rm", f"data.train_files=[{out / 'train.parquet'}]", f"data.val_files=[{out / 'val.parquet'}]",
                       f"trainer.output_dir={tmp_path}", "trainer.total_steps=2", "trainer.logger=[jsonl]", "--quiet"])
    assert trained.returncode == 0, trained.stderr

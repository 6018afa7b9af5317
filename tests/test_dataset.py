"""The built-in arithmetic task, builtin:arithmetic/* resolution, RLHFDataset and PromptSampler."""

from __future__ import annotations

import random
import re
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import verl.data.builtin as builtin
from verl.config import DataConfig
from verl.data.builtin import write_arithmetic
from verl.data.dataset import PromptSampler, RLHFDataset
from verl.data.sources import resolve_data_file
from verl.data.tasks.arithmetic import ArithmeticSpec, generate_splits, sft_response
from verl.errors import DataError
from verl.models.tiny import build_char_tokenizer

SMALL = ArithmeticSpec(num_train=300, num_val=40)
QUESTION = re.compile(r"What is (\d+)([+*-])(\d+)\?")


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


# ----------------------------------------------------------------------------------------------- arithmetic task


def parse(row: dict) -> tuple[int, str, int]:
    match = QUESTION.fullmatch(row["prompt"][0]["content"])
    assert match, row
    return int(match.group(1)), match.group(2), int(match.group(3))


def test_arithmetic_is_deterministic_correct_and_disjoint():
    spec = ArithmeticSpec(num_train=300, num_val=40, ops=("+", "-", "*"), min_digits=1, max_digits=2)
    first, second = generate_splits(spec), generate_splits(spec)
    assert first == second
    assert len(first["train"]) == 300 and len(first["val"]) == 40
    solve = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    problems = {}
    for split, rows in first.items():
        problems[split] = {parse(r) for r in rows}
        assert len(problems[split]) == len(rows)  # no duplicates inside a split
        for i, row in enumerate(rows):
            a, op, b = parse(row)
            assert 0 <= a <= 99 and 0 <= b <= 99
            assert row["reward_model"] == {"style": "rule", "ground_truth": str(solve[op](a, b))}
            assert row["data_source"] == "arithmetic" and row["extra_info"]["index"] == i
            assert row["extra_info"]["split"] == split
    assert not problems["train"] & problems["val"]
    assert {op for _, op, _ in problems["train"]} == {"+", "-", "*"}
    # A different seed gives different problems.
    assert generate_splits(ArithmeticSpec(num_train=300, num_val=40, seed=7))["val"] != generate_splits(SMALL)["val"]


def test_validation_split_does_not_depend_on_num_train():
    assert generate_splits(ArithmeticSpec(num_train=10, num_val=20))["val"] == generate_splits(
        ArithmeticSpec(num_train=500, num_val=20))["val"]


def test_test_split_is_held_out_and_leaves_train_and_val_as_they_were():
    """verl ship gates on builtin:arithmetic/test: never trained on, never used to pick a checkpoint."""
    splits = generate_splits(ArithmeticSpec(num_train=300, num_val=40, num_test=60))
    without = generate_splits(ArithmeticSpec(num_train=300, num_val=40, num_test=0))
    assert splits["train"] == without["train"] and splits["val"] == without["val"] and without["test"] == []
    test = {parse(row) for row in splits["test"]}
    assert len(test) == 60 and not test & {parse(r) for r in splits["train"] + splits["val"]}
    assert {row["extra_info"]["split"] for row in splits["test"]} == {"test"}


def test_traffic_split_is_disjoint_from_the_rest_and_moves_nothing():
    """Load tests send builtin:arithmetic/traffic by default: their records may become training data (the flywheel),
    so they must not be any split a number is computed on."""
    splits = generate_splits(ArithmeticSpec(num_train=300, num_val=40, num_test=60, num_traffic=80))
    without = generate_splits(ArithmeticSpec(num_train=300, num_val=40, num_test=60, num_traffic=0))
    assert all(splits[name] == without[name] for name in ("train", "val", "test")) and without["traffic"] == []
    traffic = {parse(row) for row in splits["traffic"]}
    assert len(traffic) == 80 and not traffic & {parse(r) for r in splits["train"] + splits["val"] + splits["test"]}


def test_digit_range_is_respected():
    rows = generate_splits(ArithmeticSpec(num_train=200, num_val=10, min_digits=3, max_digits=3))["train"]
    assert all(100 <= a <= 999 and 100 <= b <= 999 for a, _, b in map(parse, rows))


def test_impossible_problem_count_fails_clearly():
    with pytest.raises(ValueError, match="cannot draw 200 distinct train problems"):
        generate_splits(ArithmeticSpec(min_digits=1, max_digits=1, num_train=200, num_val=0))  # only 100 exist


def test_sft_answer_format_mix_is_about_60_20_20(tmp_path):
    paths = write_arithmetic(tmp_path, ArithmeticSpec(num_train=4000, num_val=20))
    assert set(paths) == {"train", "val", "test", "traffic", "sft_train", "sft_val", "pairs_train", "pairs_val",
                          "pairs_near_val"}
    rows = pq.read_table(paths["sft_train"]).to_pylist()
    kinds = Counter()
    for row in rows:
        truth = row["reward_model"]["ground_truth"]
        kind = {truth: "plain", f">> {truth}": "strict", f"is {truth}": "is"}.get(row["response"])
        assert kind, row["response"]
        kinds[kind] += 1
    n = len(rows)
    assert n == 4000
    assert kinds["plain"] / n == pytest.approx(0.6, abs=0.03)
    assert kinds["strict"] / n == pytest.approx(0.2, abs=0.03)
    assert kinds["is"] / n == pytest.approx(0.2, abs=0.03)
    # The supervised rows are the same problems as the RL rows.
    assert [r["prompt"] for r in rows] == [r["prompt"] for r in pq.read_table(paths["train"]).to_pylist()]


def test_sft_response_formats():
    rng = random.Random(0)
    assert {sft_response("42", rng) for _ in range(200)} == {"42", ">> 42", "is 42"}


# ----------------------------------------------------------------------------------------------- builtin resolution


def test_builtin_resolution_writes_parquet_once(tmp_path, monkeypatch):
    monkeypatch.setenv("VERL_CACHE_DIR", str(tmp_path))
    calls = []
    real = builtin.write_arithmetic

    def counting(out_dir, spec=None):
        calls.append(out_dir)
        return real(out_dir, spec)

    monkeypatch.setattr(builtin, "write_arithmetic", counting)
    val = resolve_data_file("builtin:arithmetic/val", SMALL)
    assert val == tmp_path / "data" / f"arithmetic-{SMALL.key()}" / "val.parquet"
    assert val.is_file() and pq.read_table(val).num_rows == 40
    train = resolve_data_file("builtin:arithmetic/train", SMALL)
    again = resolve_data_file("builtin:arithmetic/val", SMALL)
    assert len(calls) == 1 and again == val and train.parent == val.parent
    assert pq.read_table(resolve_data_file("builtin:arithmetic", SMALL)).num_rows == 300  # split defaults to train
    # A different spec is a different cache entry.
    other = resolve_data_file("builtin:arithmetic/val", ArithmeticSpec(num_train=300, num_val=41))
    assert other.parent != val.parent and len(calls) == 2


def test_builtin_resolution_errors_and_passthrough(tmp_path, monkeypatch):
    monkeypatch.setenv("VERL_CACHE_DIR", str(tmp_path))
    with pytest.raises(DataError, match="unknown built-in dataset 'builtin:gsm8k/train'.*arithmetic"):
        resolve_data_file("builtin:gsm8k/train")
    with pytest.raises(DataError, match="no split 'holdout'.*sft_train.*test"):
        resolve_data_file("builtin:arithmetic/holdout")
    assert str(resolve_data_file("data/x.parquet")) == "data/x.parquet"
    assert not (tmp_path / "data").exists()


# ----------------------------------------------------------------------------------------------- RLHFDataset

PROMPTS = ["What is 1+2?", "What is 10+20+30+40?", "What is 100+200+300+400+500?"]


def prompt_parquet(tmp_path, prompts=PROMPTS, name="prompts.parquet", key="prompt"):
    rows = [
        {key: [{"role": "user", "content": p}], "data_source": "arithmetic",
         "reward_model": {"style": "rule", "ground_truth": str(i)}, "extra_info": {"index": i}}
        for i, p in enumerate(prompts)
    ]
    path = tmp_path / name
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def templated(content: str) -> str:
    return f"<s><|user|>{content}\n<|assistant|>"


def test_rlhf_dataset_chat_template_left_padding_and_positions(tmp_path, tokenizer):
    data = RLHFDataset(str(prompt_parquet(tmp_path)), tokenizer, {"max_prompt_length": 64})
    assert len(data) == 3 and data.num_filtered == data.num_truncated == 0
    batch = data.collate([0, 2])
    assert batch.non_tensor["raw_prompt"].tolist() == [templated(PROMPTS[0]), templated(PROMPTS[2])]
    ids, mask, pos = batch.batch["input_ids"], batch.batch["attention_mask"], batch.batch["position_ids"]
    # <s>, <|user|>, each character, "\n", <|assistant|>: 3 special/newline tokens + 1 per character + 1.
    lengths = [len(PROMPTS[0]) + 4, len(PROMPTS[2]) + 4]
    assert ids.shape == (2, max(lengths))
    pad = lengths[1] - lengths[0]
    assert mask[0].tolist() == [0] * pad + [1] * lengths[0] and mask[1].tolist() == [1] * lengths[1]
    assert ids[0, :pad].tolist() == [tokenizer.pad_token_id] * pad
    assert ids[0, pad].item() == tokenizer.bos_token_id and ids[1, 0].item() == tokenizer.bos_token_id
    assert tokenizer.decode(ids[0, pad:]) == templated(PROMPTS[0])
    assert pos[0].tolist() == [0] * pad + list(range(lengths[0]))
    assert pos[1].tolist() == list(range(lengths[1]))
    assert batch.non_tensor["ground_truth"].tolist() == ["0", "2"]
    assert batch.non_tensor["data_source"].tolist() == ["arithmetic", "arithmetic"]
    assert batch.non_tensor["extra_info"][1] == {"index": 2}
    assert batch.non_tensor["index"].tolist() == [0, 2]


def test_rlhf_dataset_plain_strings_and_no_template(tmp_path, tokenizer):
    path = tmp_path / "plain.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "2+2", "ground_truth": "4"}]), path)
    data = RLHFDataset([str(path)], tokenizer, {"prompt_key": "question", "apply_chat_template": False})
    batch = data.collate([0])
    assert batch.non_tensor["raw_prompt"].tolist() == ["2+2"]
    assert tokenizer.decode(batch.batch["input_ids"][0]) == "2+2"
    assert batch.non_tensor["ground_truth"].tolist() == ["4"]  # falls back to a top-level ground_truth column
    assert batch.non_tensor["data_source"].tolist() == ["unknown"]


def test_truncation_modes(tmp_path, tokenizer):
    path = str(prompt_parquet(tmp_path))
    limit = len(PROMPTS[0]) + 4  # only the first prompt fits
    long_len = len(PROMPTS[1]) + 4

    with pytest.raises(DataError, match=rf"row 1: prompt has {long_len} tokens > data.max_prompt_length={limit}"):
        RLHFDataset(path, tokenizer, {"max_prompt_length": limit, "truncation": "error"})

    filtered = RLHFDataset(path, tokenizer, {"max_prompt_length": limit, "truncation": "filter"})
    assert len(filtered) == 1 and filtered.num_filtered == 2 and filtered.num_truncated == 0
    assert filtered.collate([0]).non_tensor["ground_truth"].tolist() == ["0"]

    left = RLHFDataset(path, tokenizer, {"max_prompt_length": limit, "truncation": "left"})
    assert len(left) == 3 and left.num_truncated == 2 and left.num_filtered == 0
    full = tokenizer(templated(PROMPTS[1]), add_special_tokens=False)["input_ids"]
    assert len(full) == long_len and left.prompt_ids[1] == full[-limit:]
    assert left.prompt_ids[1][-1] == tokenizer.convert_tokens_to_ids("<|assistant|>")  # the end is kept
    assert len(left.prompt_ids[1]) == limit and left.prompt_ids[0][0] == tokenizer.bos_token_id

    right = RLHFDataset(path, tokenizer, {"max_prompt_length": limit, "truncation": "right"})
    assert right.num_truncated == 2
    assert right.prompt_ids[2][:2] == [tokenizer.bos_token_id, tokenizer.convert_tokens_to_ids("<|user|>")]
    assert tokenizer.decode(right.prompt_ids[2], skip_special_tokens=True) == PROMPTS[2][: limit - 2]

    with pytest.raises(DataError, match=r"no prompt fits data.max_prompt_length=3 \(3 filtered\)"):
        RLHFDataset(path, tokenizer, {"max_prompt_length": 3})


def test_missing_file_names_the_config_key(tmp_path, tokenizer):
    missing = tmp_path / "nope.parquet"
    with pytest.raises(DataError, match=r"data\.train_files: file '.*nope\.parquet' does not exist"):
        RLHFDataset(str(missing), tokenizer)
    with pytest.raises(DataError, match=r"data\.val_files: file"):
        RLHFDataset([str(missing)], tokenizer, config_key="data.val_files")
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(DataError, match=r"data\.train_files: cannot read .*junk\.parquet"):
        RLHFDataset(str(tmp_path / "junk.parquet"), tokenizer)


def test_missing_prompt_column_names_column_and_key(tmp_path, tokenizer):
    path = prompt_parquet(tmp_path, key="question")
    with pytest.raises(DataError) as err:
        RLHFDataset(str(path), tokenizer)
    message = str(err.value)
    assert "no prompt column 'prompt' (data.prompt_key)" in message
    assert "'question'" in message and "data.prompt_key=<column>" in message


def test_errors_in_a_second_file_name_that_file_and_its_own_row(tmp_path, tokenizer):
    good = prompt_parquet(tmp_path, prompts=["1+1", "2+2"], name="good.parquet")
    other = prompt_parquet(tmp_path, key="question", name="other.parquet")
    with pytest.raises(DataError, match=r"other\.parquet: no prompt column 'prompt' \(data\.prompt_key\)"):
        RLHFDataset([str(good), str(other)], tokenizer)
    long = prompt_parquet(tmp_path, prompts=["1+1", "1+1+1+1+1+1+1+1+1+1"], name="long.parquet")
    with pytest.raises(DataError, match=r"long\.parquet row 1: prompt has 23 tokens"):  # not row 3 of the union
        RLHFDataset([str(good), str(long)], tokenizer, {"max_prompt_length": 10, "truncation": "error"})


def test_builtin_arithmetic_through_the_dataset(tmp_path, monkeypatch, tokenizer):
    monkeypatch.setenv("VERL_CACHE_DIR", str(tmp_path))
    config = DataConfig(arithmetic={"num_train": 50, "num_val": 12, "max_digits": 2})
    data = RLHFDataset(["builtin:arithmetic/val"], tokenizer, config, config_key="data.val_files")
    assert len(data) == 12
    batch = data.collate(list(range(12)))
    for text, truth in zip(batch.non_tensor["raw_prompt"], batch.non_tensor["ground_truth"], strict=True):
        a, b = re.search(r"What is (\d+)\+(\d+)\?", text).groups()
        assert int(truth) == int(a) + int(b)
    assert torch.all(batch.batch["attention_mask"][:, -1] == 1)  # left padded: every row ends with a real token


# ----------------------------------------------------------------------------------------------- PromptSampler


def take(sampler: PromptSampler, n: int) -> list[list[int]]:
    return [sampler.next_batch() for _ in range(n)]


def test_sampler_is_deterministic_and_covers_each_epoch():
    a, b = PromptSampler(10, 3, seed=5), PromptSampler(10, 3, seed=5)
    batches = take(a, 6)
    assert batches == take(b, 6)
    epoch0 = [i for batch in batches[:3] for i in batch]
    assert len(set(epoch0)) == 9  # 3 batches of 3, no repeats; the ragged tail of one is dropped
    assert a.state_dict() == {"epoch": 1, "position": 9}
    epoch1 = [i for batch in batches[3:] for i in batch]
    assert epoch0 != epoch1  # reshuffled per epoch
    assert batches != take(PromptSampler(10, 3, seed=6), 6)


def test_sampler_without_shuffle_is_sequential():
    assert take(PromptSampler(7, 3, shuffle=False), 3) == [[0, 1, 2], [3, 4, 5], [0, 1, 2]]


def test_sampler_resume_from_state_dict():
    original = PromptSampler(11, 4, seed=3)
    take(original, 4)
    state = original.state_dict()
    resumed = PromptSampler(11, 4, seed=3)
    resumed.load_state_dict(state)
    assert take(resumed, 5) == take(original, 5)


def test_sampler_rejects_a_batch_larger_than_the_data():
    with pytest.raises(DataError, match="5 prompts, fewer than data.train_batch_size=8"):
        PromptSampler(5, 8)


def test_a_file_without_the_ground_truth_is_named_not_scored_zero(tmp_path, tokenizer):
    from verl.data.dataset import RLHFDataset

    path = tmp_path / "no_answers.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "What is 1+1?", "data_source": "arithmetic"}] * 3), path)
    with pytest.raises(DataError, match=r"no_answers.parquet row 0: no ground truth at 'reward_model.ground_truth'"):
        RLHFDataset([str(path)], tokenizer, {"apply_chat_template": False})
    # Rewards that need none (a reward model, a custom function) turn the check off.
    assert len(RLHFDataset([str(path)], tokenizer, {"apply_chat_template": False}, require_ground_truth=False)) == 3

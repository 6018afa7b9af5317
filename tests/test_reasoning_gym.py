"""reasoning_gym: sources against the real reasoning-gym package: the same items, its own scoring, disjoint
validation, and the errors a user meets."""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from tests.conftest import REPO, require_reasoning_gym

require_reasoning_gym()
import reasoning_gym  # noqa: E402
from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from verl.config import parse_overrides  # noqa: E402
from verl.data.contamination import normalise  # noqa: E402
from verl.data.sources import resolve_data_file  # noqa: E402
from verl.errors import DataError  # noqa: E402
from verl.rewards.registry import reward_for_data_source  # noqa: E402


def rows_of(name: str, **kw) -> list[dict]:
    return pq.read_table(resolve_data_file(name, **kw)).to_pylist()


def test_items_are_reasoning_gyms_own_with_its_prompt():
    rows = rows_of("reasoning_gym:chain_sum?size=6&seed=5&min_terms=3&max_terms=3")
    own = reasoning_gym.create_dataset("chain_sum", size=6, seed=5, min_terms=3, max_terms=3)
    assert [r["prompt"][1]["content"] for r in rows] == [own[i]["question"] for i in range(6)]
    assert [r["reward_model"]["ground_truth"] for r in rows] == [own[i]["answer"] for i in range(6)]
    assert [r["response"] for r in rows] == [f"<answer>{own[i]['answer']}</answer>" for i in range(6)]  # SFT's
    assert all(r["prompt"][0] == {"role": "system", "content": SYSTEM_PROMPTS["default"]} for r in rows)
    assert {r["data_source"] for r in rows} == {"reasoning_gym/chain_sum"}
    assert [(r["extra_info"]["seed"], r["extra_info"]["index"], r["extra_info"]["kind"]) for r in rows] == [
        (5, i, "chain_sum") for i in range(6)]
    bare = rows_of("reasoning_gym:chain_sum?size=2&seed=5&min_terms=3&max_terms=3&system_prompt=none")
    assert [m["role"] for m in bare[0]["prompt"]] == ["user"]


def test_a_mix_is_reasoning_gyms_composite_and_each_row_names_its_dataset(tmp_path):
    rows = rows_of("reasoning_gym:mix?chain_sum=1&leg_counting=2&size=30&seed=2&leg_counting.max_animals=3")
    from reasoning_gym.composite import DatasetSpec

    own = reasoning_gym.create_dataset("composite", size=30, seed=2, datasets=[
        DatasetSpec("chain_sum", 1.0, {}), DatasetSpec("leg_counting", 2.0, {"max_animals": 3})])
    assert [r["prompt"][1]["content"] for r in rows] == [own[i]["question"] for i in range(30)]
    assert [r["data_source"] for r in rows] == [f"reasoning_gym/{own[i]['metadata']['source_dataset']}"
                                                for i in range(30)]
    assert {r["extra_info"]["kind"] for r in rows} == {"chain_sum", "leg_counting"}
    # The same mix as reasoning-gym's composite YAML file.
    mix = tmp_path / "mix.yaml"
    mix.write_text("size: 30\nseed: 2\ndatasets:\n  - {name: chain_sum, weight: 1}\n"
                   "  - {name: leg_counting, weight: 2, config: {max_animals: 3}}\n")
    from_file = rows_of(f"reasoning_gym:{mix}")
    assert [r["prompt"][1]["content"] for r in from_file] == [r["prompt"][1]["content"] for r in rows]


@pytest.mark.parametrize("dataset", ["chain_sum", "leg_counting", "countdown", "letter_counting"])
def test_the_reward_is_score_answer_of_extract_answer_by_hand(dataset):
    """Our reward on a row = reasoning-gym's score_answer(extract_answer(response), item), called here by hand."""
    rows = rows_of(f"reasoning_gym:{dataset}?size=4&seed=11")
    own = reasoning_gym.create_dataset(dataset, size=4, seed=11)
    for i, row in enumerate(rows):
        truth = row["reward_model"]["ground_truth"]
        responses = [f"Thinking.\n<answer>{truth}</answer>", f"<answer>{truth}0</answer>", f"{truth}",
                     f"<answer>1</answer> then <answer>{truth}</answer>", "<answer></answer>"]
        fn = reward_for_data_source(row["data_source"])
        for response in responses:
            got = fn(row["data_source"], response, truth, row["extra_info"])
            answer = extract_answer(response)
            assert got["score"] == got["acc"] == own.score_answer(answer, own[i]), (dataset, response)
            assert got["scorer_refused"] == 0.0
            assert got["format"] == float(answer is not None)
        assert fn(row["data_source"], f"<answer>{truth}</answer>", truth, row["extra_info"])["score"] == 1.0


def test_an_answer_the_tasks_scorer_cannot_parse_is_wrong_and_counted():
    """prime_factorization's own score_answer raises ValueError on '3 = 18' (int() of its parts): 0, counted."""
    row = rows_of("reasoning_gym:prime_factorization?size=1&seed=1000000")[0]
    own = reasoning_gym.create_dataset("prime_factorization", size=1, seed=1000000)
    with pytest.raises(ValueError):
        own.score_answer("3 = 18", own[0])
    got = reward_for_data_source(row["data_source"])(row["data_source"], "<answer>3 = 18</answer>", None,
                                                     row["extra_info"])
    assert (got["score"], got["scorer_refused"], got["format"]) == (0.0, 1.0, 1.0)


def test_partial_credit_by_hand():
    """leg_counting keeps reasoning-gym's base rule: an answer holding the oracle scores len(oracle)/len(answer)."""
    row = rows_of("reasoning_gym:leg_counting?size=1&seed=3")[0]
    truth = row["reward_model"]["ground_truth"]
    got = reward_for_data_source(row["data_source"])(row["data_source"], f"<answer>{truth} legs</answer>", truth,
                                                     row["extra_info"])
    assert got["score"] == pytest.approx(len(truth) / len(f"{truth} legs"))


def test_validation_items_are_disjoint_from_training_and_repeats_are_dropped_and_counted():
    # Two one-digit terms: 100 possible questions, so 300 training items hold most of them.
    config = "min_terms=2&max_terms=2&min_digits=1&max_digits=1"
    train = f"reasoning_gym:chain_sum?size=300&seed=0&{config}"
    val = f"reasoning_gym:chain_sum?size=60&seed=100&{config}"
    path = resolve_data_file(val, disjoint_from=[train])
    rows = pq.read_table(path).to_pylist()
    summary = json.loads(path.with_suffix(".json").read_text())
    # Moved past the training seeds 0..299: item i of the validation source is reasoning-gym's item at seed 300 + i.
    own = reasoning_gym.create_dataset("chain_sum", size=60, seed=300, min_terms=2, max_terms=2, min_digits=1,
                                       max_digits=1)
    trained = {" ".join(normalise(q)) for q in (r["prompt"][1]["content"] for r in rows_of(train))}
    kept = [i for i in range(60) if " ".join(normalise(own[i]["question"])) not in trained]
    assert summary["seed"] == 300 and summary["moved_from_seed"] == 100
    assert summary["dropped_equal_to_training"] == 60 - len(kept) > 0
    assert [r["extra_info"]["index"] for r in rows] == kept and all(r["extra_info"]["seed"] == 300 for r in rows)
    # Without training sources the same name gives its own range, every item.
    assert len(rows_of(val)) == 60 and rows_of(val)[0]["extra_info"]["seed"] == 100


def test_a_single_task_validation_is_moved_past_a_training_mix_that_holds_the_task():
    """The mix's chain_sum is reasoning-gym's composite sub-dataset 0, seeded seed + 1: items Random(1 + i) for
    i < 300. Validation chain_sum?seed=0 would draw Random(0..49), 49 of them training items: it moves to 301."""
    train = "reasoning_gym:mix?chain_sum=1&leg_counting=1&size=300&seed=0"
    path = resolve_data_file("reasoning_gym:chain_sum?size=50&seed=0", disjoint_from=[train])
    summary = json.loads(path.with_suffix(".json").read_text())
    assert summary["seed"] == 301 and summary["moved_from_seed"] == 0
    from reasoning_gym.composite import DatasetSpec

    mix = reasoning_gym.create_dataset("composite", size=300, seed=0, datasets=[
        DatasetSpec("chain_sum", 1.0, {}), DatasetSpec("leg_counting", 1.0, {})])
    sub = mix.datasets["chain_sum"]
    assert sub.seed == 1 and sub[0]["question"] == reasoning_gym.create_dataset("chain_sum", size=1, seed=1)[0][
        "question"]
    trained = {sub[i]["question"] for i in range(300)}
    assert not trained & {r["prompt"][1]["content"] for r in pq.read_table(path).to_pylist()}
    # A validation mix is moved as a whole: its sub-dataset k from its seed + k + 1, past every training range.
    mixed = json.loads(resolve_data_file("reasoning_gym:mix?chain_sum=1&leg_counting=1&size=40&seed=0",
                                         disjoint_from=[train]).with_suffix(".json").read_text())
    assert mixed["seed"] == 300


@pytest.mark.parametrize(("name", "needles"), [
    ("reasoning_gym:chain_summ", ["no dataset 'chain_summ'", "did you mean chain_sum"]),
    ("reasoning_gym:chain_sum?max_term=3", ["max_term is not a config key", "max_terms"]),
    ("reasoning_gym:chain_sum?size=ten", ["size must be an integer"]),
    ("reasoning_gym:chain_sum?seed=1&seed=2", ["'seed' is given twice"]),
    ("reasoning_gym:chain_sum?system_prompt=loud", ["system_prompt must be none or one of", "DeepSeekZero"]),
    ("reasoning_gym:mix?size=3", ["a mix names its datasets with weights"]),
    ("reasoning_gym:mix?chain_sum=1&leg_counting.max_animals=2", ["does not weight", "leg_counting=<weight>"]),
    ("reasoning_gym:mix?chain_sum=heavy", ["mix weight of 'chain_sum' must be a number"]),
    ("verifiers:vf-math", ["verifiers environments", "not read by this version"]),
    ("openenv:http://127.0.0.1:1?episodes=2", ["cannot read http://127.0.0.1:1/schema", "is the OpenEnv server up"]),
    ("openenv:http://127.0.0.1:1?turns=2", ["turns not a key here; openenv: takes episodes and seed"]),
])
def test_bad_names_are_one_line_errors(name, needles):
    with pytest.raises(DataError) as caught:
        resolve_data_file(name)
    assert all(n in str(caught.value) for n in needles), str(caught.value)


def test_a_source_list_on_a_shell_line_parses():
    (_, value), = parse_overrides(["data.train_files=[reasoning_gym:chain_sum?size=9&seed=1, builtin:arithmetic/val]"])
    assert value == ["reasoning_gym:chain_sum?size=9&seed=1", "builtin:arithmetic/val"]
    (_, quoted), = parse_overrides(['data.val_files=["reasoning_gym:mix?chain_sum=1,2"]'])
    assert quoted == ["reasoning_gym:mix?chain_sum=1,2"]


def test_materialize_writes_source_seed_and_index(tmp_path):
    from verl.cli import app

    result = CliRunner().invoke(app, ["data", "materialize", "reasoning_gym:leg_counting?size=12&seed=4",
                                      "--out", str(tmp_path), "--disjoint-from",
                                      "reasoning_gym:leg_counting?size=10&seed=0"])
    assert result.exit_code == 0, result.output
    table = pq.read_table(tmp_path / "data.parquet").to_pylist()
    assert {r["source"] for r in table} == {"reasoning_gym:leg_counting?size=12&seed=4"}
    assert {r["seed"] for r in table} == {10}  # after the training seeds 0..9
    own = reasoning_gym.create_dataset("leg_counting", size=12, seed=10)
    assert all(r["prompt"][1]["content"] == own[r["index"]]["question"] for r in table)


def test_a_run_without_reasoning_gym_sources_never_imports_it():
    code = ("import sys; from verl.data.dataset import read_rows; from verl.rewards.registry import REWARD_FNS; "
            "read_rows(['builtin:arithmetic/val'], 'x'); print('reasoning_gym' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_verl_eval_reports_each_task_with_reasoning_gyms_own_scores(tmp_path):
    """`verl eval --data reasoning_gym:mix?...`: one group per dataset (extra_info.kind, unasked), and each sample's
    accuracy is reasoning-gym's score_answer applied here by hand to the response it wrote."""
    from verl.cli import app, register_subcommands

    if not any(c.name == "eval" for c in app.registered_commands):
        register_subcommands()
    source = "reasoning_gym:mix?chain_sum=1&basic_arithmetic=1&size=20&seed=3&system_prompt=none"
    result = CliRunner().invoke(app, ["eval", "--ckpt", "builtin:tiny-arith", "--data", source, "--max-prompt-length",
                                      "128", "--max-new-tokens", "8", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    results = json.loads((tmp_path / "results.json").read_text())
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    rows = rows_of(source)
    by_hand = []
    for sample in samples:
        row = rows[sample["index"]]
        dataset = reasoning_gym.create_dataset(row["extra_info"]["kind"], size=1)  # only for its score_answer
        item = json.loads(row["extra_info"]["spec"])  # rebuild the item as reasoning-gym would: the composite's
        from reasoning_gym.composite import DatasetSpec

        own = reasoning_gym.create_dataset("composite", size=item["size"], seed=item["seed"], datasets=[
            DatasetSpec(name, weight, {}) for name, weight in item["weights"].items()])
        by_hand.append(dataset.score_answer(extract_answer(sample["response"]), own[sample["index"]]))
        assert sample["accuracy"] == by_hand[-1]
    assert results["groups"]["by"] == "extra_info.kind"
    values = results["groups"]["values"]
    assert set(values) == {"chain_sum", "basic_arithmetic"}
    for kind, entry in values.items():
        mine = [s for s, r in zip(by_hand, samples, strict=True) if rows[r["index"]]["extra_info"]["kind"] == kind]
        assert entry["metrics"]["eval/accuracy"]["value"] == pytest.approx(sum(mine) / len(mine))


def test_samples_are_known_by_generator_seed_and_index_whatever_the_prompt(tmp_path):
    """Two runs on the same items pair (verl compare) even when their prompts differ (another system prompt)."""
    from verl.config import DataConfig
    from verl.data.dataset import RLHFDataset
    from verl.models.tiny import build_char_tokenizer

    tokenizer, config = build_char_tokenizer(), DataConfig(max_prompt_length=512, apply_chat_template=False)
    plain = RLHFDataset(["reasoning_gym:chain_sum?size=5&seed=2&system_prompt=none"], tokenizer, config)
    prompted = RLHFDataset(["reasoning_gym:chain_sum?seed=2&size=5&system_prompt=direct"], tokenizer, config)
    assert plain.sample_keys == prompted.sample_keys and len(set(plain.sample_keys)) == 5
    assert plain.sample_keys[3].endswith("@2+3")
    other = RLHFDataset(["reasoning_gym:chain_sum?size=5&seed=2&min_terms=3&system_prompt=none"], tokenizer, config)
    assert not set(other.sample_keys) & set(plain.sample_keys)  # another config: other items

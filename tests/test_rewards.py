"""Rule rewards and answer extraction as lm-evaluation-harness and verl define them, custom reward loading,
and the RewardManager (score at the last valid token; only masked tokens decoded) on the real tiny tokenizer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verl.config import RewardConfig
from verl.errors import ConfigError, VerlError
from verl.models.tiny import build_char_tokenizer
from verl.protocol import DataProto
from verl.rewards.extract import (
    ARITHMETIC_STRICT,
    INVALID,
    answers_match,
    extract_flexible,
    extract_strict,
    last_boxed,
    math_equal,
    normalize_answer,
)
from verl.rewards.registry import REWARD_FNS, get_reward_fn, load_custom_reward, reward_for_data_source
from verl.workers.reward import RewardManager

# ----------------------------------------------------------------------------------------------- gsm8k extraction


@pytest.mark.parametrize(
    ("response", "strict", "flexible"),
    [
        # REFERENCES: "... The answer is $72." -> strict [invalid], flexible 72 after normalisation.
        ("Natalia sold 48 clips, then 24. The answer is 72.", INVALID, "72."),
        ("The answer is $72.", INVALID, "$72."),
        ("It costs $1,234.", INVALID, "$1,234."),
        ("So 5 + 3 = 8\n#### 8", "8", "8"),
        ("#### -1,234.5 dollars", "-1,234.5", "-1,234.5"),
        # strict = first match, flexible = last match
        ("#### 3 no wait #### 4", "3", "4"),
        ("x 7 y", INVALID, "7"),  # a single digit only matches the second alternative
        ("no numbers here", INVALID, INVALID),
        ("####5", INVALID, "5"),  # strict needs the space
    ],
)
def test_gsm8k_strict_and_flexible_extraction(response, strict, flexible):
    assert extract_strict(response) == strict
    assert extract_flexible(response) == flexible


@pytest.mark.parametrize(
    ("raw", "normalised"),
    [("$1,234.", "1234"), ("72.", "72"), ("The answer: #### 42.", "42"), ("ABC", "abc"), (" -5 ", "-5"),
     ("3.14", "3.14"), ("1.", "1")],
)
def test_gsm8k_normalisation(raw, normalised):
    assert normalize_answer(raw) == normalised


def test_answers_match_after_normalisation():
    assert answers_match(extract_flexible("It costs $1,234."), "1234")
    assert answers_match(extract_flexible("The answer is 72."), "#### 72")  # references lose "... #### " too
    assert answers_match("72", "72.")
    assert not answers_match(INVALID, INVALID)
    assert not answers_match("71", "72")


def test_gsm8k_reward_strict_versus_flexible():
    gsm8k = get_reward_fn("gsm8k")
    assert gsm8k("openai/gsm8k", "48 + 24 = 72\n#### 72", "72") == {"score": 1.0, "acc": 1.0, "acc_flexible": 1.0}
    assert gsm8k("openai/gsm8k", "The answer is 72.", "72") == {"score": 0.0, "acc": 0.0, "acc_flexible": 1.0}
    assert gsm8k("openai/gsm8k", "#### 1,234", "1234")["score"] == 1.0
    assert gsm8k("openai/gsm8k", "#### $1,234.", "1234")["score"] == 0.0  # "$" is outside the strict pattern
    assert gsm8k("openai/gsm8k", "#### 71", "72")["score"] == 0.0


def test_gsm8k_reward_uses_the_last_answer_in_the_last_300_chars_like_verl():
    gsm8k = get_reward_fn("gsm8k")
    assert gsm8k("gsm8k", "#### 3 no wait, #### 4", "4")["score"] == 1.0
    early = "#### 72" + " blah" * 70  # 350 characters after the answer
    assert gsm8k("gsm8k", early, "72")["score"] == 0.0
    assert gsm8k("gsm8k", " blah" * 70 + "#### 72", "72")["score"] == 1.0


def test_arithmetic_reward_strict_format():
    arithmetic = get_reward_fn("arithmetic")
    assert extract_strict("so >> 357", ARITHMETIC_STRICT) == "357"
    assert arithmetic("arithmetic", ">> 357", "357") == {"score": 1.0, "acc": 1.0, "acc_flexible": 1.0}
    for plain in ("357", "is 357", ">>357"):  # the SFT mix's other formats earn no reward
        assert arithmetic("arithmetic", plain, "357") == {"score": 0.0, "acc": 0.0, "acc_flexible": 1.0}
    assert arithmetic("arithmetic", ">> 356", "357") == {"score": 0.0, "acc": 0.0, "acc_flexible": 0.0}
    assert arithmetic("arithmetic", ">> -5", "-5")["score"] == 1.0
    assert arithmetic("arithmetic", ">> 1,000", "1000")["score"] == 1.0


# ----------------------------------------------------------------------------------------------- math / exact


@pytest.mark.parametrize(
    ("text", "boxed"),
    [
        (r"so \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),
        (r"\boxed{{a}+{b}}", "{a}+{b}"),
        (r"first \boxed{2} then \boxed{3}", "3"),
        (r"\fbox{7}", "7"),
        (r"$\boxed 5$", "5"),
        (r"\boxed{3", None),  # unbalanced
        ("no box", None),
    ],
)
def test_last_boxed(text, boxed):
    assert last_boxed(text) == boxed


@pytest.mark.parametrize(
    ("solution", "truth", "score"),
    [
        (r"The answer is $\boxed{\frac{1}{2}}$.", r"\frac{1}{2}", 1.0),
        (r"$\boxed{\dfrac{1}{2}}$", r"\frac{1}{2}", 1.0),
        (r"\boxed{5.}", "5", 1.0),  # trailing dot
        (r"\boxed{3.0}", "3", 1.0),
        (r"\boxed{0.5}", r"\boxed{0.50}", 1.0),  # a boxed reference is unboxed; numbers compare numerically
        (r"\boxed{\left( 1, 2 \right)}", "(1,2)", 1.0),
        (r"\boxed{\text{5}}", "5", 1.0),
        (r"\boxed{2} and later \boxed{3}", "2", 0.0),  # the last box counts
        ("the answer is 5", "5", 0.0),  # no box
        (r"\boxed{\frac{1}{3}}", r"\frac{1}{2}", 0.0),
    ],
)
def test_math_boxed_reward(solution, truth, score):
    assert get_reward_fn("math")("math", solution, truth) == {"score": score, "acc": score}


def test_math_equal_handles_none():
    assert not math_equal(None, "1")


def test_exact_match():
    exact = get_reward_fn("exact_match")
    assert exact("x", "  42\n", "42") == {"score": 1.0, "acc": 1.0}
    assert exact("x", "42.", "42")["score"] == 0.0
    assert exact("x", "7", 7)["score"] == 1.0


# ----------------------------------------------------------------------------------------------- registry


def test_reward_for_data_source_dispatch():
    assert reward_for_data_source("openai/gsm8k") is REWARD_FNS["gsm8k"]
    assert reward_for_data_source("gsm8k") is REWARD_FNS["gsm8k"]
    assert reward_for_data_source("arithmetic") is REWARD_FNS["arithmetic"]
    assert reward_for_data_source("lighteval/MATH") is REWARD_FNS["math"]
    assert reward_for_data_source("DigitalLearningGmbH/MATH-lighteval") is REWARD_FNS["math"]
    assert reward_for_data_source("something/else") is REWARD_FNS["exact_match"]


def test_unknown_reward_name():
    with pytest.raises(ConfigError, match="reward.name='nope'.*gsm8k"):
        get_reward_fn("nope")


CUSTOM = '''
def my_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0, **kwargs):
    return float(len(solution_str)) + bonus

def as_dict(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return {"score": float(solution_str == ground_truth), "hit": solution_str == ground_truth, "note": "text"}

def broken(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    raise RuntimeError("boom")

not_a_function = 3
'''


@pytest.fixture()
def custom_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(CUSTOM)
    return path


def test_load_custom_reward(custom_file):
    fn = load_custom_reward(str(custom_file), "my_score")
    assert fn("src", "abcd", "x") == 4.0
    with pytest.raises(ConfigError, match="reward.custom_reward.path.*does not exist"):
        load_custom_reward(str(custom_file.parent / "missing.py"), "my_score")
    with pytest.raises(ConfigError, match="reward.custom_reward.name.*'nope'"):
        load_custom_reward(str(custom_file), "nope")
    with pytest.raises(ConfigError, match="reward.custom_reward.name.*'not_a_function'"):
        load_custom_reward(str(custom_file), "not_a_function")


# ----------------------------------------------------------------------------------------------- RewardManager


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def response_batch(tokenizer, texts: list[str], with_eos: list[bool], sources, truths, width: int = 12,
                   garbage: str = "99") -> DataProto:
    """Right-padded responses; after the masked part sits ``garbage`` (digits!) that must never be decoded."""
    responses = torch.full((len(texts), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(texts), width), dtype=torch.long)
    for i, (text, eos) in enumerate(zip(texts, with_eos, strict=True)):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if eos else [])
        tail = tokenizer(garbage, add_special_tokens=False)["input_ids"]
        row = (ids + tail)[:width]
        responses[i, : len(row)] = torch.tensor(row)
        mask[i, : len(ids)] = 1
    return DataProto.from_dict(
        {"responses": responses, "response_mask": mask},
        {"data_source": sources, "ground_truth": truths, "extra_info": [{} for _ in texts]},
    )


def test_reward_manager_scores_at_the_last_valid_token(tokenizer):
    batch = response_batch(
        tokenizer,
        [">> 12", "12", ">> 7", "#### 5"],
        [True, True, False, True],
        ["arithmetic", "arithmetic", "arithmetic", "openai/gsm8k"],
        ["12", "12", "7", "5"],
    )
    scores, extras, texts = RewardManager(tokenizer).compute(batch)
    # Only masked tokens are decoded (eos is special and dropped; the trailing "99" is not masked).
    assert texts == [">> 12", "12", ">> 7", "#### 5"]
    assert scores.shape == (4, 12) and scores.dtype == torch.float32
    # Last valid token = mask length - 1: ">> 12"+eos -> 5; "12"+eos -> 2; ">> 7" (no eos) -> 3; "#### 5"+eos -> 6.
    expected = torch.zeros(4, 12)
    expected[0, 5], expected[2, 3], expected[3, 6] = 1.0, 1.0, 1.0
    torch.testing.assert_close(scores, expected, atol=0, rtol=0)
    np.testing.assert_array_equal(extras["acc"], [1, 0, 1, 1])
    np.testing.assert_array_equal(extras["acc_flexible"], [1, 1, 1, 1])


def test_reward_manager_with_a_named_and_a_custom_function(tokenizer, custom_file):
    batch = response_batch(tokenizer, ["12", "3"], [True, False], ["arithmetic", "x"], ["12", "4"], width=4)
    scores, extras, _ = RewardManager(tokenizer, RewardConfig(name="exact_match")).compute(batch)
    assert scores.tolist() == [[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]

    config = RewardConfig(custom_reward={"path": str(custom_file), "name": "my_score"}, kwargs={"bonus": 0.5})
    scores, extras, _ = RewardManager(tokenizer, config).compute(batch)
    assert scores.tolist() == [[0.0, 0.0, 2.5, 0.0], [1.5, 0.0, 0.0, 0.0]]  # len("12") + .5; len("3") + .5
    assert extras == {}

    config = RewardConfig(custom_reward={"path": str(custom_file), "name": "as_dict"})
    scores, extras, _ = RewardManager(tokenizer, config).compute(batch)
    assert scores.sum(-1).tolist() == [1.0, 0.0]
    assert set(extras) == {"hit"}  # non-numeric extras are not logged
    np.testing.assert_array_equal(extras["hit"], [1.0, 0.0])


def test_reward_manager_names_the_failing_sample(tokenizer, custom_file):
    batch = response_batch(tokenizer, ["1"], [True], ["src"], ["1"], width=3)
    config = RewardConfig(custom_reward={"path": str(custom_file), "name": "broken"})
    with pytest.raises(VerlError, match=r"broken failed on sample 0 \(data_source='src'\).*RuntimeError: boom"):
        RewardManager(tokenizer, config).compute(batch)

"""Accuracy: lm-eval gsm8k strict/flexible extraction, the arithmetic `>> N` rule, pass@k and maj@k."""

from __future__ import annotations

import pytest

from tests.eval.helpers import make_batch
from verl.evaluators.accuracy import Accuracy, strict_answer
from verl.evaluators.stats import pass_at_k


@pytest.mark.parametrize(
    ("response", "truth", "strict", "flexible"),
    [
        ("The answer is $1,234.", "1234", 0.0, 1.0),  # flexible: "$1,234." -> drop $ , and trailing . -> 1234
        ("#### 1,234.", "1234", 1.0, 1.0),
        ("#### $1,234.", "1234", 0.0, 1.0),  # strict needs a digit right after "#### "
        ("The answer is 72.", "72", 0.0, 1.0),  # REFERENCES: strict [invalid], flexible 72
        ("... The answer is $72.", "72", 0.0, 1.0),
        ("#### 72", "#### 72", 1.0, 1.0),  # the reference is normalised too
        ("no number here", "5", 0.0, 0.0),
    ],
)
def test_gsm8k_strict_and_flexible(response, truth, strict, flexible):
    result = Accuracy().evaluate(make_batch([response], [truth], data_source="openai/gsm8k"))
    assert result.metrics["accuracy"].value == strict
    assert result.metrics["accuracy_flexible"].value == flexible


def test_gsm8k_first_vs_last_strict_answer():
    # lm-eval strict-match takes the first `#### N`; verl's gsm8k reward (and so `accuracy`) the last one.
    result = Accuracy().evaluate(make_batch(["#### 1 wait, recheck: #### 72"], ["72"], data_source="openai/gsm8k"))
    assert result.metrics["accuracy"].value == 1.0
    assert result.metrics["accuracy_lm_eval_strict"].value == 0.0


def test_arithmetic_strict_format_and_reward_parity():
    batch = make_batch([">> 42", "42", "is 42", ">> 41"], ["42"] * 4)
    result = Accuracy().evaluate(batch)
    assert result.per_sample["accuracy"].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert result.per_sample["accuracy_flexible"].tolist() == [1.0, 1.0, 1.0, 0.0]
    assert result.per_sample["exact_match"].tolist() == [0.0, 1.0, 0.0, 0.0]
    # The reward function's own verdict (what the trainer logs as eval/accuracy) wins when present.
    batch = make_batch([">> 42", "42"], ["42", "42"], extras={"acc": [0.0, 1.0]})
    assert Accuracy().evaluate(batch).per_sample["accuracy"].tolist() == [0.0, 1.0]


def test_boxed_answers():
    batch = make_batch(["so \\boxed{\\frac{1}{2}}", "\\boxed{3}"], ["\\frac12", "4"], data_source="math")
    result = Accuracy().evaluate(batch)
    assert strict_answer("math", "x \\boxed{7} y") == "7"
    assert result.metrics["accuracy_boxed"].value == pytest.approx(0.0)  # \frac{1}{2} vs \frac12 differ as text
    batch = make_batch(["\\boxed{0.5}", "\\boxed{3}"], ["0.5", "3"], data_source="math")
    assert Accuracy().evaluate(batch).metrics["accuracy"].value == 1.0


def test_pass_at_k_and_maj_at_k_per_prompt():
    # prompt 0: 1 of 4 correct; prompt 1: 3 of 4 correct (majority ">> 7").
    responses = [">> 5", ">> 9", ">> 9", ">> 1", ">> 7", ">> 7", ">> 2", ">> 7"]
    truths = ["5"] * 4 + ["7"] * 4
    result = Accuracy().evaluate(make_batch(responses, truths, n=4))
    m = result.metrics
    assert m["pass@1"].value == pytest.approx((0.25 + 0.75) / 2)
    assert m["pass@2"].value == pytest.approx((pass_at_k(4, 1, 2) + pass_at_k(4, 3, 2)) / 2)
    assert m["pass@4"].value == pytest.approx(1.0)
    # maj@4: prompt 0 votes "9" (wrong), prompt 1 votes "7" (right); maj@2: prompt 0 tie 5/9 -> first seen "5".
    assert m["maj@4"].value == pytest.approx(0.5)
    assert m["maj@2"].value == pytest.approx(1.0)
    # Prompt-level numbers: clustered SE equals the SE over the 2 prompts.
    assert m["pass@1"].se == pytest.approx(abs(0.75 - 0.25) / 2)


def test_pass_at_k_on_partial_credit_counts_full_credit_only():
    """reasoning-gym and environments give partial credit: accuracy is the mean credit, a sample passes with 1.0.
    Prompt 0's credits 1, 0.5, 0.5, 0 (1 solved of 4), prompt 1's 0.9, 0.9, 0.9, 0.9 (none solved)."""
    credit = [1.0, 0.5, 0.5, 0.0, 0.9, 0.9, 0.9, 0.9]
    batch = make_batch(["x"] * 8, ["y"] * 8, n=4, extras={"acc": credit})
    m = Accuracy().evaluate(batch).metrics
    assert m["accuracy"].value == pytest.approx(sum(credit) / 8)
    assert m["pass@1"].value == pytest.approx((1 / 4 + 0) / 2)
    assert m["pass@2"].value == pytest.approx((1 - 3 / 4 * 2 / 3 + 0) / 2)  # 1 - C(3,2)/C(4,2) = 1/2 for prompt 0
    assert m["pass@4"].value == pytest.approx(0.5)


def test_missing_ground_truth_is_a_clear_error():
    from verl.errors import DataError

    with pytest.raises(DataError, match="ground_truth_key"):
        Accuracy().evaluate(make_batch(["1"], [None]))

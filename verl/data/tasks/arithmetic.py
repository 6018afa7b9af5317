"""The built-in ``arithmetic`` task: ``What is 47+385?`` with a ground-truth answer.

It plays the role GSM8K plays for real models. The SFT data mixes answer formats (60% plain ``432``,
20% ``>> 432``, 20% ``is 432``) while the reward and the reported accuracy use the strict ``>> N`` format
(the analogue of gsm8k's ``#### N``). A warm-started model therefore knows the arithmetic but rarely uses the
rewarded format under greedy decoding, and RL has real work to do: move probability mass onto the format
it already produces sometimes when sampling, without forgetting the arithmetic.

Rows follow verl's parquet layout: ``data_source``, ``prompt`` (chat messages), ``ability``,
``reward_model`` ({"style": "rule", "ground_truth": ...}) and ``extra_info``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from verl.data.tasks import SpecKey

DATA_SOURCE = "arithmetic"

# (format template, weight) for supervised targets; only ">> {}" earns reward.
SFT_ANSWER_FORMATS: tuple[tuple[str, float], ...] = (("{}", 0.6), (">> {}", 0.2), ("is {}", 0.2))


@dataclass(frozen=True)
class ArithmeticSpec(SpecKey):
    """Which problems the task generates. Operands have ``min_digits``..``max_digits`` digits."""

    min_digits: int = 1
    max_digits: int = 3
    ops: tuple[str, ...] = ("+",)
    num_train: int = 20000
    num_val: int = 256
    num_test: int = 512  # held out from training and from checkpoint selection (verl ship's offline gate)
    # What load tests send by default: served traffic that a flywheel may train on must not be a yardstick's prompts.
    num_traffic: int = 512
    seed: int = 1234
    answer_formats: tuple[tuple[str, float], ...] = field(default=SFT_ANSWER_FORMATS)


def _operand(rng: random.Random, spec: ArithmeticSpec) -> int:
    digits = rng.randint(spec.min_digits, spec.max_digits)
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10**digits - 1)


def _solve(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    raise ValueError(f"unsupported operator {op!r}; use one of + - *")


def _row(a: int, op: str, b: int, split: str, index: int) -> dict:
    answer = str(_solve(a, op, b))
    return {"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": f"What is {a}{op}{b}?"}],
            "ability": "arithmetic", "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": split, "index": index, "question": f"{a}{op}{b}"}}


def generate_splits(spec: ArithmeticSpec) -> dict[str, list[dict]]:
    """Deterministic, disjoint train, validation, test and traffic problems for ``spec`` (test and traffic may fall
    short of their counts when the operand space is nearly used up)."""
    rng = random.Random(spec.seed)
    seen: set[tuple[int, str, int]] = set()
    splits: dict[str, list[dict]] = {"val": [], "train": []}
    # Validation first so its problems are fixed even if num_train changes.
    for split, count in (("val", spec.num_val), ("train", spec.num_train)):
        attempts = 0
        while len(splits[split]) < count:
            attempts += 1
            if attempts > 50 * count + 1000:
                raise ValueError(
                    f"arithmetic task: cannot draw {count} distinct {split} problems with "
                    f"{spec.min_digits}-{spec.max_digits} digit operands; lower num_{split} or raise max_digits"
                )
            problem = (_operand(rng, spec), rng.choice(spec.ops), _operand(rng, spec))
            if problem in seen:
                continue
            seen.add(problem)
            splits[split].append(_row(*problem, split=split, index=len(splits[split])))
    # The test split comes last, from a generator of its own: val and train stay what they were without it.
    test = _draw(random.Random(f"{spec.seed}-test"), spec, seen, spec.num_test, "test")
    splits["test"] = test
    # Then the traffic split, from its own generator again: disjoint from all three, and none of them moves.
    splits["traffic"] = _draw(random.Random(f"{spec.seed}-traffic"), spec, seen, spec.num_traffic, "traffic")
    return splits


def _draw(rng: random.Random, spec: ArithmeticSpec, seen: set, count: int, split: str) -> list[dict]:
    """Up to ``count`` problems none of ``seen`` holds (fewer when the operand space is nearly used up)."""
    rows: list[dict] = []
    for _ in range(50 * count + 1000):
        if len(rows) >= count:
            break
        problem = (_operand(rng, spec), rng.choice(spec.ops), _operand(rng, spec))
        if problem not in seen:
            seen.add(problem)
            rows.append(_row(*problem, split=split, index=len(rows)))
    return rows


def sft_response(ground_truth: str, rng: random.Random, formats=SFT_ANSWER_FORMATS) -> str:
    """A supervised target for one problem, its format drawn from the mix in ``formats``."""
    templates, weights = zip(*formats, strict=True)
    return rng.choices(templates, weights=weights, k=1)[0].format(ground_truth)


def near_miss(ground_truth: str, rng: random.Random) -> str:
    """A wrong answer a solver could plausibly give: the true answer with one digit changed (a slip or a lost carry),
    same length, no leading zero, sign kept."""
    sign, digits = ("-", ground_truth[1:]) if ground_truth.startswith("-") else ("", ground_truth)
    position = rng.randrange(len(digits))
    low = 1 if position == 0 and len(digits) > 1 else 0
    choices = [str(d) for d in range(low, 10) if str(d) != digits[position]]
    return sign + digits[:position] + rng.choice(choices) + digits[position + 1:]


def wrong_answer(ground_truth: str, rng: random.Random) -> str:
    """A wrong answer of the right shape: a random number with as many digits as the true one (same sign, no leading
    zero). Telling it apart needs the sum's size and leading digits, not an exact check of every digit."""
    sign, digits = ("-", ground_truth[1:]) if ground_truth.startswith("-") else ("", ground_truth)
    low, high = (0, 9) if len(digits) == 1 else (10 ** (len(digits) - 1), 10 ** len(digits) - 1)
    while True:
        candidate = sign + str(rng.randint(low, high))
        if candidate != ground_truth:
            return candidate


def preference_pairs(rows: list[dict], rng: random.Random, per_problem: int = 1, near: bool = False) -> list[dict]:
    """Preference pairs for reward-model training (TRL's prompt / chosen / rejected columns): the correct answer
    preferred to a wrong one, both in the strict ``>> N`` format, so the pairs differ in correctness only. The wrong
    answer is a same-length number (``wrong_answer``), or with ``near`` a one-digit slip (``near_miss``: the harder
    check, reported apart)."""
    pairs = []
    for row in rows:
        truth = row["reward_model"]["ground_truth"]
        for _ in range(per_problem):
            wrong = near_miss(truth, rng) if near else wrong_answer(truth, rng)
            pairs.append({**row, "chosen": f">> {truth}", "rejected": f">> {wrong}"})
    return pairs

"""The built-in ``code_functions`` task: write one small Python function, scored by running it in the sandbox.

    Write a Python function `add_7(x)` that returns x plus 7.
    Answer with the function in a ```python code block.

Each row's ground truth is verl's call-based form (``{"inputs": [[arg], ...], "outputs": [...], "fn_name"}``), so
the ``code`` reward (``verl/rewards/code.py``) scores it as the fraction of calls answered right. The functions are
drawn from a few families (add or multiply by a constant, a remainder test, reverse or repeat a string, count a
character, the largest or the sum of a list, clamp) with constants and names drawn per row, so a model has to read
the statement, not recall a name. Splits ``train``, ``val`` and ``test`` never share a (family, constant) pair.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass

from verl.data.tasks import SpecKey

DATA_SOURCE = "code"
INSTRUCTION = "Answer with the function in a ```python code block."


@dataclass(frozen=True)
class CodeFunctionsSpec(SpecKey):
    num_train: int = 2000
    num_val: int = 64
    num_test: int = 64
    cases: int = 4  # calls per function in its ground truth
    seed: int = 2718


# family -> (name template, statement template, function of (constant, argument), argument generator)
Family = tuple[str, str, Callable[[int, object], object], Callable[[random.Random], object]]
_WORDS = ("cat", "moon", "river", "stone", "apple", "zebra", "lamp", "tiger")


def _word(rng: random.Random) -> str:
    return rng.choice(_WORDS)


def _numbers(rng: random.Random) -> list[int]:
    return [rng.randint(-20, 40) for _ in range(rng.randint(1, 6))]


FAMILIES: dict[str, Family] = {
    "add": ("add_{k}", "returns x plus {k}", lambda k, x: x + k, lambda r: r.randint(-50, 50)),
    "mul": ("times_{k}", "returns x multiplied by {k}", lambda k, x: x * k, lambda r: r.randint(-30, 30)),
    "mod": ("divisible_by_{k}", "returns True when the integer x is divisible by {k}, else False",
            lambda k, x: x % k == 0, lambda r: r.randint(0, 100)),
    "repeat": ("repeat_{k}", "returns the string s repeated {k} times", lambda k, s: s * k, _word),
    "reverse_add": ("reverse_then_{k}", "returns the string s reversed, followed by the digit {k}",
                    lambda k, s: s[::-1] + str(k % 10), _word),
    "max_plus": ("max_plus_{k}", "returns the largest number in the non-empty list xs, plus {k}",
                 lambda k, xs: max(xs) + k, _numbers),
    "sum_times": ("sum_times_{k}", "returns the sum of the list xs multiplied by {k}",
                  lambda k, xs: sum(xs) * k, _numbers),
    "clamp": ("clamp_{k}", "returns x, but at most {k}", lambda k, x: min(x, k), lambda r: r.randint(-20, 60)),
}
_ARGUMENT = {"repeat": "s", "reverse_add": "s", "max_plus": "xs", "sum_times": "xs"}


def _row(family: str, k: int, split: str, index: int, rng: random.Random, spec: CodeFunctionsSpec) -> dict:
    name_t, statement_t, fn, arg = FAMILIES[family]
    name, argument = name_t.format(k=k), _ARGUMENT.get(family, "x")
    args = [arg(rng) for _ in range(spec.cases)]
    truth = {"inputs": [[a] for a in args], "outputs": [fn(k, a) for a in args], "fn_name": name}
    question = f"Write a Python function `{name}({argument})` that {statement_t.format(k=k)}.\n{INSTRUCTION}"
    return {"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": question}], "ability": "code",
            "reward_model": {"style": "rule", "ground_truth": json.dumps(truth)},
            "extra_info": {"split": split, "index": index, "family": family, "constant": k}}


def generate_splits(spec: CodeFunctionsSpec) -> dict[str, list[dict]]:
    """Deterministic splits; a (family, constant) pair belongs to one split only."""
    rng = random.Random(spec.seed)
    pairs = [(family, k) for family in FAMILIES for k in range(2, 60)]
    rng.shuffle(pairs)
    held = {"val": pairs[:len(pairs) // 10], "test": pairs[len(pairs) // 10: len(pairs) // 5]}
    held["train"] = pairs[len(pairs) // 5:]
    splits: dict[str, list[dict]] = {}
    for split, count in (("train", spec.num_train), ("val", spec.num_val), ("test", spec.num_test)):
        split_rng = random.Random(f"{spec.seed}-{split}")
        splits[split] = [_row(*split_rng.choice(held[split]), split, i, split_rng, spec) for i in range(count)]
    return splits

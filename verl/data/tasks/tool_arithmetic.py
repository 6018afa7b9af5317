"""The built-in ``tool_arithmetic`` task: products no tiny model computes in its head, with a calculator at hand.

    What is 37*412?

The answer is scored like the arithmetic task (strict ``>> N``, flexible extraction beside it). A 1M-parameter
character model cannot multiply two- and three-digit numbers; it can learn to copy them into a ``calculator`` call
and copy the result into its answer, which is what RL has to teach it::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "37*412"}}
    </tool_call></s><|tool|>15244
    <|assistant|>>> 15244</s>

Splits: ``train`` / ``val`` (RL prompts; every row carries its tools' OpenAI schemas in a ``tools`` column, as a
JSON string because parquet stores no schema-free structs),
and ``sft_train`` / ``sft_val`` (whole conversations in a ``messages`` column for the supervised warm start). The
warm start sees a few tool-use demonstrations (``tool_share``, 25%) among answers written straight away (wrong
for almost every product, as the model will be): it knows the format of a call but rarely makes one, so RL has
work to do, as the arithmetic task's warm start rarely uses the rewarded format. Validation problems are operand
pairs no training problem uses.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from verl.data.tasks import SpecKey
from verl.tools.calculator import SCHEMA as CALCULATOR_SCHEMA

DATA_SOURCE = "tool_arithmetic"
TOOL = "calculator"


@dataclass(frozen=True)
class ToolArithmeticSpec(SpecKey):
    """Which problems the task generates: ``a*b`` with ``min_digits``..``max_digits``-digit operands."""

    min_digits: int = 2
    max_digits: int = 3
    num_train: int = 20000
    num_val: int = 256
    num_sft: int = 6000
    tool_share: float = 0.25  # SFT conversations that call the calculator; the rest answer at once
    seed: int = 4321


def _operand(rng: random.Random, spec: ToolArithmeticSpec) -> int:
    digits = rng.randint(spec.min_digits, spec.max_digits)
    return rng.randint(10 ** (digits - 1), 10**digits - 1)


def _rl_row(a: int, b: int, split: str, index: int) -> dict:
    return {"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": f"What is {a}*{b}?"}],
            "ability": "arithmetic", "reward_model": {"style": "rule", "ground_truth": str(a * b)},
            "extra_info": {"split": split, "index": index, "question": f"{a}*{b}"},
            "tools": json.dumps([CALCULATOR_SCHEMA])}


def _conversation(a: int, b: int, rng: random.Random, spec: ToolArithmeticSpec) -> list[dict]:
    """A demonstration: call the calculator and answer with its result, or answer at once (a plausible guess:
    right leading digits, wrong tail, as a model without a calculator would)."""
    question = {"role": "user", "content": f"What is {a}*{b}?"}
    answer = a * b
    if rng.random() < spec.tool_share:
        call = {"id": "call_0", "type": "function", "function": {"name": TOOL, "arguments": {"expression": f"{a}*{b}"}}}
        return [question, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_0", "content": str(answer)},
                {"role": "assistant", "content": f">> {answer}"}]
    digits = len(str(answer))
    keep = max(1, digits // 2)
    guess = int(str(answer)[:keep] + "".join(str(rng.randint(0, 9)) for _ in range(digits - keep)))
    return [question, {"role": "assistant", "content": f">> {guess}"}]


def generate_splits(spec: ToolArithmeticSpec) -> dict[str, list[dict]]:
    """Deterministic splits; validation pairs (either order) never appear in training."""
    rng = random.Random(spec.seed)
    seen: set[tuple[int, int]] = set()
    pairs: dict[str, list[tuple[int, int]]] = {"val": [], "train": []}
    for split, count in (("val", spec.num_val), ("train", spec.num_train)):
        while len(pairs[split]) < count:
            a, b = _operand(rng, spec), _operand(rng, spec)
            if (a, b) in seen or (b, a) in seen:
                continue
            seen.add((a, b))
            pairs[split].append((a, b))
    splits = {split: [_rl_row(a, b, split, i) for i, (a, b) in enumerate(found)] for split, found in pairs.items()}
    for split, source, count in (("sft_train", "train", spec.num_sft), ("sft_val", "val", spec.num_val)):
        sft_rng = random.Random(f"{spec.seed}-{split}")
        splits[split] = [{**row, "messages": json.dumps(_conversation(a, b, sft_rng, spec))} for row,
                         (a, b) in list(zip(splits[source], pairs[source], strict=True))[:count]]
    return splits

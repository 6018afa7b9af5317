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
in each of A boxes"), the construction the validation wording opens with.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pyarrow.parquet as pq

from verl.data.builtin import resolve_data_file, write_parquet
from verl.data.tasks import tool_word_problems as task

WIDE = {
    "add": ["{n} picks {a} {i} in the morning and {b} {i} in the afternoon. How many {i} does {n} pick altogether?",
            "A library has {a} {i}. It buys {b} more {i}. How many {i} does the library have now?"],
    "take": ["{n} had {a} {i}. After using {b} of them, how many {i} does {n} have left?",
             "A farm had {a} {i} and {b} {i} were eaten. How many {i} are left on the farm?"],
    "groups": ["There are {a} teams and each team has {b} {i}. How many {i} are there altogether?",
               "{a} children each bring {b} {i} to school. How many {i} do the children bring in total?"],
    "share": ["{n} puts {a} {i} into {b} bags, the same number in each bag. How many {i} go in each bag?",
              "{a} {i} are divided equally among {b} boxes. How many {i} are in each box?"],
    "times": ["A small bag fits {a} {i}. A large bag fits {b} times as many {i}. How many {i} fit in the large bag?",
              "{n} scored {a} points. The coach scored {b} times as many points. How many points did the coach score?"],
    "two_steps": ["{n} fills {a} trays with {b} {i} on each tray and keeps {c} more {i} aside. How many {i} does {n} "
                  "have in all?",
                  "There are {a} boxes of {b} {i} and a bag of {c} {i}. How many {i} are there in total?"],
}
EXTRA = {
    "wide": WIDE,
    "wide2": {**WIDE, "groups": ["There are {b} {i} in each of {a} boxes. How many {i} are there altogether?",
                                 WIDE["groups"][1]]},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=sorted(EXTRA), default="wide")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
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

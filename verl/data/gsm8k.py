"""Convert GSM8K (``openai/gsm8k``, config ``main``: columns ``question``, ``answer``) to the trainer's format.

The ground truth is the number after ``#### `` in the answer; the prompt asks for the same ``#### N`` format
the ``gsm8k`` reward scores (strict extraction).
"""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq

from verl.data.builtin import write_parquet
from verl.errors import DataError

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def gsm8k_rows(rows: list[dict], split: str) -> list[dict]:
    out = []
    for i, row in enumerate(rows):
        if "question" not in row or "answer" not in row:
            raise DataError(f"GSM8K {split} row {i}: expected columns 'question' and 'answer', got {sorted(row)}")
        answer = str(row["answer"]).split("####")[-1].strip().replace(",", "")
        out.append({"data_source": "openai/gsm8k",
                    "prompt": [{"role": "user", "content": f"{row['question']} {INSTRUCTION}"}], "ability": "math",
                    "reward_model": {"style": "rule", "ground_truth": answer},
                    "extra_info": {"split": split, "index": i, "answer": row["answer"], "question": row["question"]}})
    return out


def convert_gsm8k(src: Path, out: Path) -> dict[str, Path]:
    """Read ``train*.parquet`` and ``test*.parquet`` under ``src``; write ``train.parquet``/``test.parquet``."""
    written = {}
    for split in ("train", "test"):
        files = sorted(Path(src).glob(f"**/{split}*.parquet"))
        if not files:
            raise DataError(f"no {split}*.parquet under '{src}'; download openai/gsm8k (config 'main') there first")
        rows = [r for f in files for r in pq.read_table(f).to_pylist()]
        written[split] = write_parquet(gsm8k_rows(rows, split), Path(out) / f"{split}.parquet")
    return written

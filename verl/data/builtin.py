"""Resolve ``builtin:<task>/<split>`` dataset names to deterministic parquet files written by the project.

``builtin:arithmetic/train``, ``builtin:arithmetic/val`` and ``builtin:arithmetic/test`` (held out from training and
from checkpoint selection: ``verl ship`` gates on it), ``sft_train``/``sft_val`` (the same problems with a
supervised ``response`` column) and ``pairs_train``/``pairs_val`` (preference pairs for ``verl rm``;
``pairs_near_val``: one-digit slips) are written once per task spec into the cache directory (``$VERL_CACHE_DIR``,
default ``~/.cache/verl-suite``) and reused;
``verl data arithmetic --out DIR`` writes the same files where the user wants them.
``builtin:word_problems/train|val`` are the GSM8K-style stories for real pretrained models
(``verl.data.tasks.word_problems``); ``builtin:tool_arithmetic/train|val|sft_train|sft_val`` the products a model
solves with the calculator tool (``verl.data.tasks.tool_arithmetic``); ``builtin:tool_word_problems/...`` stories of
several kinds with a calculator, for real models (``verl.data.tasks.tool_word_problems``);
``builtin:code_functions/train|val|test`` one-function programs scored in the sandbox
(``verl.data.tasks.code_functions``); ``builtin:humaneval`` OpenAI's HumanEval (``verl.data.tasks.humaneval``).
"""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from verl.data.tasks import code_functions, humaneval, tool_arithmetic, tool_word_problems, word_problems
from verl.data.tasks.arithmetic import ArithmeticSpec, generate_splits, preference_pairs, sft_response
from verl.errors import DataError
from verl.utils.fs import atomic_path, cache_dir

BUILTIN_PREFIX = "builtin:"
BUILTIN_TASKS = ("arithmetic", "word_problems", "tool_arithmetic", "tool_word_problems", "code_functions",
                 "humaneval")
BUILTIN_SPLITS = ("train", "val", "sft_train", "sft_val")
TASK_SPLITS = {"arithmetic": (*BUILTIN_SPLITS, "test", "traffic", "pairs_train", "pairs_val", "pairs_near_val"),
               "word_problems": ("train", "val"), "tool_arithmetic": BUILTIN_SPLITS,
               "tool_word_problems": (*BUILTIN_SPLITS, "train_wide"), "code_functions": ("train", "val", "test"),
               "humaneval": ("test",)}
# Generated tasks: task -> (module with generate_splits, its default spec).
GENERATED = {"word_problems": (word_problems, word_problems.WordProblemSpec()),
             "tool_arithmetic": (tool_arithmetic, tool_arithmetic.ToolArithmeticSpec()),
             "tool_word_problems": (tool_word_problems, tool_word_problems.ToolWordProblemSpec()),
             "code_functions": (code_functions, code_functions.CodeFunctionsSpec()),
             "humaneval": (humaneval, humaneval.HumanEvalSpec())}


def write_parquet(rows: list[dict], path: Path) -> Path:
    """Write ``rows`` to ``path`` atomically (temp file + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        pq.write_table(pa.Table.from_pylist(rows), tmp)
    return path


def write_arithmetic(out_dir: Path, spec: ArithmeticSpec | None = None) -> dict[str, Path]:
    """Write ``train``, ``val``, ``test`` and ``traffic.parquet``, the SFT copies of train and val, and preference
    pairs of them (``pairs_train``, ``pairs_val``) into ``out_dir``."""
    spec = spec or ArithmeticSpec()
    splits = generate_splits(spec)
    # Supervised copies of the same problems carry a `response` in the mixed answer formats.
    for name in ("train", "val"):
        rng = random.Random(f"{spec.seed}-sft-{name}")
        splits[f"sft_{name}"] = [
            {**row, "response": sft_response(row["reward_model"]["ground_truth"], rng, spec.answer_formats)}
            for row in splits[name]
        ]
    # Preference pairs of the same problems for `verl rm` (correct vs a near miss, both in the strict format).
    splits["pairs_train"] = preference_pairs(splits["train"], random.Random(f"{spec.seed}-pairs-train"))
    splits["pairs_val"] = preference_pairs(splits["val"], random.Random(f"{spec.seed}-pairs-val"), per_problem=2)
    splits["pairs_near_val"] = preference_pairs(splits["val"], random.Random(f"{spec.seed}-pairs-near"),
                                                per_problem=2, near=True)
    return {name: write_parquet(rows, out_dir / f"{name}.parquet") for name, rows in splits.items()}


def resolve_builtin(name: str, spec: ArithmeticSpec | None = None) -> Path:
    """Map ``builtin:arithmetic/train`` (or ``/val``, ...) to a cached parquet file, written on first use."""
    task, _, split = name[len(BUILTIN_PREFIX) :].partition("/")
    if task not in BUILTIN_TASKS:
        raise DataError(f"unknown built-in dataset '{name}'; available: {', '.join(BUILTIN_TASKS)}")
    split = split or TASK_SPLITS[task][0]
    if split not in TASK_SPLITS[task]:
        raise DataError(f"built-in dataset '{name}' has no split '{split}'; use one of {', '.join(TASK_SPLITS[task])}")
    if task in GENERATED:
        module, generated = GENERATED[task]
        path = cache_dir() / "data" / f"{task}-{generated.key()}" / f"{split}.parquet"
        if not path.exists():
            for part, rows in module.generate_splits(generated).items():
                write_parquet(rows, path.parent / f"{part}.parquet")
        return path
    spec = spec or ArithmeticSpec()
    path = cache_dir() / "data" / f"{task}-{spec.key()}" / f"{split}.parquet"
    if not path.exists():
        write_arithmetic(path.parent, spec)
    return path

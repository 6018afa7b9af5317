"""Code: the share of a program's tests passed and pass@k, for rows the ``code`` reward scored in the sandbox.

- ``tests_passed``: the mean fraction of a sample's tests its program passes (the ``code`` reward's score);
- ``solved``: the share of samples that pass every test (the reward's ``acc``);
- ``pass@k``: Chen et al.'s unbiased estimator over each problem's n samples (``verl/evaluators/stats.py``), for
  k = 1 and 10 (HumanEval's) and the powers of two up to n; a prompt-level number repeated on each of its samples.

Nothing is executed here: the reward already ran each program in the sandbox (``verl/rewards/code.py``), and this
evaluator reads its verdicts, so ``verl eval -e code`` and training's validation agree by construction.
"""

from __future__ import annotations

import numpy as np

from verl.errors import DataError
from verl.evaluators.base import EvalBatch, EvalResult, Evaluator
from verl.evaluators.stats import default_ks, pass_at_k_columns


class Code(Evaluator):
    name = "code"
    needs = frozenset({"generations", "ground_truth", "rewards"})

    def __init__(self, ks: list[int] | int | None = None):
        self.ks = None if ks is None else ([ks] if isinstance(ks, int) else [int(k) for k in ks])
        self.options = {} if ks is None else {"ks": self.ks}

    def direction(self, metric: str) -> bool | None:
        return True

    def evaluate(self, batch: EvalBatch) -> EvalResult:
        solved = batch.reward_extras.get("acc")
        if batch.rewards is None or solved is None or np.isnan(solved).any():
            raise DataError("code: needs every row scored by the code reward (data_source code, apps, "
                            "codecontests, openai_humaneval ..., or reward.name=code); these rows were not")
        passed = np.asarray(batch.rewards, dtype=np.float64)
        result = EvalResult(per_sample={"tests_passed": passed, "solved": np.asarray(solved, dtype=np.float64)})
        result.metrics["tests_passed"] = self.mean("tests_passed", passed, batch)
        result.metrics["solved"] = self.mean("solved", result.per_sample["solved"], batch, binary=True)
        ks = self.ks or sorted({*default_ks(batch.n), *([10] if batch.n >= 10 else [])})
        for k, column in pass_at_k_columns(batch.prompt_index, result.per_sample["solved"], ks).items():
            result.per_sample[f"pass@{k}"] = column
            result.metrics[f"pass@{k}"] = self.mean(f"pass@{k}", column, batch)
        return result

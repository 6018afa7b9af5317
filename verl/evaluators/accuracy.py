"""Task accuracy: strict (the format the reward checks), lm-eval flexible extraction, exact match, boxed math,
and pass@k / maj@k when there are several samples per prompt.

- ``accuracy`` (strict): the reward function's own per-sample ``acc`` when it reports one, which is exactly what
  the trainer logs as ``eval/accuracy`` (for the arithmetic task: a correct ``>> N``; for gsm8k: ``#### N``);
  otherwise the strict rule for the row's data source (``strict_answer`` below).
- ``accuracy_flexible``: lm-evaluation-harness ``flexible-extract`` (last number-like span, normalised).
- ``accuracy_lm_eval_strict`` (gsm8k sources only): lm-evaluation-harness ``strict-match``, the *first*
  ``#### N`` anywhere in the response (verl's reward, and so ``accuracy``, takes the last one in the last 300
  characters; the two differ only when a response writes ``####`` more than once or early in a long answer).
- ``exact_match``: the stripped response equals the stripped ground truth.
- ``accuracy_boxed``: the last ``\\boxed{}`` equals the ground truth (reported when any boxed answer appears).
- ``pass@k`` (Chen et al. 2021, unbiased) over the strict correctness of the n samples, for k = 1, 2, 4, .., n;
  on partial credit (reasoning-gym's scores, an environment's rewards in [0, 1]) a sample passes with full credit
  (``accuracy`` >= 1), so pass@1 is the solved share while ``accuracy`` stays the mean credit;
  ``maj@k``: a majority vote over the strict answers of the first k samples. Both are prompt-level numbers: the
  per-sample column repeats the prompt's value on each of its samples, so the clustered mean and SE equal the
  per-prompt mean and SE.
"""

from __future__ import annotations

import numpy as np

from verl.errors import DataError
from verl.evaluators.base import EvalBatch, EvalResult, Evaluator
from verl.evaluators.stats import default_ks, majority_vote, pass_at_k_columns
from verl.rewards.extract import (
    ARITHMETIC_STRICT,
    GSM8K_STRICT,
    INVALID,
    answers_match,
    extract_flexible,
    extract_strict,
    last_boxed,
    math_equal,
    normalize_answer,
)
from verl.rewards.registry import DATA_SOURCE_REWARDS


def rule_name(data_source: str) -> str:
    return DATA_SOURCE_REWARDS.get(data_source, "exact_match")


def strict_answer(data_source: str, response: str) -> str | None:
    """The answer the strict rule of ``data_source`` reads from ``response`` (normalised); None if invalid."""
    rule = rule_name(data_source)
    if rule == "arithmetic":
        answer = extract_strict(response, ARITHMETIC_STRICT)
    elif rule == "gsm8k":
        # verl's gsm8k reward: the last `#### N` within the last 300 characters
        answer = extract_strict(response[-300:], GSM8K_STRICT, last=True)
    elif rule == "math":
        boxed = last_boxed(response)
        return None if boxed is None else boxed.strip()
    else:
        return response.strip()
    return None if answer == INVALID else normalize_answer(answer)


def strict_correct(data_source: str, answer: str | None, ground_truth: object) -> bool:
    if answer is None:
        return False
    rule = rule_name(data_source)
    if rule == "math":
        return math_equal(answer, last_boxed(str(ground_truth)) or str(ground_truth))
    if rule == "exact_match":
        return answer == str(ground_truth).strip()
    return answers_match(answer, str(ground_truth))


class Accuracy(Evaluator):
    name = "accuracy"
    needs = frozenset({"generations", "ground_truth", "rewards"})
    directions = {"accuracy": True, "accuracy_flexible": True, "exact_match": True, "accuracy_boxed": True,
                  "accuracy_lm_eval_strict": True}

    def __init__(self, ks: list[int] | int | None = None):
        self.ks = None if ks is None else ([ks] if isinstance(ks, int) else [int(k) for k in ks])
        if self.ks is not None and any(k < 1 for k in self.ks):
            raise TypeError(f"ks must be positive integers, got {ks!r}")
        self.options = {} if ks is None else {"ks": self.ks}

    def direction(self, metric: str) -> bool | None:
        return True if metric.startswith(("pass@", "maj@")) else self.directions.get(metric)

    def evaluate(self, batch: EvalBatch) -> EvalResult:
        if any(gt is None for gt in batch.ground_truth):
            row = next(i for i, gt in enumerate(batch.ground_truth) if gt is None)

            raise DataError(f"accuracy: sample {row} has no ground truth; set data.ground_truth_key (or --gt-key) "
                            "to the column holding the reference answer")
        answers = [strict_answer(ds, r) for ds, r in zip(batch.data_sources, batch.responses, strict=True)]
        rule_strict = np.array([strict_correct(ds, a, gt) for ds, a, gt in
                                zip(batch.data_sources, answers, batch.ground_truth, strict=True)], dtype=np.float64)
        acc = batch.reward_extras.get("acc")
        # The reward function's verdict is what training logs; fall back to the rule where it has none.
        strict = rule_strict if acc is None else np.where(np.isnan(acc), rule_strict, acc)
        flexible = np.array([answers_match(extract_flexible(r), str(gt))
                             for r, gt in zip(batch.responses, batch.ground_truth, strict=True)], dtype=np.float64)
        exact = np.array([r.strip() == str(gt).strip() for r, gt in zip(batch.responses, batch.ground_truth,
                                                                         strict=True)], dtype=np.float64)
        result = EvalResult()
        columns = {"accuracy": strict, "accuracy_flexible": flexible, "exact_match": exact}
        if any("\\boxed" in r or "\\boxed" in str(gt) for r, gt in zip(batch.responses, batch.ground_truth,
                                                                         strict=True)):
            columns["accuracy_boxed"] = np.array([
                math_equal(last_boxed(r), last_boxed(str(gt)) or str(gt))
                for r, gt in zip(batch.responses, batch.ground_truth, strict=True)], dtype=np.float64)
        if any(rule_name(ds) == "gsm8k" for ds in batch.data_sources):
            columns["accuracy_lm_eval_strict"] = np.array([
                rule_name(ds) == "gsm8k" and answers_match(extract_strict(r, GSM8K_STRICT), str(gt))
                for ds, r, gt in zip(batch.data_sources, batch.responses, batch.ground_truth, strict=True)],
                dtype=np.float64)
        for name, column in columns.items():
            result.per_sample[name] = column
            result.metrics[name] = self.mean(name, column, batch, binary=True)
        if batch.n > 1:
            self._pass_and_majority(batch, strict, answers, result)
        return result

    def _pass_and_majority(self, batch: EvalBatch, strict: np.ndarray, answers: list[str | None],
                           result: EvalResult) -> None:
        groups: dict[int, list[int]] = {}
        for i, prompt in enumerate(batch.prompt_index.tolist()):
            groups.setdefault(prompt, []).append(i)
        sizes = {len(rows) for rows in groups.values()}
        n = min(sizes)
        # full credit passes (partial credit: the module docstring)
        for k, pass_col in pass_at_k_columns(batch.prompt_index, strict, self.ks or default_ks(n)).items():
            maj_col = np.empty(len(strict))
            for rows in groups.values():
                first = rows[:k]
                voted = majority_vote([answers[i] for i in first])
                i0 = first[0]
                maj_col[rows] = float(strict_correct(batch.data_sources[i0], voted, batch.ground_truth[i0]))
            result.per_sample[f"pass@{k}"] = pass_col
            result.metrics[f"pass@{k}"] = self.mean(f"pass@{k}", pass_col, batch)
            if k > 1:
                result.per_sample[f"maj@{k}"] = maj_col
                result.metrics[f"maj@{k}"] = self.mean(f"maj@{k}", maj_col, batch, binary=True)
        if len(sizes) > 1:
            result.notes.append(f"prompts have {sorted(sizes)} samples each; pass@k/maj@k use k <= {n}")

"""Tool use in multi-turn trajectories (``rollout.multi_turn``): how often, how well, at what length.

Per trajectory (read from the rollout's non-tensor fields, ``verl/rollout/agent_loop.py``):

- ``tool_call_rate``: the share of trajectories that call at least one tool (mean of a 0/1 column, CI clustered by
  prompt);
- ``valid_call_rate``: calls that parse and fit a configured tool's JSON schema, over all calls; and
  ``tool_error_rate``: calls whose result was an error (invalid, unknown tool, timeout, exception), over all calls.
  Both are ratios of sums over trajectories (corpus metrics, bootstrap CI over prompts); NaN when no call was made;
- ``turns_mean``: assistant turns per trajectory;
- ``generated_tokens_mean``: tokens the model generated per trajectory; ``trajectory_tokens_mean``: with the
  tool turns.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from verl.evaluators.base import EvalBatch, EvalResult, Evaluator

FIELDS = ("num_turns", "num_tool_calls", "num_valid_calls", "num_tool_errors")


class Tools(Evaluator):
    name = "tools"
    needs = frozenset({"generations", "tool_calls"})
    directions = {"tool_call_rate": None, "valid_call_rate": True, "tool_error_rate": False}

    def __init__(self) -> None:
        self.options = {}

    def evaluate(self, batch: EvalBatch) -> EvalResult:
        non = batch.data.non_tensor if batch.data is not None else {}
        if any(field not in non for field in FIELDS):
            return EvalResult(notes=["tools: these responses come from single-turn rollouts; nothing to measure "
                                     "(enable rollout.multi_turn)"])
        turns, calls, valid, errors = (np.asarray(non[f], dtype=np.float64) for f in FIELDS)
        width = batch.data.batch["responses"].shape[1]
        trajectory = batch.data.batch["attention_mask"][:, -width:].sum(-1).double().numpy()
        called = (calls > 0).astype(np.float64)
        columns = {"tool_called": called, "tool_calls": calls, "valid_calls": valid, "tool_errors": errors,
                   "turns": turns, "generated_tokens": np.asarray(batch.response_lengths, dtype=np.float64),
                   "trajectory_tokens": trajectory}
        result = EvalResult(per_sample=dict(columns))
        result.metrics["tool_call_rate"] = self.mean("tool_call_rate", called, batch, binary=True, column="tool_called")
        result.metrics["tool_calls_mean"] = self.mean("tool_calls_mean", calls, batch, column="tool_calls")
        result.metrics["turns_mean"] = self.mean("turns_mean", turns, batch, column="turns")
        result.metrics["generated_tokens_mean"] = self.mean("generated_tokens_mean", columns["generated_tokens"],
                                                            batch, column="generated_tokens")
        result.metrics["trajectory_tokens_mean"] = self.mean("trajectory_tokens_mean", trajectory, batch,
                                                             column="trajectory_tokens")
        result.metrics.update(self.corpus(batch, columns))
        return result

    def corpus_state(self, responses: list[str], columns: dict[str, np.ndarray]) -> Any:
        return (np.asarray(columns["tool_calls"], float), np.asarray(columns["valid_calls"], float),
                np.asarray(columns["tool_errors"], float))

    def corpus_values(self, state: Any, weights: np.ndarray) -> dict[str, float]:
        calls, valid, errors = state
        total = float(np.sum(weights * calls))
        if total == 0:
            return {"valid_call_rate": float("nan"), "tool_error_rate": float("nan")}
        return {"valid_call_rate": float(np.sum(weights * valid)) / total,
                "tool_error_rate": float(np.sum(weights * errors)) / total}

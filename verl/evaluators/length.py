"""Response length: mean, percentiles and the clip ratio at the generation limit.

Lengths count generated tokens including the eos token, as the trainer's ``rollout/response_length_mean`` does;
``response_length_clip_ratio`` is the share of responses that reached ``max_new_tokens`` (the trainer's
definition, so the two agree). Percentiles get cluster-bootstrap CIs.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from verl.evaluators.base import EvalBatch, EvalResult, Evaluator
from verl.evaluators.stats import weighted_percentile


class Length(Evaluator):
    name = "length"
    needs = frozenset({"generations"})

    def __init__(self, percentiles: list[float] | float = (50, 90, 99)):
        values = [percentiles] if isinstance(percentiles, (int, float)) else list(percentiles)
        if not values or any(not 0 <= float(q) <= 100 for q in values):
            raise TypeError(f"percentiles must lie in [0, 100], got {percentiles!r}")
        self.percentiles = [float(q) for q in values]
        self.options = {} if self.percentiles == [50.0, 90.0, 99.0] else {"percentiles": self.percentiles}

    def evaluate(self, batch: EvalBatch) -> EvalResult:
        lengths = np.asarray(batch.response_lengths, dtype=np.float64)
        clipped = (lengths >= batch.max_new_tokens).astype(np.float64)
        chars = np.array([len(r) for r in batch.responses], dtype=np.float64)
        result = EvalResult(per_sample={"response_length": lengths, "response_clipped": clipped,
                                        "response_chars": chars})
        result.metrics["response_length_mean"] = self.mean("response_length_mean", lengths, batch,
                                                           column="response_length")
        result.metrics["response_length_clip_ratio"] = self.mean("response_length_clip_ratio", clipped, batch,
                                                                 binary=True, column="response_clipped")
        result.metrics["response_chars_mean"] = self.mean("response_chars_mean", chars, batch, column="response_chars")
        result.metrics.update(self.corpus(batch, {"response_length": lengths}))
        return result

    def corpus_state(self, responses: list[str], columns: dict[str, np.ndarray]) -> Any:
        return np.asarray(columns["response_length"], dtype=np.float64)

    def corpus_values(self, state: Any, weights: np.ndarray) -> dict[str, float]:
        return {f"response_length_p{q:g}": weighted_percentile(state, weights, q) for q in self.percentiles}

"""The evaluator interface: ``Evaluator`` (subclass it) and the ``EvalResult`` it returns.

An evaluator has a ``name``, declares what it ``needs`` (``generations``, ``ground_truth``, ``rewards``,
``ref_logprobs``: the runner generates once and computes log-probs once for all evaluators) and implements
``evaluate(batch) -> EvalResult``. Per-sample values are kept (``EvalResult.per_sample``, one ``(N,)`` array per
column) so comparisons can pair them by prompt.

Metrics that are not a mean of per-sample values (distinct-n, percentiles, a per-token ratio) are *corpus*
metrics: the evaluator implements ``corpus_state(responses, columns)`` and ``corpus_values(state, weights)``
so the same code gives the point estimate (unit weights), the bootstrap CI (resampled weights) and the paired
comparison of two models (``verl compare`` recomputes them from ``samples.jsonl``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from verl.evaluators.batch import EvalBatch
from verl.evaluators.stats import Metric, bootstrap_metrics, jackknife_metrics, mean_metric


@dataclass
class EvalResult:
    """``metrics``: name -> Metric; ``per_sample``: column -> ``(N,)`` array; ``notes``: caveats for the report."""

    metrics: dict[str, Metric] = field(default_factory=dict)
    per_sample: dict[str, np.ndarray] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def scalars(self) -> dict[str, float]:
        return {name: metric.value for name, metric in self.metrics.items()}


class Evaluator:
    """Base class; subclasses set ``name``, ``needs`` and implement ``evaluate``."""

    name: ClassVar[str] = "base"
    needs: ClassVar[frozenset[str]] = frozenset({"generations"})
    # metric -> True (higher is better), False (lower is better), None (no preferred direction)
    directions: ClassVar[dict[str, bool | None]] = {}
    # How corpus metrics get their error bars: "bootstrap" (percentiles, ratios of sums) or "jackknife"
    # (statistics of distinct items, which bootstrap duplicates bias; see eval.stats.jackknife_metrics).
    corpus_resampling: ClassVar[str] = "bootstrap"

    def __init__(self, **options: Any):
        if options:
            raise TypeError(f"{type(self).__name__} takes no options, got {sorted(options)}")
        self.options: dict[str, Any] = {}

    @property
    def spec(self) -> str:
        """The spec string that rebuilds this evaluator (recorded in results.json)."""
        if not self.options:
            return self.name
        def fmt(v: Any) -> str:
            return ";".join(str(x) for x in v) if isinstance(v, (list, tuple)) else str(v)
        return f"{self.name}({', '.join(f'{k}={fmt(v)}' for k, v in sorted(self.options.items()))})"

    def direction(self, metric: str) -> bool | None:
        return self.directions.get(metric)

    def evaluate(self, batch: EvalBatch) -> EvalResult:
        raise NotImplementedError

    # ---- corpus metrics (optional)

    def corpus_state(self, responses: list[str], columns: dict[str, np.ndarray]) -> Any:
        raise NotImplementedError(f"{self.name} has no corpus metrics")

    def corpus_values(self, state: Any, weights: np.ndarray) -> dict[str, float]:
        raise NotImplementedError(f"{self.name} has no corpus metrics")

    # ---- helpers for subclasses

    def mean(self, name: str, values: np.ndarray, batch: EvalBatch, binary: bool = False,
             column: str | None = None) -> Metric:
        """Mean of a per-sample column, SE clustered by prompt."""
        return mean_metric(values, batch.prompt_index, aggregate="mean", column=column or name, binary=binary,
                           higher_is_better=self.direction(name), evaluator=self.spec)

    def corpus(self, batch: EvalBatch, columns: dict[str, np.ndarray]) -> dict[str, Metric]:
        """Corpus metrics at unit weights with resampled (bootstrap or jackknife) CIs over prompts."""
        return corpus_metrics(self, batch.responses, columns, batch.prompt_index, batch.n_bootstrap, batch.seed)


def corpus_metrics(evaluator: Evaluator, responses: list[str], columns: dict[str, np.ndarray],
                   prompt_index: np.ndarray, n_bootstrap: int, seed: int) -> dict[str, Metric]:
    """``evaluator``'s corpus metrics on ``responses`` ``(N,)`` and per-sample ``columns`` (``(N,)`` each): the
    value at unit weights, the CI from resampling the prompts of ``prompt_index`` ``(N,)`` (all of a prompt's samples
    together). The whole batch and any subset of it (``verl eval --group-by``) go through here."""
    state = evaluator.corpus_state(responses, columns)

    def statistic(w: np.ndarray) -> dict[str, float]:
        return evaluator.corpus_values(state, w)

    if evaluator.corpus_resampling == "jackknife":
        groups = 200 if n_bootstrap > 0 else 0
        metrics = jackknife_metrics(statistic, prompt_index, groups, seed, aggregate="corpus", evaluator=evaluator.spec)
    else:
        metrics = bootstrap_metrics(statistic, prompt_index, n_bootstrap, seed, aggregate="corpus",
                                    evaluator=evaluator.spec)
    for name, metric in metrics.items():
        metric.higher_is_better = evaluator.direction(name)
    return metrics

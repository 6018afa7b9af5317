"""Evaluators: one home for what training validation and ``verl eval`` measure (docs/architecture.md §6).

    from verl.evaluators import build_evaluators
    evaluators = build_evaluators("accuracy,diversity(ngrams=1;2;3, tokenize=chars),length")

- ``batch``: ``EvalBatch``, what an evaluator reads; ``base``: ``Evaluator`` and ``EvalResult``;
- ``stats``: one model's error bars (``Metric``, clustered SEs, bootstrap, jackknife, pass@k);
- ``registry``: names -> classes, specs with options, entry points, ``file.py:Class``; ``run_evaluators``;
- the built-ins: ``reward``, ``kl`` (with ``kl_terms``, the forward passes it reads), ``diversity``, ``accuracy``,
  ``length``.

The trainer and ``eval`` (the offline runner, reports, comparisons) import this package; it imports neither.
"""

from verl.evaluators.base import EvalResult, Evaluator
from verl.evaluators.batch import EvalBatch
from verl.evaluators.registry import (
    BUILTIN_EVALUATORS,
    available_evaluators,
    build_evaluator,
    build_evaluators,
    register_evaluator,
    run_evaluators,
)
from verl.evaluators.stats import Metric

__all__ = ["BUILTIN_EVALUATORS", "EvalBatch", "EvalResult", "Evaluator", "Metric", "available_evaluators",
           "build_evaluator", "build_evaluators", "register_evaluator", "run_evaluators"]

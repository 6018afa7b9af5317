"""The evaluator registry: built-ins, the ``verl.evaluators`` entry-point group, ``file.py:Class``, ``module:Class``.

    from eval.evaluators import build_evaluators
    evaluators = build_evaluators("accuracy,diversity(ngrams=1;2;3, tokenize=chars),length")

Add your own without editing this package: decorate a class with ``@register_evaluator("name")`` in code that
runs first, declare it in your package's ``[project.entry-points."verl.evaluators"]``, or pass
``path/to/file.py:MyEvaluator``. The trainer resolves ``trainer.evaluators`` through the same entry points
(``verl.trainer.evaluator_plugins``), so a name means the same evaluator in training and in ``verl eval``.
"""

from __future__ import annotations

from collections.abc import Callable

from eval.evaluators.accuracy import Accuracy
from eval.evaluators.base import EvalBatch, EvalResult, Evaluator, Metric
from eval.evaluators.diversity import Diversity
from eval.evaluators.kl import KL
from eval.evaluators.length import Length
from eval.evaluators.reward import Reward
from verl.errors import ConfigError
from verl.trainer import evaluator_plugins

EVALUATORS: dict[str, type] = {}
DEFAULT_EVALUATORS = ("reward", "kl", "diversity", "accuracy", "length")


def register_evaluator(name: str) -> Callable[[type], type]:
    def decorator(cls: type) -> type:
        EVALUATORS[name] = cls
        return cls

    return decorator


for _cls in (Reward, KL, Diversity, Accuracy, Length):
    register_evaluator(_cls.name)(_cls)


def available_evaluators() -> list[str]:
    return sorted(set(EVALUATORS) | set(evaluator_plugins.entry_point_names()))


def build_evaluator(spec: str):
    """One evaluator from a spec (``name``, ``name(key=value, ...)``, ``file.py:Class``, ``module:Class``)."""
    target, options = evaluator_plugins.parse_spec(spec)
    if target in EVALUATORS:
        try:
            return EVALUATORS[target](**options)
        except TypeError as exc:
            raise ConfigError(f"evaluator '{spec}': bad options {options} ({exc})") from None
    return evaluator_plugins.build_evaluator(spec)


def build_evaluators(specs: str | list[str]) -> list:
    """Evaluators for a comma-separated string or a list of specs; a repeated name is an error."""
    items = evaluator_plugins.split_specs(specs) if isinstance(specs, str) else [s for s in specs if s.strip()]
    if not items:
        raise ConfigError(f"no evaluators given; choose from {', '.join(available_evaluators())}")
    evaluators, seen = [], set()
    for spec in items:
        evaluator = build_evaluator(spec)
        name = getattr(evaluator, "name", spec)
        if name in seen:
            raise ConfigError(f"evaluator '{name}' is listed twice; give it once (options go in parentheses)")
        seen.add(name)
        evaluators.append(evaluator)
    return evaluators


__all__ = ["DEFAULT_EVALUATORS", "EVALUATORS", "Accuracy", "Diversity", "EvalBatch", "EvalResult", "Evaluator", "KL",
           "Length", "Metric", "Reward", "available_evaluators", "build_evaluator", "build_evaluators",
           "register_evaluator"]

"""The evaluator registry: one table of names, read by training validation and by ``verl eval`` alike.

A spec names an evaluator, with options: ``diversity(ngrams=1;2;3, tokenize=chars)`` ->
``Diversity(ngrams=[1, 2, 3], tokenize="chars")``. Option values are parsed as YAML scalars; ``;`` separates list
items so a spec stays a single item in a YAML flow list (``trainer.evaluators=[accuracy,diversity(ngrams=1;2)]``).
A name resolves, in this order, to

- a class in ``EVALUATORS``: the built-ins (``BUILTIN_EVALUATORS``, their names are their ``name`` attributes) and
  any class decorated with ``@register_evaluator("name")`` in code that ran first;
- an entry point of another installed package in the ``verl.evaluators`` group
  (``[project.entry-points."verl.evaluators"] mine = "my_pkg.evals:Mine"``);

and ``path/to/file.py:Class`` or ``package.module:Class`` name a user's class directly. A registered name is never
silently replaced: registering another class under it, or another package declaring it, is an error.

An evaluator is any object with ``evaluate(batch: EvalBatch)`` returning an ``EvalResult`` or a plain
``{name: float}`` dict (a plain function ``fn(batch) -> dict`` is one too), and optionally a ``needs`` set.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from verl.errors import ConfigError
from verl.evaluators.accuracy import Accuracy
from verl.evaluators.base import Evaluator
from verl.evaluators.batch import NEEDS, EvalBatch
from verl.evaluators.code import Code
from verl.evaluators.diversity import Diversity
from verl.evaluators.judge import Judge
from verl.evaluators.kl import KL
from verl.evaluators.length import Length
from verl.evaluators.mismatch import Mismatch
from verl.evaluators.reward import Reward
from verl.evaluators.stats import Metric
from verl.evaluators.tools import Tools
from verl.registry import Registry
from verl.utils.imports import import_file, load_attribute

# The built-ins, in the order `verl eval` runs them when no --evaluators is given (KL only with a reference, tools
# only on multi-turn rollouts). Their names are their classes'.
BUILTIN_EVALUATORS: tuple[type[Evaluator], ...] = (Reward, KL, Diversity, Accuracy, Length, Tools)
# Every entry is a class (or function) called with a spec's options; installed packages add theirs as entry points.
EVALUATORS: Registry[Any] = Registry("evaluator", group="verl.evaluators",
                                     hint="or give path/to/file.py:Class or module:Class")


def register_evaluator(name: str) -> Callable[[type], type]:
    """Class decorator: make ``name`` resolve to the class in specs (another class under a taken name raises)."""
    return EVALUATORS.register(name)


# Shipped too, but run only when named: they need something the run does not have (a judge model behind a URL, rows
# the code reward scored).
ON_REQUEST_EVALUATORS: tuple[type[Evaluator], ...] = (Judge, Mismatch, Code)

for _builtin in (*BUILTIN_EVALUATORS, *ON_REQUEST_EVALUATORS):
    register_evaluator(_builtin.name)(_builtin)


def builtin_names() -> list[str]:
    return [cls.name for cls in BUILTIN_EVALUATORS]


# ---------------------------------------------------------------------------------------------- specs

_SPEC = re.compile(r"^\s*(?P<target>[^()]+?)\s*(?:\((?P<options>.*)\))?\s*$", re.S)


def split_specs(text: str) -> list[str]:
    """Split ``"accuracy,diversity(ngrams=1,2),length"`` on the commas outside parentheses."""
    parts, depth, current = [], 0, []
    for char in text:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    parts.append("".join(current))
    return [p.strip() for p in parts if p.strip()]


def _option_value(raw: str) -> Any:
    raw = raw.strip()
    if ";" in raw:
        return [_option_value(item) for item in raw.split(";") if item.strip()]
    try:
        return yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError:
        return raw


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"diversity(ngrams=1;2, tokenize=chars)"`` -> ``("diversity", {"ngrams": [1, 2], "tokenize": "chars"})``.

    Inside the parentheses, options are separated by ``,`` when every comma starts a new ``key=``, so
    ``ngrams=1,2`` also reads as a list when written on a command line.
    """
    match = _SPEC.match(spec or "")
    if not match or not match.group("target"):
        raise ConfigError(f"evaluator spec '{spec}' is not NAME, NAME(key=value, ...), file.py:Class or module:Class")
    target, options_text = match.group("target").strip(), match.group("options")
    options: dict[str, Any] = {}
    if options_text and options_text.strip():
        # Split on commas that begin a new key=value; other commas belong to a list value.
        pieces = re.split(r",\s*(?=[A-Za-z_][A-Za-z0-9_]*\s*=)", options_text)
        for piece in pieces:
            key, sep, raw = piece.partition("=")
            if not sep or not key.strip().isidentifier():
                raise ConfigError(f"evaluator spec '{spec}': option '{piece.strip()}' is not key=value")
            value = raw.replace(",", ";") if "," in raw else raw
            options[key.strip()] = _option_value(value)
    return target, options


# ---------------------------------------------------------------------------------------------- resolution

def available_evaluators() -> list[str]:
    return EVALUATORS.available()


def _load_from_file(path: str, attr: str, spec: str) -> Any:
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"evaluator '{spec}': file '{path}' does not exist")
    try:
        module = import_file(file, "verl_user_evaluator")
    except Exception as exc:
        raise ConfigError(f"evaluator '{spec}': importing '{path}' failed: {type(exc).__name__}: {exc}") from exc
    if not hasattr(module, attr):
        found = [n for n in dir(module) if not n.startswith("_") and isinstance(getattr(module, n), type)]
        raise ConfigError(f"evaluator '{spec}': '{path}' defines no '{attr}' (classes there: {found})")
    return getattr(module, attr)


def resolve_target(target: str) -> Any:
    """The class (or factory) ``target`` names: a registered name, an entry point, file.py:Class or module:Class."""
    if ":" in target:
        where, _, attr = target.rpartition(":")
        if where.endswith(".py") or "/" in where or "\\" in where:
            return _load_from_file(where, attr, target)
        return load_attribute(target, "evaluator", "verl_user_evaluator")
    return EVALUATORS[target]


def build_evaluator(spec: str) -> Any:
    """Instantiate the evaluator a spec names, with its options; errors name the spec and the bad option."""
    target, options = parse_spec(spec)
    factory = resolve_target(target)
    if not isinstance(factory, type):
        # A plain function ``fn(batch) -> {name: float}`` is an evaluator as it is; options become keywords.
        if not callable(factory):
            raise ConfigError(f"evaluator '{spec}' names {type(factory).__name__}, not a class or function")
        return functools.partial(factory, **options) if options else factory
    try:
        evaluator = factory(**options)
    except TypeError as exc:
        raise ConfigError(f"evaluator '{spec}': bad options {options} ({exc})") from None
    if not (hasattr(evaluator, "evaluate") or callable(evaluator)):
        raise ConfigError(f"evaluator '{spec}' has no evaluate(batch) method")
    return evaluator


def build_evaluators(specs: str | list[str]) -> list[Any]:
    """Evaluators for a comma-separated string or a list of specs; a repeated name is an error."""
    items = split_specs(specs) if isinstance(specs, str) else [s for s in specs if s.strip()]
    if not items:
        raise ConfigError(f"no evaluators given; choose from {', '.join(available_evaluators())}")
    evaluators, seen = [], set()
    for spec in items:
        evaluator = build_evaluator(spec)
        name = evaluator_label(evaluator, spec)
        if name in seen:
            raise ConfigError(f"evaluator '{name}' is listed twice; give it once (options go in parentheses)")
        seen.add(name)
        evaluators.append(evaluator)
    return evaluators


# ---------------------------------------------------------------------------------------------- running


def evaluator_label(evaluator: Any, default: str | None = None) -> str:
    return getattr(evaluator, "name", default or type(evaluator).__name__)


def evaluator_needs(evaluator: Any) -> frozenset[str]:
    needs = frozenset(getattr(evaluator, "needs", {"generations"}))
    unknown = needs - NEEDS
    if unknown:
        raise ConfigError(f"evaluator {type(evaluator).__name__} declares unknown needs {sorted(unknown)}; "
                          f"known: {sorted(NEEDS)}")
    return needs


def scalar_metrics(result: Any, where: str) -> dict[str, float]:
    """Numbers from an evaluator's result: ``result.scalars()`` or a ``{name: number}`` dict."""
    if hasattr(result, "scalars"):
        return {k: float(v) for k, v in result.scalars().items()}
    if isinstance(result, dict):
        return {k: float(v) for k, v in result.items() if isinstance(v, (int, float, np.floating, np.integer))}
    raise ConfigError(f"evaluator {where} returned {type(result).__name__}; return an EvalResult or a dict of floats")


def run_evaluators(evaluators: list[Any], batch: EvalBatch) -> tuple[dict[str, Metric], dict[str, np.ndarray],
                                                                       list[str]]:
    """Every evaluator on one batch: ``(metrics, per-sample columns (N,) each, notes)``. Metric names must not
    collide between evaluators. A plug-in returning plain numbers gets ``Metric``s with no error bars."""
    metrics: dict[str, Metric] = {}
    columns: dict[str, np.ndarray] = {}
    notes: list[str] = []
    for evaluator in evaluators:
        name = evaluator_label(evaluator)
        result = evaluator.evaluate(batch) if hasattr(evaluator, "evaluate") else evaluator(batch)
        if hasattr(result, "metrics") and all(isinstance(m, Metric) for m in result.metrics.values()):
            produced = result.metrics
            columns.update({k: np.asarray(v, dtype=np.float64) for k, v in result.per_sample.items()})
            notes.extend(getattr(result, "notes", []))
        else:
            nan = float("nan")
            produced = {k: Metric(v, nan, nan, nan, len(batch), "none", evaluator=name)
                        for k, v in scalar_metrics(result, name).items()}
        clash = set(produced) & set(metrics)
        if clash:
            raise ConfigError(f"evaluator '{name}' reports {sorted(clash)}, already reported by another evaluator")
        metrics.update(produced)
    return metrics, columns, notes

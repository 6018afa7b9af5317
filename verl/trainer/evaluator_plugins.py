"""Evaluators as plugins: the batch they read, how names resolve, and how validation runs them.

``verl`` core never imports the ``eval`` package (DESIGN §2). It reaches evaluators only as plugins:

- a name from the ``verl.evaluators`` entry-point group (``accuracy``, ``diversity``, ... are declared there by
  ``pyproject.toml``; a third-party package declares its own the same way);
- ``path/to/file.py:ClassName`` or ``package.module:ClassName`` for a user's own class.

A spec may carry options: ``diversity(ngrams=1;2;3, tokenize=chars)`` → ``Diversity(ngrams=[1,2,3],
tokenize="chars")``. Option values are parsed as YAML scalars; ``;`` separates list items so a spec stays a
single item in a YAML flow list (``trainer.evaluators=[accuracy,diversity(ngrams=1;2)]``).

An evaluator is any object with ``evaluate(batch: EvalBatch)`` returning an object with ``scalars()`` (the
``eval`` package's ``EvalResult``) or a plain ``{name: float}`` dict, and optionally a ``needs`` set (see
``NEEDS``). ``EvalBatch`` lives here, in core, because the trainer builds it; ``eval`` re-exports it.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from verl.errors import ConfigError

ENTRY_POINT_GROUP = "verl.evaluators"
# The built-in evaluators, as pyproject.toml declares them in that group (a test keeps the two equal). Used when
# the group has no such name: a plain checkout on PYTHONPATH, never pip-installed, has no entry-point metadata,
# and its default trainer.evaluators must still work. Strings: eval is imported only when a run names one.
BUILTIN_EVALUATORS = {
    "reward": "eval.evaluators.reward:Reward",
    "kl": "eval.evaluators.kl:KL",
    "diversity": "eval.evaluators.diversity:Diversity",
    "accuracy": "eval.evaluators.accuracy:Accuracy",
    "length": "eval.evaluators.length:Length",
}

# What an evaluator can ask the runner for. Generations are always produced; the rest only when some evaluator
# needs them, so a run of `accuracy` alone never loads a reference model.
NEEDS = frozenset({"generations", "ground_truth", "rewards", "ref_logprobs"})


@dataclass
class EvalBatch:
    """Everything an evaluator may read, for ``N = prompts * n`` samples (a prompt's samples are adjacent).

    Tensor fields use the rollout layout: ``data.batch["responses"]`` and ``["response_mask"]`` are
    ``(N, response_len)``. ``kl_terms`` (present when an evaluator needs ``ref_logprobs``) holds
    ``policy_log_probs``, ``ref_log_probs`` and ``token_kl`` (exact per-token KL from the full distributions),
    each ``(N, response_len)`` and zero on padding.
    """

    responses: list[str]
    prompts: list[str]
    ground_truth: list[Any]
    data_sources: list[str]
    prompt_index: np.ndarray  # (N,) int: samples of one prompt share the id; the cluster for standard errors
    n: int  # samples per prompt
    max_new_tokens: int
    response_lengths: np.ndarray  # (N,) generated tokens, eos included
    rewards: np.ndarray | None = None  # (N,) sequence scores from the run's reward function / model
    reward_extras: dict[str, np.ndarray] = field(default_factory=dict)  # (N,) each, e.g. acc, acc_flexible
    data: Any = None  # the rollout DataProto, when the caller has one
    kl_terms: dict[str, Any] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)  # n, temperature, top_p, top_k, seed, max_new_tokens
    n_bootstrap: int = 1000  # 0 skips bootstrap CIs (validation during training needs only the values)
    seed: int = 0  # of the bootstrap resampling

    def __len__(self) -> int:
        return len(self.responses)

    @classmethod
    def from_rollout(cls, batch: Any, texts: list[str], scores: np.ndarray, extras: dict[str, np.ndarray], n: int,
                     max_new_tokens: int, sampling: dict[str, Any] | None = None, n_bootstrap: int = 0,
                     seed: int = 0) -> EvalBatch:
        """From a rollout ``DataProto`` (``responses``/``response_mask`` ``(N, L)``), its decoded texts, the
        reward scores ``(N,)`` and per-sample reward extras, as validation produces them."""
        non = batch.non_tensor
        index = np.asarray(non["index"], dtype=np.int64) if "index" in non else np.repeat(np.arange(len(texts) // n), n)
        return cls(
            responses=list(texts),
            prompts=[str(p) for p in non.get("raw_prompt", [""] * len(texts))],
            ground_truth=list(non.get("ground_truth", [None] * len(texts))),
            data_sources=[str(s) for s in non.get("data_source", ["unknown"] * len(texts))],
            prompt_index=index,
            n=n,
            max_new_tokens=max_new_tokens,
            response_lengths=batch.batch["response_mask"].sum(-1).cpu().numpy().astype(np.int64),
            rewards=None if scores is None else np.asarray(scores, dtype=np.float64),
            reward_extras={k: np.asarray(v, dtype=np.float64) for k, v in (extras or {}).items()},
            data=batch,
            sampling=dict(sampling or {}),
            n_bootstrap=n_bootstrap,
            seed=seed,
        )


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


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    """``name -> entry point`` of the group across *all* installed distributions.

    ``importlib.metadata.entry_points()`` keeps only the first distribution of a name on ``sys.path``; a stale
    ``verl_suite.egg-info`` in the working directory (left by an older editable install) would then hide the
    installed entry points. Scanning every distribution and keeping the first definition of each name avoids that.
    """
    found: dict[str, importlib.metadata.EntryPoint] = {}
    for dist in importlib.metadata.distributions():
        for ep in dist.entry_points:
            if ep.group == ENTRY_POINT_GROUP and ep.name not in found:
                found[ep.name] = ep
    return found


def entry_point_names() -> list[str]:
    return sorted(_entry_points())


def _load_from_file(path: str, attr: str, spec: str) -> Any:
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"evaluator '{spec}': file '{path}' does not exist")
    module_name = f"verl_user_evaluator_{file.stem}_{abs(hash(str(file.resolve())))}"
    if module_name in sys.modules:
        module = sys.modules[module_name]
    else:
        mod_spec = importlib.util.spec_from_file_location(module_name, file)
        if mod_spec is None or mod_spec.loader is None:
            raise ConfigError(f"evaluator '{spec}': cannot import '{path}' as a Python file")
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules[module_name] = module
        try:
            mod_spec.loader.exec_module(module)
        except Exception as exc:
            del sys.modules[module_name]
            raise ConfigError(f"evaluator '{spec}': importing '{path}' failed: {type(exc).__name__}: {exc}") from exc
    if not hasattr(module, attr):
        found = [n for n in dir(module) if not n.startswith("_") and isinstance(getattr(module, n), type)]
        raise ConfigError(f"evaluator '{spec}': '{path}' defines no '{attr}' (classes there: {found})")
    return getattr(module, attr)


def resolve_target(target: str) -> Any:
    """The class (or factory) named by ``target``: an entry-point name, ``file.py:Class`` or ``module:Class``."""
    if ":" in target:
        where, _, attr = target.rpartition(":")
        if where.endswith(".py") or "/" in where or "\\" in where:
            return _load_from_file(where, attr, target)
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            raise ConfigError(f"evaluator '{target}': cannot import module '{where}' ({exc})") from None
        if not hasattr(module, attr):
            raise ConfigError(f"evaluator '{target}': module '{where}' has no attribute '{attr}'")
        return getattr(module, attr)
    points = _entry_points()
    if target not in points and target in BUILTIN_EVALUATORS:
        return resolve_target(BUILTIN_EVALUATORS[target])
    if target not in points:
        names = sorted(points)
        hint = (
            f"registered: {', '.join(names)}" if names else
            "no evaluators are registered at all: reinstall the package (pip install -e .) so its "
            f"'{ENTRY_POINT_GROUP}' entry points are written"
        )
        raise ConfigError(f"unknown evaluator '{target}' ({hint}); or give path/to/file.py:Class or module:Class")
    try:
        return points[target].load()
    except Exception as exc:
        raise ConfigError(f"evaluator '{target}': loading entry point {points[target].value} failed: {exc}") from exc


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


# ---------------------------------------------------------------------------------------------- validation


def check_validation_needs(trainer: Any, evaluator: Any, label: str) -> None:
    """Refuse, with the fix, an evaluator whose inputs validation during training cannot compute."""
    needs = evaluator_needs(evaluator)
    if "ref_logprobs" in needs and not trainer.config.use_reference:
        raise ConfigError(
            f"trainer.evaluators: '{label}' needs the reference model, which this run does not load "
            "(actor.use_kl_loss and algorithm.use_kl_in_reward are off); set reference.enable=true, or run "
            f"`verl eval --evaluators {label}` on the checkpoints"
        )
    missing = needs - {"generations", "ground_truth", "rewards", "ref_logprobs"}
    if missing:
        raise ConfigError(
            f"trainer.evaluators: '{label}' needs {sorted(missing)}, which validation during training does not "
            f"compute; drop it there and run `verl eval --evaluators {label}` on the checkpoints"
        )


def resolve_validation_evaluators(trainer: Any) -> list[Any]:
    """Resolve ``trainer.evaluators`` once per trainer (cached on it) and check the ``register_evaluator`` objects;
    returns every evaluator validation runs."""
    configured = getattr(trainer, "_plugin_evaluators", None)
    if configured is None:
        configured = []
        for spec in trainer.config.trainer.evaluators:
            evaluator = build_evaluator(spec)
            check_validation_needs(trainer, evaluator, spec)
            configured.append(evaluator)
        trainer._plugin_evaluators = configured
    for evaluator in trainer.evaluators:  # register_evaluator() objects, which may be added at any time
        check_validation_needs(trainer, evaluator, getattr(evaluator, "name", type(evaluator).__name__))
    return [*configured, *trainer.evaluators]


def run_validation_evaluators(trainer: Any, batch: Any, texts: list[str], scores: np.ndarray,
                              extras: dict[str, np.ndarray]) -> dict[str, float]:
    """Run ``trainer.evaluators`` (by name) and the objects given to ``register_evaluator`` on a validation batch.

    ``batch`` is the validation rollout (``(N, response_len)`` tensors), ``scores`` ``(N,)`` the reward scores and
    ``extras`` the reward function's per-sample values. Returns ``{metric: value}`` for the ``eval`` scope.
    """
    cfg = trainer.config
    v = cfg.rollout.val_kwargs
    sampling = {"n": v.n, "temperature": v.temperature, "top_p": v.top_p, "top_k": v.top_k,
                "max_new_tokens": cfg.data.max_response_length, "seed": cfg.trainer.seed}
    eval_batch = EvalBatch.from_rollout(batch, texts, scores, extras, n=v.n,
                                        max_new_tokens=cfg.data.max_response_length, sampling=sampling,
                                        n_bootstrap=0, seed=cfg.trainer.seed)
    evaluators = resolve_validation_evaluators(trainer)
    if any("ref_logprobs" in evaluator_needs(e) for e in evaluators):
        eval_batch.kl_terms = trainer.roles.compute_kl_terms(batch)
    metrics: dict[str, float] = {}
    for evaluator in evaluators:
        where = getattr(evaluator, "name", type(evaluator).__name__)
        result = evaluator.evaluate(eval_batch) if hasattr(evaluator, "evaluate") else evaluator(eval_batch)
        metrics.update(scalar_metrics(result, where))
    return metrics

"""Rule reward functions, looked up by name.

A reward function has verl's signature ``fn(data_source, solution_str, ground_truth, extra_info=None, **kwargs)``
and returns a float score or a dict with a ``score`` key plus any extra per-sample values (e.g. ``acc``), which
the trainer logs as means. ``reward.name=auto`` picks the function by each row's ``data_source``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

from verl.errors import ConfigError
from verl.registry import Registry
from verl.rewards.extract import (
    ARITHMETIC_STRICT,
    GSM8K_STRICT,
    answers_match,
    extract_flexible,
    extract_strict,
    last_boxed,
    math_equal,
)

RewardFn = Callable[..., float | dict[str, Any]]
REWARD_FNS: Registry[RewardFn] = Registry("reward", key="reward.name")

# data_source -> reward name, for reward.name=auto
DATA_SOURCE_REWARDS = {
    "arithmetic": "arithmetic",
    "tool_arithmetic": "arithmetic",  # the same `>> N` answer, reached through the calculator tool
    "openai/gsm8k": "gsm8k",
    "gsm8k": "gsm8k",
    "lighteval/MATH": "math",
    "DigitalLearningGmbH/MATH-lighteval": "math",
    "math": "math",
    # code: the row's tests run in the sandbox (verl/rewards/code.py); verl sends these sources to sandbox_fusion
    "code": "code",
    "codecontests": "code",
    "apps": "code",
    "codeforces": "code",
    "taco": "code",
    "openai_humaneval": "code",
}


REWARD_FNS.lazy("code", "verl.rewards.code:code")  # imports the sandbox: only when a row or config names it


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Register ``fn`` under ``name`` (``reward.name=NAME``); another function under a taken name raises."""
    return REWARD_FNS.register(name)


def get_reward_fn(name: str) -> RewardFn:
    return REWARD_FNS[name]


def reward_for_data_source(data_source: str) -> RewardFn:
    if data_source.startswith("reasoning_gym/"):  # reasoning-gym's datasets, each scored by its own score_answer
        return REWARD_FNS["reasoning_gym"]
    return REWARD_FNS[DATA_SOURCE_REWARDS.get(data_source, "exact_match")]


def score_row(row: dict[str, Any], response: str, ground_truth: Any) -> tuple[float, dict[str, Any]]:
    """A data row's own rule (``reward.name=auto`` on its ``data_source``) on ``response``: the score and the
    rule's other outputs (an environment that scores as the trainer would: ``verl env serve``, the tool tasks)."""
    source = str(row.get("data_source") or "unknown")
    result = reward_for_data_source(source)(source, response, ground_truth, row.get("extra_info"))
    if isinstance(result, dict):
        return float(result["score"]), {k: v for k, v in result.items() if k != "score"}
    return float(result), {}


def load_custom_reward(path: str, name: str) -> RewardFn:
    """Import ``name`` from the Python file ``path`` (``reward.custom_reward.path/name``)."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"reward.custom_reward.path: file '{path}' does not exist")
    spec = importlib.util.spec_from_file_location(f"verl_custom_reward_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"reward.custom_reward.name: '{path}' defines no function '{name}'")
    return fn


@register_reward("reasoning_gym")
def reasoning_gym_reward(data_source: str, solution_str: str, ground_truth: Any, extra_info=None, **kwargs) -> dict:
    """A reasoning_gym: row scored as reasoning-gym scores it: ``score_answer(extract_answer(response), item)``."""
    from verl.data.reasoning_gym import score  # noqa: PLC0415 - lazy: the package is optional

    return score(solution_str, extra_info)


@register_reward("exact_match")
def exact_match(data_source: str, solution_str: str, ground_truth: Any, extra_info=None, **kwargs) -> dict:
    """1.0 when the stripped response equals the stripped ground truth."""
    ok = solution_str.strip() == str(ground_truth).strip()
    return {"score": float(ok), "acc": float(ok)}


def _strict_flexible(solution_str: str, ground_truth: Any, strict_pattern, tail_chars: int | None,
                     last: bool = False) -> dict:
    text = solution_str[-tail_chars:] if tail_chars else solution_str
    strict = answers_match(extract_strict(text, strict_pattern, last=last), str(ground_truth))
    flexible = answers_match(extract_flexible(solution_str), str(ground_truth))
    return {"score": float(strict), "acc": float(strict), "acc_flexible": float(flexible)}


@register_reward("gsm8k")
def gsm8k(data_source: str, solution_str: str, ground_truth: Any, extra_info=None, **kwargs) -> dict:
    """Score 1 for a correct ``#### N`` answer (strict); flexible-extraction accuracy reported beside it.

    Like verl, only the last 300 characters are searched for the strict answer, and the last ``#### N`` counts.
    """
    return _strict_flexible(solution_str, ground_truth, GSM8K_STRICT, tail_chars=300, last=True)


@register_reward("arithmetic")
def arithmetic(data_source: str, solution_str: str, ground_truth: Any, extra_info=None, **kwargs) -> dict:
    """Score 1 for a correct ``>> N`` answer (strict); ``acc_flexible`` = last number in the response."""
    return _strict_flexible(solution_str, ground_truth, ARITHMETIC_STRICT, tail_chars=None)


@register_reward("math")
def math_boxed(data_source: str, solution_str: str, ground_truth: Any, extra_info=None, **kwargs) -> dict:
    """Score 1 when the last ``\\boxed{}`` answer equals the ground truth (after light normalisation)."""
    reference = last_boxed(str(ground_truth)) or str(ground_truth)
    ok = math_equal(last_boxed(solution_str), reference)
    return {"score": float(ok), "acc": float(ok)}

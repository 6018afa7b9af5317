"""KL estimators between the policy and the reference, and KL coefficient controllers.

With samples drawn from the policy and ``log r = ref_logp - logp``:

- ``k1`` (alias ``kl``): ``-log r``            unbiased, high variance, can be negative
- ``k2`` (alias ``mse``): ``0.5 (log r)^2``    biased, low variance
- ``k3``: ``(r - 1) - log r``                 unbiased, always >= 0, low variance (Schulman 2020)
- ``low_var_kl``: k3 with ``log r`` clamped to [-20, 20] and the result to [-10, 10] (verl's form)
- ``abs``: ``|log r|``
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from verl.registry import Registry

KLEstimator = Callable[[torch.Tensor], torch.Tensor]  # per-token estimate from log r = ref_logp - logp
KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator")


def register_kl_estimator(*names: str) -> Callable[[KLEstimator], KLEstimator]:
    """Register ``fn(log_r) -> estimate`` (both ``(batch, response_len)``) under each of ``names`` (aliases)."""

    def decorator(fn: KLEstimator) -> KLEstimator:
        for name in names:
            KL_ESTIMATORS.register(name, fn)
        return fn

    return decorator


@register_kl_estimator("k1", "kl")
def k1(log_r: torch.Tensor) -> torch.Tensor:
    return -log_r


@register_kl_estimator("k2", "mse")
def k2(log_r: torch.Tensor) -> torch.Tensor:
    return 0.5 * log_r.square()


@register_kl_estimator("k3")
def k3(log_r: torch.Tensor) -> torch.Tensor:
    return torch.exp(log_r) - 1.0 - log_r


@register_kl_estimator("low_var_kl")
def low_var_kl(log_r: torch.Tensor) -> torch.Tensor:
    log_r = log_r.clamp(-20.0, 20.0)
    return (torch.exp(log_r) - 1.0 - log_r).clamp(-10.0, 10.0)


@register_kl_estimator("abs")
def abs_kl(log_r: torch.Tensor) -> torch.Tensor:
    return log_r.abs()


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """Per-token KL estimate ``kind`` from the policy's and the reference's log-probs, ``(batch, response_len)``."""
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator '{kind}'; use one of {', '.join(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[kind](ref_log_prob - log_prob)


class FixedKLController:
    """A constant coefficient."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Ziegler et al. 2019: beta <- beta * (1 + clip(KL/target - 1, -0.2, 0.2) * n_steps / horizon)."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        self.value = init_kl_coef
        self.target = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


def build_kl_controller(kind: str, kl_coef: float, target_kl: float, horizon: int):
    if kind == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    return FixedKLController(kl_coef)

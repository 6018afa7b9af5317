"""KL estimators between the policy and the reference, and KL coefficient controllers.

With samples drawn from the policy and ``log r = ref_logp - logp``:

- ``k1`` (alias ``kl``): ``-log r``            unbiased, high variance, can be negative
- ``k2`` (alias ``mse``): ``0.5 (log r)^2``    biased, low variance
- ``k3``: ``(r - 1) - log r``                 unbiased, always >= 0, low variance (Schulman 2020)
- ``low_var_kl``: k3 with ``log r`` clamped to [-20, 20] and the result to [-10, 10] (verl's form)
- ``abs``: ``|log r|``
"""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "kl", "k2", "mse", "k3", "low_var_kl", "abs")


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """Per-token KL estimate, ``(batch, response_len)``."""
    log_r = ref_log_prob - log_prob
    if kind in ("k1", "kl"):
        return -log_r
    if kind in ("k2", "mse"):
        return 0.5 * log_r.square()
    if kind == "k3":
        return torch.exp(log_r) - 1.0 - log_r
    if kind == "low_var_kl":
        log_r = log_r.clamp(-20.0, 20.0)
        return (torch.exp(log_r) - 1.0 - log_r).clamp(-10.0, 10.0)
    if kind == "abs":
        return log_r.abs()
    raise ValueError(f"unknown KL estimator '{kind}'; use one of {KL_ESTIMATORS}")


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

"""KL estimators (k1/k2/k3/low_var_kl) and KL coefficient controllers against REFERENCES.md."""

from __future__ import annotations

import math

import pytest
import torch

from verl.algos.kl import KL_ESTIMATORS, AdaptiveKLController, FixedKLController, build_kl_controller, kl_penalty

F64 = torch.float64


@pytest.mark.parametrize(
    ("kind", "expected"),
    [("k1", 1.0), ("kl", 1.0), ("k2", 0.5), ("mse", 0.5), ("k3", math.exp(-1)), ("low_var_kl", math.exp(-1)),
     ("abs", 1.0)],
)
def test_reference_vector(kind, expected):
    # REFERENCES: logp = -1, ref = -2 -> log r = -1 -> k1 = 1, k2 = 0.5, k3 = e^-1 - 1 + 1 = 0.36788.
    value = kl_penalty(torch.tensor([[-1.0]], dtype=F64), torch.tensor([[-2.0]], dtype=F64), kind)
    assert value.shape == (1, 1)
    assert value.item() == pytest.approx(expected, abs=1e-12)
    if kind == "k3":
        assert value.item() == pytest.approx(0.36788, abs=1e-5)


def test_signs_when_the_reference_is_more_likely():
    # log r = +1: k1 = -1 (k1 can be negative), k2 = 0.5, k3 = e - 2 >= 0.
    logp, ref = torch.tensor([-2.0], dtype=F64), torch.tensor([-1.0], dtype=F64)
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(-1.0)
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.5)
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(math.e - 2)


def test_k3_is_non_negative_and_zero_only_at_equality():
    gen = torch.Generator().manual_seed(0)
    logp, ref = torch.randn(1000, generator=gen, dtype=F64) * 3, torch.randn(1000, generator=gen, dtype=F64) * 3
    assert (kl_penalty(logp, ref, "k3") >= 0).all()
    assert kl_penalty(logp, logp, "k3").abs().max().item() == 0.0


def test_low_var_kl_clamps_log_ratio_and_result():
    logp = torch.tensor([0.0, 0.0, 0.0, 0.0], dtype=F64)
    ref = torch.tensor([-50.0, 50.0, -5.0, 2.0], dtype=F64)
    low = kl_penalty(logp, ref, "low_var_kl")
    k3 = kl_penalty(logp, ref, "k3")
    # log r = -50: k3 = e^-50 + 49 -> clamped to 10;  log r = 50: e^50 - 51 -> 10 (k3 itself is astronomically large).
    assert low[0].item() == 10.0 and low[1].item() == 10.0
    assert k3[0].item() == pytest.approx(49.0, abs=1e-9) and k3[1].item() > 1e20
    # Inside the clamps the two agree: log r = -5 -> e^-5 + 4; log r = 2 -> e^2 - 3.
    assert low[2].item() == pytest.approx(math.exp(-5) + 4, abs=1e-12)
    assert low[3].item() == pytest.approx(math.exp(2) - 3, abs=1e-12)
    # Clamping log r itself at 20 keeps exp finite even where a float32 exp(100) would be inf.
    far = kl_penalty(torch.tensor([0.0]), torch.tensor([100.0]), "low_var_kl")
    assert far.item() == 10.0


def test_unknown_estimator():
    with pytest.raises(ValueError, match="k3"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4")
    assert set(KL_ESTIMATORS) >= {"k1", "k2", "k3", "low_var_kl"}


def test_schulman_table_by_monte_carlo():
    """q = N(0,1) (the policy, sampled), p = N(1,1) (the reference); KL(q || p) = 0.5.

    Schulman's "Approximating KL divergence": bias/true k1 0, k2 0.25, k3 0; std/true k1 2, k2 1.73, k3 1.7.
    """
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1_000_000, generator=gen, dtype=F64)
    logq = -0.5 * x**2 - 0.5 * math.log(2 * math.pi)
    logp = -0.5 * (x - 1) ** 2 - 0.5 * math.log(2 * math.pi)
    true_kl = 0.5
    table = {"k1": (0.0, 2.0), "k2": (0.25, 1.73), "k3": (0.0, 1.7)}
    for kind, (bias, rel_std) in table.items():
        est = kl_penalty(logq, logp, kind)
        assert (est.mean().item() - true_kl) / true_kl == pytest.approx(bias, abs=0.01), kind
        assert est.std().item() / true_kl == pytest.approx(rel_std, abs=0.05), kind


# ----------------------------------------------------------------------------------------------- controllers


def test_adaptive_controller_update_formula_by_hand():
    ctrl = AdaptiveKLController(init_kl_coef=0.2, target_kl=0.05, horizon=100)
    # KL 0.055: error = 0.055/0.05 - 1 = 0.1 -> beta * (1 + 0.1 * 10/100) = 0.2 * 1.01
    ctrl.update(current_kl=0.055, n_steps=10)
    assert ctrl.value == pytest.approx(0.202, abs=1e-12)
    # KL 1.0: error 19 is clipped to +0.2 -> * (1 + 0.2 * 10/100) = * 1.02
    ctrl.update(current_kl=1.0, n_steps=10)
    assert ctrl.value == pytest.approx(0.202 * 1.02, abs=1e-12)
    # KL 0: error -1 is clipped to -0.2 -> * (1 - 0.2 * 5/100) = * 0.99
    ctrl.update(current_kl=0.0, n_steps=5)
    assert ctrl.value == pytest.approx(0.202 * 1.02 * 0.99, abs=1e-12)
    # On target: unchanged.
    before = ctrl.value
    ctrl.update(current_kl=0.05, n_steps=1000)
    assert ctrl.value == pytest.approx(before, abs=1e-15)


def test_adaptive_controller_state_round_trip():
    ctrl = build_kl_controller("adaptive", kl_coef=0.1, target_kl=0.1, horizon=10)
    assert isinstance(ctrl, AdaptiveKLController)
    ctrl.update(current_kl=0.3, n_steps=4)  # error clipped to 0.2 -> 0.1 * 1.08
    assert ctrl.value == pytest.approx(0.108)
    fresh = build_kl_controller("adaptive", kl_coef=0.1, target_kl=0.1, horizon=10)
    fresh.load_state_dict(ctrl.state_dict())
    assert fresh.value == pytest.approx(0.108)


def test_fixed_controller_never_moves():
    ctrl = build_kl_controller("fixed", kl_coef=0.001, target_kl=0.1, horizon=10000)
    assert isinstance(ctrl, FixedKLController)
    for kl in (0.0, 1.0, 100.0):
        ctrl.update(current_kl=kl, n_steps=64)
    assert ctrl.value == 0.001
    other = FixedKLController(0.5)
    other.load_state_dict(ctrl.state_dict())
    assert other.value == 0.001

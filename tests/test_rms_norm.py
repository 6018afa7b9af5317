"""RMSNorm as one autograd node (verl/models/rms_norm.py): Hugging Face's forward bit for bit, its gradients to
rounding (and to finite differences), the module's own forward wherever it would compute something else."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from verl.models.loader import load_causal_lm
from verl.models.rms_norm import _RMSNormFunction, use_fused_rms_norm


def norms(trainable: bool) -> tuple[LlamaRMSNorm, LlamaRMSNorm]:
    torch.manual_seed(0)
    plain = LlamaRMSNorm(32, eps=1e-5)
    with torch.no_grad():
        plain.weight.mul_(torch.rand(32) + 0.5)
    plain.weight.requires_grad_(trainable)
    fused = LlamaRMSNorm(32, eps=1e-5)
    fused.load_state_dict(plain.state_dict())
    fused.weight.requires_grad_(trainable)
    assert use_fused_rms_norm(fused) == 1
    return plain, fused


@pytest.mark.parametrize("trainable", [True, False])
@pytest.mark.parametrize("shape", [(5, 32), (2, 3, 32)])
def test_forward_is_hugging_faces_bit_for_bit_and_gradients_match(shape, trainable):
    plain, fused = norms(trainable)
    x = (torch.randn(*shape) * 3).requires_grad_(True)
    weights = torch.randn(*shape)
    out = fused(x)
    assert type(out.grad_fn).__name__ == "_RMSNormFunctionBackward"
    ref = plain(x)
    assert torch.equal(out, ref)
    (out * weights).sum().backward()
    grad_x, x.grad = x.grad, None
    (ref * weights).sum().backward()
    torch.testing.assert_close(grad_x, x.grad, atol=1e-6, rtol=1e-5)
    if trainable:
        torch.testing.assert_close(fused.weight.grad, plain.weight.grad, atol=1e-5, rtol=1e-5)
    else:
        assert fused.weight.grad is None


def test_the_backward_matches_finite_differences():
    x = torch.randn(3, 4, 16, dtype=torch.float64, requires_grad=True)
    weight = (torch.rand(16, dtype=torch.float64) + 0.5).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x, w: _RMSNormFunction.apply(x, w, 1e-6), (x, weight))


def test_other_dtypes_and_autocast_run_the_modules_own_forward():
    _, fused = norms(trainable=True)
    x = torch.randn(4, 32)
    assert type(fused(x.bfloat16()).grad_fn).__name__ != "_RMSNormFunctionBackward"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert type(fused(x).grad_fn).__name__ != "_RMSNormFunctionBackward"


def test_loaded_models_use_it_and_it_can_be_turned_off(monkeypatch):
    model = load_causal_lm("builtin:tiny-arith")
    layers = model.config.num_hidden_layers
    fused = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm") and "forward" in m.__dict__]
    assert len(fused) == 2 * layers + 1  # two per decoder layer and the final norm
    ids = torch.randint(3, model.config.vocab_size, (2, 9))
    out = model(input_ids=ids).logits
    out.square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    monkeypatch.setenv("VERL_FUSED_RMS_NORM", "0")
    plain = load_causal_lm("builtin:tiny-arith")
    assert not any("forward" in m.__dict__ for m in plain.modules() if type(m).__name__.endswith("RMSNorm"))
    ref = plain(input_ids=ids).logits
    assert torch.equal(out, ref)  # the same forward bits through the whole model
    ref.square().mean().backward()
    for name, param in plain.named_parameters():
        # to rounding at the tensor's scale (the embedding's gradient sums many rows: its entries reach ~100)
        scale = float(param.grad.abs().max())
        torch.testing.assert_close(grads[name], param.grad, atol=1e-6 * max(scale, 1.0), rtol=1e-4, msg=name)


def test_a_float64_norm_stays_float64():
    """Hugging Face's forward rounds through float32; model.dtype=float64 (numerical checks) must not."""
    plain, fused = norms(trainable=True)
    plain.double(), fused.double()
    x = torch.randn(4, 32, dtype=torch.float64) * 3
    exact = plain.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + plain.variance_epsilon))
    out = fused(x)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, exact, atol=1e-15, rtol=1e-14)
    assert (plain(x) - exact).abs().max() > 1e-10  # what the float32 round trip costs
    assert torch.autograd.gradcheck(lambda t: fused(t), (x.clone().requires_grad_(True),))

"""LoRA layers as one autograd node (verl/models/fused_lora.py): peft's function and gradients to rounding, a fresh
adapter adding exactly nothing, peft's own forward wherever the fused one would compute something else."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model
from peft.tuners.lora.layer import Linear as LoraLinear
from torch import nn

from verl.config import LoraConfig
from verl.models.fused_lora import _LoraLinearFunction, use_fused_lora
from verl.models.loader import load_causal_lm
from verl.models.lora import apply_lora, merged_copy
from verl.models.packed_linear import packed_weights, use_packed_linear


class TwoLayers(nn.Module):
    """The smallest model peft adapts: two linear layers, the second with a bias (as Qwen2's q/k/v)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(24, 40, bias=False)
        self.down = nn.Linear(40, 24, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def adapted(dropout: float = 0.0, fused: bool = True, packed: bool = False, random_b: bool = True) -> nn.Module:
    torch.manual_seed(0)
    base = TwoLayers()
    if packed:
        use_packed_linear(base)
    model = get_peft_model(base, PeftLoraConfig(r=4, lora_alpha=8, lora_dropout=dropout,
                                                target_modules=["up", "down"]))
    if random_b:  # peft starts B at zero; a trained adapter's B is not
        for name, param in model.named_parameters():
            if "lora_B" in name:
                nn.init.normal_(param, std=0.2)
    if fused:
        assert use_fused_lora(model) == 2
    return model


def output_and_gradients(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    x = x.clone().requires_grad_(True)
    model.zero_grad()
    out = model(x)
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    grads = [p.grad.clone() for _, p in sorted(model.named_parameters()) if p.requires_grad]
    return out.detach(), grads, x.grad


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("shape", [(6, 24), (2, 5, 24)])
def test_output_and_gradients_equal_peft(shape, packed):
    x = torch.randn(*shape)
    plain = adapted(fused=False)
    fused = adapted(packed=packed)
    with packed_weights(gradients=True):
        out, grads, grad_x = output_and_gradients(fused, x)
    ref_out, ref_grads, ref_grad_x = output_and_gradients(plain, x)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad_x, ref_grad_x, atol=1e-5, rtol=1e-5)
    assert len(grads) == 4  # A and B of both layers, nothing for the frozen base
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if packed:  # the base layers ran by their packed copies, forward and (second layer) backward
        assert fused.base_model.model.up.base_layer._verl_packed.packed is not None
        assert fused.base_model.model.down.base_layer._verl_packed.packed_t is not None


def test_it_is_one_autograd_node_and_the_gradient_matches_finite_differences():
    model = adapted().double()
    x = torch.randn(3, 24, dtype=torch.float64)
    layer = model.base_model.model.up
    assert type(layer) is LoraLinear
    # float64 is not the fused path's dtype: it falls back to peft (several nodes) ...
    assert type(layer(x).grad_fn).__name__ == "AddBackward0"
    model = adapted()
    layer = model.base_model.model.up
    assert type(layer(torch.randn(3, 24)).grad_fn).__name__ == "_LoraLinearFunctionBackward"
    # ... so check the function itself against finite differences in float64
    base = nn.Linear(24, 40).double().requires_grad_(False)
    a = torch.randn(4, 24, dtype=torch.float64, requires_grad=True)
    b = torch.randn(40, 4, dtype=torch.float64, requires_grad=True)
    x = torch.randn(2, 3, 24, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, a, b: _LoraLinearFunction.apply(x, a, b, 2.0, base, None), (x, a, b))


def test_a_fresh_adapter_adds_exactly_nothing():
    """B starts at zero: the adapted layer's output is the base layer's bit for bit, so a fresh policy and its
    adapters-off reference agree exactly (a KL of exactly 0 at the first step)."""
    model = adapted(random_b=False, packed=True)
    x = torch.randn(7, 24)
    with torch.no_grad(), packed_weights():
        out = model(x)
        with model.disable_adapter():
            reference = model(x)
    assert torch.equal(out, reference)


def test_cases_it_does_not_cover_run_peft_forward():
    x = torch.randn(5, 24)
    layer = adapted(dropout=0.5).base_model.model.up
    assert type(layer(x).grad_fn).__name__ == "AddBackward0"  # dropout in training mode: peft's forward
    layer.eval()
    assert type(layer(x).grad_fn).__name__ == "_LoraLinearFunctionBackward"  # eval: dropout is the identity
    model = adapted()
    with model.disable_adapter():
        out = model.base_model.model.up(x)
    assert torch.equal(out, model.base_model.model.up.base_layer(x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert type(model.base_model.model.up(x).grad_fn).__name__ != "_LoraLinearFunctionBackward"


def test_merging_and_copies_keep_the_function(monkeypatch):
    model = adapted()
    x = torch.randn(4, 24)
    with torch.no_grad():
        out = model(x)
        copied = copy.deepcopy(model)
        assert copied.base_model.model.up.forward.__self__ is copied.base_model.model.up  # bound to the copy
        torch.testing.assert_close(copied(x), out)
        torch.testing.assert_close(merged_copy(model)(x), out, atol=1e-5, rtol=1e-5)
        model.merge_adapter()  # merged in place: the fused path steps aside, the merged base layer computes all
        torch.testing.assert_close(model(x), out, atol=1e-5, rtol=1e-5)


def test_apply_lora_fuses_and_it_can_be_turned_off(monkeypatch):
    config = LoraConfig(rank=4, alpha=8, target_modules="all-linear")
    model = apply_lora(load_causal_lm("builtin:tiny-arith"), config)
    layers = [m for m in model.modules() if type(m) is LoraLinear]
    assert layers and all("forward" in m.__dict__ for m in layers)
    monkeypatch.setenv("VERL_FUSED_LORA", "0")
    model = apply_lora(load_causal_lm("builtin:tiny-arith"), config)
    assert not any("forward" in m.__dict__ for m in model.modules() if type(m) is LoraLinear)


def test_no_gradient_forward_equals_peft_by_the_packed_base():
    plain, fused = adapted(fused=False), adapted(packed=True)
    x = torch.randn(2, 5, 24)
    with torch.no_grad(), packed_weights():
        torch.testing.assert_close(fused(x), plain(x), atol=1e-5, rtol=1e-5)
    assert fused.base_model.model.up.base_layer._verl_packed.packed is not None

"""LoRA linear layers as one autograd node: the adapter's product added inside a GEMM, not in separate passes.

peft's ``lora.Linear`` computes ``base(x) + lora_B(lora_A(dropout(x))) * scaling``: besides the three products,
two elementwise passes over the ``(rows, out)`` output forward (the scale, the sum) and their mirror images
backward, plus one more sum over ``(rows, in)`` for the input's gradient, each an autograd node of its own. On a
CPU at training shapes (a few hundred rows, SmolLM2's 576-1536 features, rank 16) those passes and nodes are a
few percent of the update. Here the same function is one autograd node per layer:

    forward:   y  = base(x);  xa = x A^T;  y += s * xa B^T           (addmm_ into y, no (rows, out) temporary)
    backward:  gxa = s * g B;  grad B = s * g^T xa;  grad A = gxa^T x;  grad x = g W + gxa A  (addmm_ again)

with ``x (rows, in)``, ``A (r, in)``, ``B (out, r)``, ``W (out, in)`` the frozen base weight, ``s`` = alpha / r.
The base product runs by its oneDNN-packed copy where ``verl/models/packed_linear.py`` allows it (inside
``packed_weights()``; the input's gradient by the packed transpose), else ``F.linear`` and a plain GEMM. Results
equal peft's to float rounding (the scale is applied inside the GEMM); an adapter whose ``B`` is zero (a fresh
one) adds exactly zero, so a fresh policy and its adapters-off reference still agree bit for bit.

The fused path is taken only where it computes exactly peft's function: vanilla LoRA (no DoRA or other variant),
one active adapter, adapters enabled and not merged, no dropout in effect (``p = 0`` or eval mode), a frozen fp32
CPU base layer of type ``nn.Linear``, no autocast, no per-row ``adapter_names``. Everything else runs peft's own
forward. ``VERL_FUSED_LORA=0`` turns it off.

Without a gradient (generation) the same arithmetic runs without an autograd node's cost.

    from verl.models.fused_lora import use_fused_lora
    use_fused_lora(peft_model)   # returns how many LoRA layers got the fused forward
"""

from __future__ import annotations

import os
import types
from typing import Any

import torch
import torch.nn.functional as F
from peft.tuners.lora.layer import Linear as LoraLinear
from torch import nn

from verl.models.packed_linear import _PackedWeight, packed_cache, packed_product, packed_product_transposed


class _LoraLinearFunction(torch.autograd.Function):
    """``base(x) + scaling * (x A^T) B^T`` for a frozen base layer; gradients for ``x``, ``A`` and ``B``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float,
                base: nn.Linear, cache: _PackedWeight | None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # (rows, in)
        if cache is not None:
            out = packed_product(rows, base.weight, base.bias, cache)  # (rows, out)
        else:
            out = F.linear(rows, base.weight.detach(), base.bias.detach() if base.bias is not None else None)
        down = torch.mm(rows, lora_a.t())  # (rows, r)
        out.addmm_(down, lora_b.t(), alpha=scaling)  # the adapter's term summed inside the GEMM
        ctx.save_for_backward(rows, down, lora_a, lora_b)
        ctx.scaling, ctx.base, ctx.cache, ctx.in_shape = scaling, base, cache, x.shape
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        rows, down, lora_a, lora_b = ctx.saved_tensors
        grad = grad_output.reshape(-1, grad_output.shape[-1])  # (rows, out)
        grad_down = torch.mm(grad, lora_b).mul_(ctx.scaling)  # (rows, r): d loss / d (x A^T)
        grad_a = torch.mm(grad_down.t(), rows) if ctx.needs_input_grad[1] else None  # (r, in)
        # (out, r) as the transpose of (down^T grad): a 16-row product runs ~1.7x faster than (grad^T down)'s
        # 16-column one on one CPU thread at these shapes
        grad_b = torch.mm(down.t(), grad).mul_(ctx.scaling).t() if ctx.needs_input_grad[2] else None
        grad_x = None
        if ctx.needs_input_grad[0]:
            if ctx.cache is not None:
                grad_x = packed_product_transposed(grad, ctx.base.weight, ctx.cache)  # (rows, in)
            else:
                grad_x = torch.mm(grad, ctx.base.weight.detach())
            grad_x.addmm_(grad_down, lora_a)
            grad_x = grad_x.view(ctx.in_shape)
        return grad_x, grad_a, grad_b, None, None, None


def _single_vanilla_adapter(layer: nn.Module) -> str | None:
    """The one active vanilla adapter of a peft LoRA layer, or None where the fused path does not apply."""
    if layer.disable_adapters or layer.merged or len(layer.active_adapters) != 1:
        return None
    name = layer.active_adapters[0]
    if name not in layer.lora_A or name in getattr(layer, "lora_variant", {}):
        return None
    dropout = layer.lora_dropout[name]
    if isinstance(dropout, nn.Dropout) and dropout.p > 0 and dropout.training:
        return None
    return name


def _fusable_adapter(layer: nn.Module, x: torch.Tensor) -> str | None:
    """The adapter whose term the fused path may compute for ``layer`` and input ``x``, else None: one vanilla
    adapter (``_single_vanilla_adapter``) on a frozen fp32 CPU ``nn.Linear`` base, fp32 CPU input, no autocast."""
    name = _single_vanilla_adapter(layer)
    base = layer.base_layer
    if name is None or type(base) is not nn.Linear:
        return None
    lora_a, lora_b, weight = layer.lora_A[name].weight, layer.lora_B[name].weight, base.weight
    if weight.requires_grad or (base.bias is not None and base.bias.requires_grad) \
            or torch.is_autocast_enabled("cpu") or x.device.type != "cpu" or weight.device.type != "cpu" \
            or not (x.dtype == weight.dtype == lora_a.dtype == lora_b.dtype == torch.float32) \
            or type(weight) not in (torch.Tensor, nn.Parameter):  # DTensor (FSDP) and other subclasses
        return None
    return name


def _fused_forward(self: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """peft's ``lora.Linear.forward`` as one autograd node where that computes the same (module docstring)."""
    name = None if args or kwargs else _fusable_adapter(self, x)
    if name is None:
        return type(self).forward(self, x, *args, **kwargs)  # peft's own
    base = self.base_layer
    lora_a, lora_b = self.lora_A[name].weight, self.lora_B[name].weight
    gradients = torch.is_grad_enabled() and (x.requires_grad or lora_a.requires_grad or lora_b.requires_grad)
    if gradients:
        cache = packed_cache(base, x, gradients=x.requires_grad)
        return _LoraLinearFunction.apply(x, lora_a, lora_b, float(self.scaling[name]), base, cache)
    # No gradient (generation): the same arithmetic without an autograd node's cost. The base layer itself
    # multiplies: its packed product where it would use one (verl/models/packed_linear.py).
    rows = x.reshape(-1, x.shape[-1])
    out = base(rows)
    out.addmm_(torch.mm(rows, lora_a.t()), lora_b.t(), alpha=float(self.scaling[name]))
    return out.view(*x.shape[:-1], out.shape[-1])


def use_fused_lora(model: nn.Module) -> int:
    """Give every peft LoRA ``Linear`` in ``model`` the fused forward; returns how many layers got it."""
    if os.environ.get("VERL_FUSED_LORA", "1") == "0":
        return 0
    count = 0
    for module in model.modules():
        if type(module) is LoraLinear and "forward" not in module.__dict__:
            # the class's forward stays peft's, for every case the fused path leaves out
            module.forward = types.MethodType(_fused_forward, module)
            count += 1
    return count

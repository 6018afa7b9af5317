"""The SwiGLU MLP's ``silu(gate) * up`` as one autograd node with a one-pass backward (Llama / Mistral / Qwen).

Hugging Face's ``LlamaMLP`` computes ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``: autograd records the SiLU
and the product, keeps ``gate``, ``silu(gate)`` and ``up`` for the backward and runs three passes over the
``(tokens, intermediate)`` activations there (the product's two gradients, then SiLU's backward), each into a
fresh temporary. At a training update's shapes (~730 packed tokens x 1536 on SmolLM2) on one CPU thread that is
~70 ms of a ~4.4 s update (30 layers, forward and backward). Here:

    forward:   h = silu(gate);  h *= up                       torch's own SiLU and product: Hugging Face's bits
    backward:  sig = 1 / (1 + exp(-gate))
               d gate = dh * up * sig * (1 + gate * (1 - sig));   d up = dh * gate * sig     one pass, in C++

with ``gate, up, h (..., intermediate)``; only ``gate`` and ``up`` are kept for the backward (one activation
fewer per layer). Outputs are Hugging Face's bit for bit; the gradients equal autograd's to float rounding (the
kernel's ``exp`` is a polynomial, ~1 ulp).

Taken for the MLPs of ``MLP_CLASSES`` with ``hidden_act == "silu"`` on fp32 CPU tensors outside autocast, the
kernels built; elsewhere the module's own forward runs. ``VERL_FUSED_SWIGLU=0`` turns it off.

    from verl.models.swiglu import use_fused_swiglu
    use_fused_swiglu(model)     # returns how many MLPs got the fused forward
"""

from __future__ import annotations

import os
import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from verl.models.cpu_kernels import load_kernels

MLP_CLASSES = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"})


class _SiluMulFunction(torch.autograd.Function):
    """``silu(gate) * up``; gradients for both."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, kernels: Any) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        ctx.kernels = kernels
        return F.silu(gate).mul_(up)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        grad_gate, grad_up = ctx.kernels.silu_mul_backward(grad.contiguous(), gate, up)
        return grad_gate, grad_up, None


def _fused_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The MLP's forward with ``silu(gate) * up`` as one node where it applies (see the module docstring)."""
    gate, up = self.gate_proj(x), self.up_proj(x)
    plain = (gate.dtype == up.dtype == torch.float32 and gate.device.type == "cpu" and gate.is_contiguous()
             and up.is_contiguous() and gate.shape == up.shape and not torch.is_autocast_enabled("cpu"))
    if not plain:
        return self.down_proj(self.act_fn(gate) * up)
    if not (torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad)):
        return self.down_proj(F.silu(gate).mul_(up))  # no graph: the product in place, the same bits
    kernels = load_kernels()
    if kernels is None:
        return self.down_proj(self.act_fn(gate) * up)
    return self.down_proj(_SiluMulFunction.apply(gate, up, kernels))


def _fusable(module: nn.Module) -> bool:
    config = getattr(module, "config", None)
    return (type(module).__name__ in MLP_CLASSES and getattr(config, "hidden_act", None) == "silu"
            and all(hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn")))


def use_fused_swiglu(model: nn.Module) -> int:
    """Give every Llama-family SiLU MLP in ``model`` the fused forward; returns how many MLPs got it."""
    if os.environ.get("VERL_FUSED_SWIGLU", "1") == "0":
        return 0
    count = 0
    for module in model.modules():
        if _fusable(module) and "forward" not in module.__dict__:
            module.forward = types.MethodType(_fused_forward, module)
            count += 1
    return count

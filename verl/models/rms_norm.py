"""RMSNorm as one autograd node with a hand-derived backward (Llama / Mistral / Qwen2 / Qwen3 on CPU).

Hugging Face's ``LlamaRMSNorm`` is ``weight * (x * rsqrt(mean(x^2) + eps))`` written as five tensor ops, so
autograd records five nodes and its backward makes about eight passes over the ``(rows, hidden)`` activations
(the power's and the mean's gradients, two products, a sum of two input gradients). A decoder has two norms per
layer plus a final one (61 in SmolLM2), and at a training update's shapes (~800 rows x 576) on one CPU thread the
norms took ~2.4 ms each forward + backward; this function takes ~1.1 ms (measured, frozen weight: LoRA).

    forward:   r = rsqrt(mean(x^2) + eps)    (rows, 1);   y = x * r * w
    backward:  gxn = g * w;   grad x = r * (gxn - x * r^2 * mean(gxn * x));   grad w = sum over rows of g * x * r

with ``x, g, y (..., hidden)`` and ``w (hidden)``. The forward computes exactly Hugging Face's function (the same
ops in the same order, so the same bits); the input's gradient equals autograd's to float rounding.

Taken only for fp32 CPU tensors outside autocast with a plain (not sharded) weight; elsewhere the module's own
forward runs (it upcasts half precision to fp32 first, which this function does not), except for float64 inputs,
which it rounds through fp32 and which are normed in float64 here instead. ``VERL_FUSED_RMS_NORM=0`` turns it off.

    from verl.models.rms_norm import use_fused_rms_norm
    use_fused_rms_norm(model)   # returns how many norms got the fused forward
"""

from __future__ import annotations

import os
import types

import torch
from torch import nn

# Norm classes that compute exactly ``weight * (x * rsqrt(mean(x^2) + variance_epsilon))``; Gemma's (1 + weight)
# and others are left alone.
RMS_NORM_CLASSES = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})


class _RMSNormFunction(torch.autograd.Function):
    """``weight * (x * rsqrt(mean(x^2, -1) + eps))`` over the last dimension; gradients for ``x`` and ``weight``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        inv_rms = torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(eps))  # (..., 1)
        out = x * inv_rms
        out = weight * out  # weight first, as Hugging Face writes it: the same rounding
        ctx.save_for_backward(x, inv_rms, weight)
        return out

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        x, inv_rms, weight = ctx.saved_tensors
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad_output * x).mul_(inv_rms).sum(dim=tuple(range(x.dim() - 1)))  # (hidden,)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_normed = grad_output * weight  # d loss / d (x * inv_rms)
            # d inv_rms / d x_j = -inv_rms^3 x_j / hidden: one batched dot product per row, no (rows, hidden) temp
            coeff = torch.linalg.vecdot(grad_normed, x).unsqueeze(-1).mul_(inv_rms.square()).div_(x.shape[-1])
            grad_x = torch.addcmul(grad_normed, x, coeff, value=-1).mul_(inv_rms)
        return grad_x, grad_weight, None


def _fused_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """The norm through ``_RMSNormFunction`` where it computes the module's function (see the module docstring)."""
    weight = self.weight
    if hidden_states.dtype == torch.float64:
        # Hugging Face's forward rounds through float32; a float64 model (model.dtype=float64, numerical checks)
        # means float64 throughout, so the same function in float64 (sharded weights included).
        return weight * (hidden_states * torch.rsqrt(hidden_states.pow(2).mean(-1, keepdim=True)
                                                     + self.variance_epsilon))
    if hidden_states.dtype != torch.float32 or weight.dtype != torch.float32 \
            or hidden_states.device.type != "cpu" or weight.device.type != "cpu" \
            or torch.is_autocast_enabled("cpu") or type(weight) not in (torch.Tensor, nn.Parameter):
        return type(self).forward(self, hidden_states)
    return _RMSNormFunction.apply(hidden_states, weight, self.variance_epsilon)


def use_fused_rms_norm(model: nn.Module) -> int:
    """Give every Llama-family RMSNorm in ``model`` the fused forward; returns how many norms got it."""
    if os.environ.get("VERL_FUSED_RMS_NORM", "1") == "0":
        return 0
    count = 0
    for module in model.modules():
        if type(module).__name__ in RMS_NORM_CLASSES and hasattr(module, "variance_epsilon") \
                and "forward" not in module.__dict__:
            module.forward = types.MethodType(_fused_forward, module)
            count += 1
    return count

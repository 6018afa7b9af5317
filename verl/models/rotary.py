"""Rotary position embedding as one autograd node with a one-pass kernel each way (Llama / Mistral / Qwen on CPU).

Hugging Face's ``apply_rotary_pos_emb`` is ``q * cos + rotate_half(q) * sin`` (and the same for ``k``), where
``rotate_half`` slices, negates and concatenates: per tensor five passes over the activations forward, autograd's
mirror images backward (the two products' gradients, the negation, the slices' scatter into a new tensor, a sum),
each with a fresh temporary. At a training update's shapes (~730 packed tokens, 9 + 3 heads of 64) on one CPU
thread that was ~50 ms of a ~4.4 s SmolLM2 update (60 calls, forward and backward). Here each direction is one
call of ``csrc/decoder_ops.cpp``'s ``rope`` per tensor:

    forward:   out1 = x1 * cos1 - x2 * sin1;   out2 = x2 * cos2 + x1 * sin2          (x = [x1 | x2], halves of D)
    backward:  g_x1 = g1 * cos1 + g2 * sin2;   g_x2 = g2 * cos2 - g1 * sin1

with ``q (B, H, T, D)`` as the attention module holds it (a transposed view of ``(B, T, H, D)`` memory, the only
layout taken), ``cos, sin (B or 1, T, D)``. Each product is rounded before the sum (no fused multiply-add), so the
outputs and the input gradients are Hugging Face's bit for bit: nothing any loss or log-prob computes changes.

Transformers' attention layers call the module-level function ``apply_rotary_pos_emb`` of their modeling file at
each forward; ``use_fused_rotary()`` replaces that name in the Llama, Mistral, Qwen2 and Qwen3 modeling modules
with ``fused_apply_rotary_pos_emb``, which runs the node where it applies (fp32 CPU tensors, no autocast, the
layout above, the kernels built) and the original function everywhere else. ``VERL_FUSED_ROTARY=0`` leaves the
modules alone.

    from verl.models.rotary import use_fused_rotary
    use_fused_rotary()     # once per process; returns how many modeling modules it patched
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import Any

import torch

from verl.models.cpu_kernels import load_kernels

# Modeling modules whose apply_rotary_pos_emb is Llama's (q * cos + rotate_half(q) * sin on half-split heads).
MODELING_MODULES = ("llama", "mistral", "qwen2", "qwen3")
_ORIGINALS: dict[str, Callable] = {}


class _RotaryFunction(torch.autograd.Function):
    """Rotary embedding of ``q`` and ``k`` (B, heads, T, D) views of (B, T, heads, D) memory; gradients for both."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kernels: Any) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(cos, sin)
        ctx.kernels = kernels
        return (kernels.rope(q.transpose(1, 2), cos, sin, False).transpose(1, 2),
                kernels.rope(k.transpose(1, 2), cos, sin, False).transpose(1, 2))

    @staticmethod
    def backward(ctx, grad_q: torch.Tensor, grad_k: torch.Tensor):
        cos, sin = ctx.saved_tensors
        rope = ctx.kernels.rope

        def back(grad: torch.Tensor) -> torch.Tensor:
            grad = grad.transpose(1, 2)  # (B, T, H, D); the kernel takes any strides but a unit last one
            return rope(grad if grad.stride(-1) == 1 else grad.contiguous(), cos, sin, True).transpose(1, 2)

        return (back(grad_q) if ctx.needs_input_grad[0] else None,
                back(grad_k) if ctx.needs_input_grad[1] else None, None, None, None)


def _applies(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int) -> bool:
    if unsqueeze_dim != 1 or q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape:
        return False
    tensors = (q, k, cos, sin)
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors) or torch.is_autocast_enabled("cpu"):
        return False
    if cos.requires_grad or sin.requires_grad or not (cos.is_contiguous() and sin.is_contiguous()):
        return False  # the node gives no gradient to cos / sin (a rotary embedding's are buffers)
    batch, _, length, dim = q.shape
    return (q.transpose(1, 2).is_contiguous() and k.transpose(1, 2).is_contiguous() and k.shape[0] == batch
            and k.shape[2] == length and k.shape[3] == dim and dim % 2 == 0 and cos.shape[1] == length
            and cos.shape[2] == dim and cos.shape[0] in (1, batch))


def fused_apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                               unsqueeze_dim: int = 1, *, original: Callable | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_rotary_pos_emb`` by the fused node where it applies (module docstring), else by ``original``
    (Llama's function by default)."""
    kernels = load_kernels() if _applies(q, k, cos, sin, unsqueeze_dim) else None
    if kernels is None:
        return (original or _llama_original())(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    return _RotaryFunction.apply(q, k, cos, sin, kernels)


def _llama_original() -> Callable:
    """Llama's own function, whether or not ``use_fused_rotary`` has replaced the module's name."""
    from transformers.models.llama import modeling_llama  # noqa: PLC0415

    return _ORIGINALS.get("llama", modeling_llama.apply_rotary_pos_emb)


def use_fused_rotary() -> int:
    """Route the Llama-family modeling modules' ``apply_rotary_pos_emb`` through the fused node (once per process;
    later calls patch nothing more); returns how many modules it patched."""
    if os.environ.get("VERL_FUSED_ROTARY", "1") == "0":
        return 0
    count = 0
    for name in MODELING_MODULES:
        if name in _ORIGINALS:
            continue
        try:
            module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        except ImportError:
            continue
        original = getattr(module, "apply_rotary_pos_emb", None)
        if original is None:
            continue
        _ORIGINALS[name] = original

        def patched(q, k, cos, sin, unsqueeze_dim=1, _original=original):
            return fused_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim, original=_original)

        patched.__doc__ = fused_apply_rotary_pos_emb.__doc__
        module.apply_rotary_pos_emb = patched
        count += 1
    return count

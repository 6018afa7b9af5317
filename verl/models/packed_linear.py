"""Inference-time linear layers with weights pre-packed for oneDNN on CPU (decode at small batch sizes).

``F.linear`` on CPU calls MKL's sgemm, which re-packs the weight matrix into its blocked layout on every call. At
decode (16 rows per product, weights far larger than the caches) that re-packing costs as much as the product:
the weights are read, written and read again each step. oneDNN can keep a weight in its blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``) and multiply by it as it is (``_linear_pointwise``), as PyTorch's
own compiled CPU inference does. Measured on one thread, 16 rows, SmolLM2's shapes with 30 distinct weights (so
they stream from memory as in a real model): 576->1536 2.9x, 1536->576 1.6x, 576->576 1.8x, the 576->49152 LM
head 4.5x faster than ``F.linear``; at 496 rows (a training forward) 1.2x.

    from verl.models.packed_linear import use_packed_linear
    use_packed_linear(model)     # CPU fp32 only; a no-op elsewhere

Inside ``with packed_weights():`` — the generation loops: the rollout's sampler, ``generate`` in the rollout
engine, the serving engine's forward — every ``nn.Linear`` of the model whose weight is frozen
(``requires_grad=False``: LoRA's base layers, evaluation and serving models) multiplies by a packed copy of its
weight where no gradient flows through the product. Inside ``with packed_weights(gradients=True):`` — the actor's
log-probs and update (``verl/workers/actor.py``) — the frozen layers pack even where a gradient flows to their
input (LoRA training: the base layers between the adapters): forward by the packed weight, the input's gradient
``grad_output @ weight`` by a packed copy of the transpose, built on the first backward (measured at the update's
shapes, 264-496 rows: 10-20% faster products both ways; one more copy of those weights). The LoRA reference (the
same base, adapters off) packs too, so an untrained policy and its reference still compute bit for bit alike (the
first step's KL is exactly zero, tested). Elsewhere (a separate reference model, the exact-KL evaluator, critics)
the layers run ``F.linear``. A trainable weight keeps no packed copy beyond one generation block: the fused AdamW
kernel updates it without bumping its version counter, so a lasting copy could not tell it had gone stale. The
rollout's generation loops enter ``packed_weights(trainable=True)``: there, with gradients off, trainable layers
(full fine-tuning; not LoRA's rank-r factors, a side under ``SNAPSHOT_MIN_SIDE``) pack once and drop the copies
when the block ends (measured on the tiny agent, full fine-tuning, 512 trajectories on 128 slots, one thread, 5
alternating repeats: single-turn rollout 2.40 -> 2.15 s, multi-turn 3.28 -> 2.92 s, 1.12x each). A frozen
weight's packed copy is rebuilt when the weight is replaced or changed by an ordinary in-place op (``copy_``,
``load_state_dict``); code that rewrites a frozen weight behind autograd's back (``.data`` writes, LoRA merges into
a model that already generated) calls ``refresh_packed_linear(model)``. Cost: one more copy of the frozen linear
weights (two in a process that trains LoRA). Results equal ``F.linear``'s to float rounding (another summation
order), not bit for bit. ``VERL_PACKED_LINEAR=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import types
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

# 0: plain F.linear; 1: packed where no gradient flows; 2: packed also where a gradient flows to the input.
_ACTIVE: contextvars.ContextVar[int] = contextvars.ContextVar("verl_packed_weights", default=0)


class _Snapshot:
    """One ``packed_weights(trainable=True)`` block: the packed copies of trainable weights made in it, dropped
    when it ends (a trainable weight can change after it without a sign a packed copy could check)."""

    __slots__ = ("filled",)

    def __init__(self) -> None:
        self.filled: list[_PackedWeight] = []


_SNAPSHOT: contextvars.ContextVar[_Snapshot | None] = contextvars.ContextVar("verl_packed_snapshot", default=None)
SNAPSHOT_MIN_SIDE = 64  # trainable weights with a side below this (LoRA factors) keep F.linear in a rollout


@contextlib.contextmanager
def packed_weights(gradients: bool = False, trainable: bool = False) -> Iterator[None]:
    """Let frozen linear layers use their packed weights in this block (this thread / task only).

    ``gradients=True`` also packs products whose input needs a gradient (LoRA training: the frozen base layers
    between the adapters): forward by the packed weight, the input's gradient by a packed copy of its transpose.
    ``trainable=True`` (a generation loop: no gradients, weights unchanged until it ends) packs trainable weights
    too, each once per block: a full fine-tuning rollout decodes by packed weights as a LoRA one does.
    """
    token = _ACTIVE.set(2 if gradients else 1)
    snapshot = _SNAPSHOT.set(_Snapshot()) if trainable and _SNAPSHOT.get() is None else None
    try:
        yield
    finally:
        if snapshot is not None:
            for copy in _SNAPSHOT.get().filled:
                copy.key = copy.packed = copy.packed_t = None
            _SNAPSHOT.reset(snapshot)
        _ACTIVE.reset(token)


def packed_linear_available() -> bool:
    """oneDNN's packed linear exists in this torch build (CPU builds have it)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class _PackedWeight:
    """The packed copy of one ``nn.Linear`` weight and what it was packed from (storage pointer, version)."""

    __slots__ = ("key", "packed", "packed_t", "snapshot", "snapshot_copy")

    def __init__(self) -> None:
        self.key: tuple[int, int] | None = None
        self.packed: torch.Tensor | None = None
        self.packed_t: torch.Tensor | None = None  # the transpose's, for input gradients (built on first need)
        self.snapshot: _Snapshot | None = None  # a trainable weight's copy: the block it was packed in
        self.snapshot_copy: _PackedWeight | None = None

    def for_snapshot(self, snapshot: _Snapshot) -> _PackedWeight:
        """The copy a trainable weight multiplies by in ``snapshot``'s block (packed on its first use there)."""
        if self.snapshot is not snapshot:
            self.snapshot, self.snapshot_copy = snapshot, _PackedWeight()
            snapshot.filled.append(self.snapshot_copy)
        return self.snapshot_copy

    def __deepcopy__(self, memo: dict) -> _PackedWeight:
        return _PackedWeight()  # a copied model packs its own (copied) weights on first use

    def __getstate__(self) -> None:
        return None

    def __setstate__(self, state: None) -> None:
        self.key = self.packed = self.packed_t = self.snapshot = self.snapshot_copy = None

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        """The packed ``(out, in)`` weight."""
        self._check(weight)
        if self.packed is None:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        return self.packed

    def get_transposed(self, weight: torch.Tensor) -> torch.Tensor:
        """The packed ``(in, out)`` transpose: ``grad_input = grad_output @ weight`` as a packed linear."""
        self._check(weight)
        if self.packed_t is None:
            self.packed_t = torch.ops.mkldnn._reorder_linear_weight(weight.detach().t().contiguous(), None)
        return self.packed_t

    def _check(self, weight: torch.Tensor) -> None:
        key = (weight.data_ptr(), weight._version)
        if key != self.key:  # first use, an in-place update (optimizer step) or a new tensor (checkpoint load)
            self.packed = self.packed_t = None
            self.key = key


def _pointwise(input: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(input.contiguous(), packed, bias, "none", [], "")


def packed_cache(module: nn.Module, input: torch.Tensor, gradients: bool | None = None) -> _PackedWeight | None:
    """The packed copies ``module`` multiplies ``input`` by here and now, or None where it uses ``F.linear``
    (outside ``packed_weights()``, a trainable weight or bias, autocast, not fp32 CPU, or a gradient to flow to the
    input outside ``packed_weights(gradients=True)``). ``gradients`` overrides whether one flows."""
    cache = getattr(module, "_verl_packed", None)
    mode = _ACTIVE.get()
    if cache is None or mode == 0:
        return None
    weight, bias = module.weight, module.bias
    if gradients is None:
        gradients = torch.is_grad_enabled() and input.requires_grad
    if (gradients and mode < 2) or torch.is_autocast_enabled("cpu") or input.dtype != torch.float32 \
            or weight.dtype != torch.float32 or input.device.type != "cpu" or weight.device.type != "cpu":
        return None
    if weight.requires_grad or (bias is not None and bias.requires_grad):
        snapshot = _SNAPSHOT.get()
        # A LoRA adapter's rank-r factors stay on F.linear: at 16 rows, 576x16 and 16x576 products took 12 / 11 us
        # packed against 5 / 5 us (one thread), and the copies would be made for every rollout.
        if snapshot is None or torch.is_grad_enabled() or min(weight.shape) < SNAPSHOT_MIN_SIDE:
            return None
        return cache.for_snapshot(snapshot)
    return cache


def packed_product(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   cache: _PackedWeight) -> torch.Tensor:
    """``F.linear(input, weight, bias)`` by the packed copy (no autograd: the caller handles gradients)."""
    return _pointwise(input, cache.get(weight), bias.detach() if bias is not None else None)


def packed_product_transposed(grad_output: torch.Tensor, weight: torch.Tensor, cache: _PackedWeight) -> torch.Tensor:
    """``grad_output @ weight``, the input's gradient of ``F.linear``, by the packed transpose."""
    return _pointwise(grad_output, cache.get_transposed(weight), None)


class _PackedLinearFunction(torch.autograd.Function):
    """``F.linear`` by a frozen weight's packed copies: the input's gradient only (the weight and bias get none)."""

    @staticmethod
    def forward(ctx, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                cache: _PackedWeight) -> torch.Tensor:
        ctx.weight, ctx.cache = weight, cache  # the weight itself, not saved for backward: it is frozen
        return packed_product(input, weight, bias, cache)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return packed_product_transposed(grad_output, ctx.weight, ctx.cache), None, None, None


def _packed_forward(self: nn.Linear, input: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` through the packed weight where ``packed_cache`` allows it (see the module docstring)."""
    cache = packed_cache(self, input)
    if cache is None:
        return F.linear(input, self.weight, self.bias)
    if torch.is_grad_enabled() and input.requires_grad:
        return _PackedLinearFunction.apply(input, self.weight, self.bias, cache)
    return packed_product(input, self.weight, self.bias, cache)


def refresh_packed_linear(model: nn.Module) -> None:
    """Drop every packed copy in ``model``; each is rebuilt from the current weight at its next use."""
    for module in model.modules():
        if hasattr(module, "_verl_packed"):
            module._verl_packed = _PackedWeight()


def remove_packed_linear(model: nn.Module) -> None:
    """Back to ``nn.Linear.forward`` everywhere (before FSDP sharding: its all-gathered weights are new tensors at
    every forward, so a packed copy would be rebuilt each time)."""
    for module in model.modules():
        if hasattr(module, "_verl_packed"):
            del module._verl_packed
            del module.forward  # the class's own forward again


def use_packed_linear(model: nn.Module) -> int:
    """Give every fp32 CPU ``nn.Linear`` in ``model`` the packed inference path; returns how many layers got it."""
    if os.environ.get("VERL_PACKED_LINEAR", "1") == "0" or not packed_linear_available():
        return 0
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.dtype == torch.float32 \
                and module.weight.device.type == "cpu" and not hasattr(module, "_verl_packed"):
            module._verl_packed = _PackedWeight()
            module.forward = types.MethodType(_packed_forward, module)
            count += 1
    return count

"""A CPU attention kernel for one query position per row (the decode step), or a few (an extend), built on first
use.

torch's CPU ``scaled_dot_product_attention`` runs its flash kernel: a small GEMM per (row, head) block, which at one
query position is mostly call overhead, over every column of the cache, padding included. ``csrc/decode_attention.cpp``
reads each (row, K/V head) block's unmasked K and V rows once for all the query heads of its group. Measured with
cold caches (30 layers' caches in turn, one thread): SmolLM2's shape (16 rows, 9 query heads over 3 K/V heads,
head_dim 64, 97 columns) 0.114 vs 0.315 ms per layer; the tiny agent's (128 rows, 4 heads, head_dim 32, 110
columns) 0.84 vs 1.60 ms. No library offers it: vLLM's CPU kernels live inside vLLM's own paged cache and engine.

It is compiled on first use with verl's other CPU kernels (``verl.models.cpu_kernels``: g++ and the ``ninja``
package, once per machine, for the CPU's vector instructions). When it cannot be built or does not apply (grad
enabled, not fp32, a float mask, head_dim other than 32 / 64 / 128), ``decode_attention`` returns None and the
caller runs SDPA. ``VERL_DECODE_KERNEL=0`` turns it off.

    out = decode_attention(query, key, value, mask, scale)   # (B, Q, H, D) or None
    out = decode_attention(query, store_k, store_v, mask, scale, rows=rows)   # query row b reads store row rows[b]
"""

from __future__ import annotations

import os

import torch

from verl.models.cpu_kernels import load_kernels

HEAD_DIMS = (32, 64, 128)  # the head sizes the kernel is compiled for (templates in the source)
# Up to this many query positions per row the kernel runs them one after another (an agent's tool turn fed into
# its cache: ~10 ids); beyond it the flash kernel's blocked GEMMs win (a prompt's prefill). Measured on the tiny
# agent's extend forward (33 rows x 9 ids over 124 columns, 4 layers, one thread): 7.5 vs 8.4 ms; the attention
# alone 0.37 vs 0.48 ms per layer.
MAX_QUERY_POSITIONS = 16


def enabled() -> bool:
    return os.environ.get("VERL_DECODE_KERNEL", "1") != "0"


def applies(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
            rows: torch.Tensor | None = None) -> bool:
    """Whether the kernel computes this call: CPU, fp32, no autograd, a supported head size, and one query
    position with a boolean (B or 1, 1, 1, T) mask or none, or up to ``MAX_QUERY_POSITIONS`` with a boolean
    (B or 1, 1, positions, T) mask (it says what each position sees: causal order is in the mask)."""
    positions = query.shape[2]
    if not 1 <= positions <= MAX_QUERY_POSITIONS or (positions > 1 and mask is None):
        return False
    if query.device.type != "cpu" or query.dtype != torch.float32:
        return False
    if key.dtype != torch.float32 or value.dtype != torch.float32 or query.shape[-1] not in HEAD_DIMS:
        return False
    if value.shape[-1] != query.shape[-1]:
        return False
    if rows is not None and (rows.dtype != torch.long or rows.dim() != 1 or rows.shape[0] != query.shape[0]
                             or not rows.is_contiguous() or rows.device.type != "cpu"):
        return False
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return False  # the kernel has no backward
    if query.stride(-1) != 1 or key.stride(-1) != 1 or value.stride(-1) != 1:
        return False
    return mask is None or (mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[1] == 1
                            and mask.shape[2] == positions and mask.shape[0] in (1, query.shape[0])
                            and mask.shape[3] == key.shape[2])


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                     scale: float, rows: torch.Tensor | None = None) -> torch.Tensor | None:
    """Softmax attention of one query position per row (or a few: ``Q <= MAX_QUERY_POSITIONS``, with a mask).
    Shapes: query (B, H, Q, D), key/value (B, Hkv, T, D) with H a multiple of Hkv (grouped heads read their K/V
    head), mask (B or 1, 1, Q, T) bool, True = attend. Returns (B, Q, H, D), or None when the kernel is off,
    unavailable or does not apply (the caller runs SDPA)."""
    if not enabled() or not applies(query, key, value, mask):
        return None
    kernel = load_kernels()
    if kernel is None:
        return None
    with torch.profiler.record_function("verl::decode_attention"):  # named in profiles (decode_profile.py)
        return kernel.decode_attention(query, key, value, mask, float(scale), rows)

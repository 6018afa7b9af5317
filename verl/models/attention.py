"""verl's CPU attention, as a named transformers attention implementation: sdpa with two changes.

1. **Grouped K/V without copies.** transformers' ``sdpa`` attention repeats the K/V heads of a grouped-query model
   (``repeat_kv``: a copy of the whole cache per layer and step) whenever an attention mask is given on CPU, because
   some GPU kernels cannot take grouped K/V with a mask. On CPU, ``scaled_dot_product_attention(...,
   enable_gqa=True)`` takes them with a mask and gives the identical result (the same kernel, the same arithmetic
   per head). Measured on SmolLM2-135M (9 query heads over 3 K/V heads, batch 16, 97 cached tokens, one thread):
   0.43 -> 0.22 ms per layer call.
2. **A decode kernel** (``verl.models.decode_attention``) for calls with one query position per row (every decode
   step of the serving engine and the rollouts, no autograd), or a few under a mask (an agent's tool turn fed
   into its cache, a short prompt's prefill): it reads each row's unmasked K/V once for all the query heads of a
   group; 0.36-0.5x the flash kernel's time per layer at one position. It falls back to SDPA wherever it does
   not apply.

Everything else (autograd, no mask with several positions, more than ``MAX_QUERY_POSITIONS``, other devices) goes
to transformers' own ``sdpa`` function unchanged, so training forwards and long prefills are bit for bit what
``sdpa`` computes.

    from verl.models.attention import use_cpu_attention
    use_cpu_attention(model)          # a no-op off CPU or for models not on sdpa

``load_causal_lm`` applies it to every model it loads (training, evaluation, serving). ``VERL_CPU_ATTENTION=0``
leaves models on transformers' own sdpa (for comparison); ``VERL_DECODE_KERNEL=0`` turns off the decode kernel only.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask

from verl.models.decode_attention import MAX_QUERY_POSITIONS, decode_attention
from verl.models.slot_cache import gather_visible

NAME = "verl_cpu_sdpa"


def cpu_sdpa_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """``sdpa`` with grouped K/V passed as they are and the decode kernel for one or a few query positions.
    Shapes: query (batch, heads, q_len, head_dim), key/value (batch, kv_heads, kv_len, head_dim); returns
    (batch, q_len, heads, head_dim) and no weights. ``kv_rows`` (int64 (batch,), a model-call keyword): key/value
    are a slot cache's store (slots, kv_heads, kv_len, head_dim) and query row ``b`` attends to slot
    ``kv_rows[b]`` (``verl.models.slot_cache``); the kernel reads the slots in place, SDPA gets them gathered."""
    rows = kwargs.pop("kv_rows", None)
    plain = (dropout == 0.0 and kwargs.get("position_bias") is None and kwargs.get("cache") is None
             and kwargs.get("softcap") is None and kwargs.get("s_aux") is None)
    if plain and query.shape[2] <= MAX_QUERY_POSITIONS:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        output = decode_attention(query, key, value, attention_mask, scale, rows)
        if output is not None:
            return output, None
    if rows is not None:  # the step's rows gathered, what its mask hides zeroed (never-written memory may be NaN)
        key, value = gather_visible(key, rows, attention_mask), gather_visible(value, rows, attention_mask)
    groups = getattr(module, "num_key_value_groups", 1)
    if groups == 1 or query.device.type != "cpu" or attention_mask is None or not plain \
            or key.shape[-1] != value.shape[-1]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    # With a mask, transformers' sdpa never asks the kernel for its causal mode; neither do we.
    output = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                            scale=scaling, is_causal=False, enable_gqa=True)
    return output.transpose(1, 2).contiguous(), None


def cpu_sdpa_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                  mask_function: Callable = causal_mask_function, attention_mask: torch.Tensor | None = None,
                  local_size: int | None = None, use_vmap: bool = False, **kwargs) -> torch.Tensor | None:
    """sdpa's boolean mask ``(batch, 1, q_length, kv_length)``, True = attend. A decode step (one query position
    that every cached column precedes, plain causal masking) needs no mask functions broadcast over index grids:
    its mask is the 2-D padding mask's columns, as a view. transformers builds it the general way at every step:
    ~0.25 ms of a ~7 ms decode step of the tiny agent (cProfile, 120 rows). Anything else goes to ``sdpa_mask``."""
    if (q_length == 1 and mask_function is causal_mask_function and local_size is None and not use_vmap
            and attention_mask is not None and attention_mask.dim() == 2 and attention_mask.dtype == torch.bool
            and attention_mask.shape[0] == batch_size and attention_mask.shape[1] >= kv_offset + kv_length
            and isinstance(q_offset, int) and isinstance(kv_offset, int) and q_offset >= kv_offset + kv_length - 1):
        return attention_mask[:, None, None, kv_offset:kv_offset + kv_length]
    return sdpa_mask(batch_size, q_length, kv_length, q_offset=q_offset, kv_offset=kv_offset,
                     mask_function=mask_function, attention_mask=attention_mask, local_size=local_size,
                     use_vmap=use_vmap, **kwargs)


AttentionInterface.register(NAME, cpu_sdpa_forward)
AttentionMaskInterface.register(NAME, cpu_sdpa_mask)  # sdpa's boolean masks, a decode step's without broadcasting


def use_cpu_attention(model: PreTrainedModel) -> bool:
    """Switch ``model`` to verl's CPU attention when it runs on CPU and uses sdpa now; returns whether it
    switched."""
    if model.device.type != "cpu" or os.environ.get("VERL_CPU_ATTENTION", "1") == "0":
        return False
    if model.config._attn_implementation != "sdpa":
        return False
    model.set_attn_implementation(NAME)
    return True

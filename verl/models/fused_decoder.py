"""Llama-family decoder layers with their small operations fused, for generation forwards on CPU.

A decode step's products take 16 rows; what surrounds them in Hugging Face's decoder layer is ~20 tensor ops
(RMSNorm as pow/mean/add/rsqrt/two products, RoPE as four products, two sums and two concatenations of negated
halves, SiLU and a product, two residual sums), each a dispatch that at 16 rows costs more than its arithmetic:
~5 ms of a 45 ms SmolLM2 step (30 layers, one thread, ``benchmarks/decode_profile.py``). Inside
``fused_decoder_layers()`` a layer runs them as four calls of ``csrc/decoder_ops.cpp`` instead:

    h = rms_norm(x)                        input norm
    q, k, v = q_proj(h), k_proj(h), v_proj(h);   rope_(q, k, cos, sin)     in place
    k, v = cache.update(k, v);   o = o_proj(attention(q, k, v, mask))      the model's attention implementation
    h = add_rms_norm_(o, x)                o += x in place (the residual stream), then its norm
    g = gate_proj(h);   silu_mul_(g, up_proj(h));   out = down_proj(g) + o

with ``x (B, T, hidden)``, ``q (B, T, H, D)``, ``k, v (B, T, Hkv, D)``, ``cos, sin (B, T, D)``. The products,
the cache, the attention and LoRA adapters are the layer's own modules, called as the layer calls them. Results
equal the layer's own forward to float rounding (RoPE and the residual sums bit for bit; the norm's sum of squares
and SiLU's exponential round differently), so it runs only where nothing is compared bit for bit against a
training forward: the generation loops (rollout samplers, the agent loop, the serving engine) enter
``fused_decoder_layers()``; log-probs, references and updates never do.

Taken for ``LlamaDecoderLayer`` and ``Qwen2DecoderLayer`` (SmolLM2, Llama, Qwen2 / 2.5, the built-in tiny models)
with SiLU MLPs, fp32 on CPU, no autograd, no autocast, the kernels built; otherwise the layer's own forward runs.
``VERL_FUSED_DECODER=0`` turns it off.

    from verl.models.fused_decoder import use_fused_decoder, fused_decoder_layers
    use_fused_decoder(model)              # returns how many layers got the fused forward
    with fused_decoder_layers():
        model(...)
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import types
from collections.abc import Iterator

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from verl.models.cpu_kernels import load_kernels

FUSED_LAYER_CLASSES = frozenset({"LlamaDecoderLayer", "Qwen2DecoderLayer"})
NORM_CLASSES = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm"})

_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("verl_fused_decoder", default=False)


@contextlib.contextmanager
def fused_decoder_layers() -> Iterator[None]:
    """Let layers given ``use_fused_decoder`` run fused in this block (this thread / task only): the generation
    loops."""
    token = _ACTIVE.set(True)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def _fusable(layer: nn.Module) -> bool:
    """The layer is the Llama / Qwen2 decoder layer this module reimplements (no extra norms, a SiLU MLP)."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None or getattr(attn, "config", None) is None:
        return False
    norms = (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))
    return (all(type(norm).__name__ in NORM_CLASSES for norm in norms)
            and all(hasattr(attn, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling"))
            and all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj"))
            and not hasattr(attn, "q_norm") and getattr(attn.config, "hidden_act", None) == "silu")


def _applies(hidden_states: torch.Tensor, position_embeddings, kwargs: dict) -> bool:
    if not _ACTIVE.get() or torch.is_grad_enabled() or position_embeddings is None:
        return False
    if hidden_states.dtype != torch.float32 or hidden_states.device.type != "cpu" \
            or not hidden_states.is_contiguous() or torch.is_autocast_enabled("cpu"):
        return False
    if kwargs.get("output_attentions"):
        return False  # attention weights are recorded from the attention module's own forward
    cos, sin = position_embeddings
    return cos.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()


def _fused_forward(self: nn.Module, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   position_ids: torch.LongTensor | None = None, past_key_values=None, use_cache: bool | None = False,
                   position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs) -> torch.Tensor:
    """The decoder layer's forward (see the module docstring); ``hidden_states (B, T, hidden)``."""
    attn, mlp = self.self_attn, self.mlp
    # Eager attention (not in the registry) stays with the layer's own forward, as does anything _applies rejects.
    attention = ALL_ATTENTION_FUNCTIONS.get(attn.config._attn_implementation)
    kernels = load_kernels() if attention is not None and _applies(hidden_states, position_embeddings, kwargs) \
        else None
    if kernels is None:
        return type(self).forward(self, hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                  past_key_values=past_key_values, use_cache=use_cache,
                                  position_embeddings=position_embeddings, **kwargs)
    batch, length, _ = hidden_states.shape
    normed = kernels.rms_norm(hidden_states, self.input_layernorm.weight, self.input_layernorm.variance_epsilon)
    query = attn.q_proj(normed).contiguous().view(batch, length, -1, attn.head_dim)
    key = attn.k_proj(normed).contiguous().view(batch, length, -1, attn.head_dim)
    value = attn.v_proj(normed).view(batch, length, -1, attn.head_dim)
    cos, sin = position_embeddings
    kernels.rope_(query, key, cos, sin)
    query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    if past_key_values is not None:
        key, value = past_key_values.update(key, value, attn.layer_idx)
    if getattr(attn, "sliding_window", None) is not None:
        kwargs["sliding_window"] = attn.sliding_window
    output, _ = attention(attn, query, key, value, attention_mask, dropout=0.0, scaling=attn.scaling, **kwargs)
    residual = attn.o_proj(output.reshape(batch, length, -1)).contiguous()  # owned: the sum goes in place
    norm = self.post_attention_layernorm
    normed = kernels.add_rms_norm_(residual, hidden_states, norm.weight, norm.variance_epsilon)
    gate = mlp.gate_proj(normed).contiguous()
    kernels.silu_mul_(gate, mlp.up_proj(normed).contiguous())
    return mlp.down_proj(gate).add_(residual)


def use_fused_decoder(model: nn.Module) -> int:
    """Give every Llama / Qwen2 decoder layer in ``model`` the fused generation forward; returns how many layers got
    it (0 with ``VERL_FUSED_DECODER=0``)."""
    if os.environ.get("VERL_FUSED_DECODER", "1") == "0":
        return 0
    count = 0
    for module in model.modules():
        if type(module).__name__ in FUSED_LAYER_CLASSES and "forward" not in module.__dict__ and _fusable(module):
            module.forward = types.MethodType(_fused_forward, module)
            count += 1
    return count

"""Fused decoder layers for generation (``verl/models/fused_decoder.py``, ``csrc/decoder_ops.cpp``): each fused op
against Hugging Face's own function, whole models against their unfused forward (prefill and decode over a
left-padded cache), taken by the generation loops and nowhere else."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from tests.decode_utils import left_padded_prompts, prefill_then_decode
from tests.kernels import require_kernels
from verl.models import fused_decoder
from verl.models.fused_decoder import fused_decoder_layers, use_fused_decoder
from verl.models.loader import load_causal_lm, resolve_model_path


@pytest.fixture(scope="module")
def kernels():
    return require_kernels()


def test_rope_is_hugging_faces_bit_for_bit(kernels) -> None:
    generator = torch.Generator().manual_seed(0)
    for batch, length, heads, kv_heads, dim, cos_batch in ((3, 5, 9, 3, 64, 3), (2, 1, 4, 4, 32, 1)):
        q = torch.randn(batch, length, heads, dim, generator=generator)
        k = torch.randn(batch, length, kv_heads, dim, generator=generator)
        angles = torch.rand(cos_batch, length, dim // 2, generator=generator) * 40
        cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
        # Hugging Face's layout: (B, H, T, D) and cos/sin unsqueezed over heads.
        q_ref, k_ref = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        kernels.rope_(q, k, cos, sin)
        assert torch.equal(q, q_ref.transpose(1, 2)) and torch.equal(k, k_ref.transpose(1, 2))


def test_norms_and_silu_equal_the_modules_they_replace(kernels) -> None:
    generator = torch.Generator().manual_seed(1)
    norm = LlamaRMSNorm(576, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(576, generator=generator) + 0.5)
    x, residual = torch.randn(2, 7, 576, generator=generator) * 3, torch.randn(2, 7, 576, generator=generator)
    with torch.no_grad():
        torch.testing.assert_close(kernels.rms_norm(x, norm.weight, 1e-5), norm(x), atol=1e-6, rtol=1e-6)
        summed = x.clone()
        normed = kernels.add_rms_norm_(summed, residual, norm.weight, 1e-5)
        assert torch.equal(summed, residual + x)  # the residual stream, bit for bit, written in place
        torch.testing.assert_close(normed, norm(residual + x), atol=1e-6, rtol=1e-6)
        gate, up = torch.randn(3, 1536, generator=generator) * 8, torch.randn(3, 1536, generator=generator)
        gate[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -88.5])  # saturated: finite, as SiLU's limits
        expected = F.silu(gate) * up
        kernels.silu_mul_(gate, up)
        torch.testing.assert_close(gate, expected, atol=1e-6, rtol=2e-6)
    with pytest.raises(RuntimeError, match="contiguous"):
        kernels.rms_norm(x.transpose(0, 1), norm.weight, 1e-5)


def tiny_qwen2() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         attn_implementation="sdpa")
    return Qwen2ForCausalLM(config).eval()


def tiny_llama_scaled_rope() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config).eval()


def decode_logits(model, fused: bool) -> torch.Tensor:
    """Prefill of 3 left-padded prompts, then 4 decode steps into the engines' growing cache: (5, 3, vocab)."""
    with torch.inference_mode(), (fused_decoder_layers() if fused else contextlib.nullcontext()):
        return prefill_then_decode(model, *left_padded_prompts())


@pytest.mark.parametrize("make", [lambda: load_causal_lm(resolve_model_path("builtin:tiny-agent")).eval(),
                                  lambda: load_causal_lm(resolve_model_path("builtin:tiny-arith")).eval(),
                                  tiny_qwen2, tiny_llama_scaled_rope],
                         ids=["tiny-agent", "tiny-arith", "qwen2", "llama-linear-rope"])
def test_fused_layers_compute_the_models_own_forward(make, kernels, monkeypatch) -> None:
    model = make()
    layers = model.config.num_hidden_layers
    assert use_fused_decoder(model) in (0, layers)  # load_causal_lm gave them already; twice is once
    assert all("forward" in layer.__dict__ for layer in model.model.layers)
    calls = []

    class Counting:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(kernels, name)

    monkeypatch.setattr(fused_decoder, "load_kernels", Counting)
    plain = decode_logits(model, fused=False)
    assert not calls  # outside fused_decoder_layers(): the layers' own forward
    fused = decode_logits(model, fused=True)
    assert calls.count("rope_") == 5 * layers and calls.count("silu_mul_") == 5 * layers  # prefill + 4 steps
    torch.testing.assert_close(fused, plain, atol=2e-5, rtol=1e-5)


def test_it_steps_aside_for_gradients_eager_attention_and_the_switch(kernels, monkeypatch) -> None:
    model = tiny_qwen2()
    use_fused_decoder(model)
    calls = []
    monkeypatch.setattr(fused_decoder, "load_kernels", lambda: calls.append(1) or kernels)
    ids = torch.randint(3, 60, (2, 6))
    with fused_decoder_layers():
        loss = model(input_ids=ids).logits.sum()  # autograd on: the layers' own forward, gradients flow
        loss.backward()
        assert not calls and model.model.layers[0].mlp.gate_proj.weight.grad is not None
        model.set_attn_implementation("eager")
        with torch.no_grad():
            model(input_ids=ids)
        assert not calls  # eager attention is not in the registry the fused forward calls
    monkeypatch.setenv("VERL_FUSED_DECODER", "0")
    assert use_fused_decoder(tiny_qwen2()) == 0

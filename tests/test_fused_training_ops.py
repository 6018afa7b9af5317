"""The rotary embedding and SwiGLU's silu(gate) * up as one autograd node each (verl/models/rotary.py,
verl/models/swiglu.py): Hugging Face's outputs bit for bit, its gradients (RoPE's bit for bit, SwiGLU's to
rounding), the original code wherever the node does not apply, and a whole model's training forward unchanged."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import LlamaMLP, rotate_half

from tests.kernels import require_kernels
from verl.models.cpu_kernels import load_kernels
from verl.models.rotary import _ORIGINALS, fused_apply_rotary_pos_emb, use_fused_rotary
from verl.models.swiglu import use_fused_swiglu


@pytest.fixture(autouse=True)
def _kernels():
    require_kernels()


def hugging_face_rope(q, k, cos, sin):
    """transformers' apply_rotary_pos_emb, written out (the modeling module's name may be patched)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rotary_inputs(batch: int, cos_batch: int, requires_grad: bool = True):
    """q (B, 4, T, 8) and k (B, 2, T, 8) as an attention layer holds them: transposed views of (B, T, heads, D)."""
    torch.manual_seed(0)
    length, dim = 5, 8
    q = torch.randn(batch, length, 4, dim).transpose(1, 2).requires_grad_(requires_grad)
    k = torch.randn(batch, length, 2, dim).transpose(1, 2).requires_grad_(requires_grad)
    angles = torch.randn(cos_batch, length, dim // 2)
    emb = torch.cat([angles, angles], dim=-1)
    return q, k, emb.cos(), emb.sin()


@pytest.mark.parametrize("batch,cos_batch", [(2, 2), (3, 1)])
def test_rotary_outputs_and_gradients_are_hugging_faces_bit_for_bit(batch, cos_batch):
    q, k, cos, sin = rotary_inputs(batch, cos_batch)
    q_out, k_out = fused_apply_rotary_pos_emb(q, k, cos, sin)
    assert type(q_out.grad_fn).__name__ == "_RotaryFunctionBackward"
    q_ref, k_ref = hugging_face_rope(q, k, cos, sin)
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
    # gradients arriving in either layout: attention's backward gives (B, H, T, D) memory
    weights_q, weights_k = torch.randn_like(q_ref).contiguous(), torch.randn_like(k_ref)
    grads = torch.autograd.grad((q_out * weights_q).sum() + (k_out * weights_k).sum(), (q, k))
    grads_ref = torch.autograd.grad((q_ref * weights_q).sum() + (k_ref * weights_k).sum(), (q, k))
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_ref, strict=True))


def test_rotary_falls_back_where_the_node_does_not_apply():
    q, k, cos, sin = rotary_inputs(2, 2, requires_grad=False)
    # (B, T, H, D) with unsqueeze_dim=2, float64, a contiguous (B, H, T, D) q: Hugging Face's function runs
    q_out, _ = fused_apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin, unsqueeze_dim=2)
    assert torch.equal(q_out, hugging_face_rope(q, k, cos, sin)[0].transpose(1, 2))
    q64 = q.double().requires_grad_(True)
    out, _ = fused_apply_rotary_pos_emb(q64, k.double(), cos.double(), sin.double())
    assert type(out.grad_fn).__name__ != "_RotaryFunctionBackward"
    out, _ = fused_apply_rotary_pos_emb(q.contiguous().requires_grad_(True), k.contiguous(), cos, sin)
    assert type(out.grad_fn).__name__ != "_RotaryFunctionBackward"


def test_use_fused_rotary_routes_the_modeling_modules_through_the_node():
    use_fused_rotary()
    assert "llama" in _ORIGINALS and modeling_llama.apply_rotary_pos_emb is not _ORIGINALS["llama"]
    q, k, cos, sin = rotary_inputs(2, 1)
    q_out, _ = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    assert type(q_out.grad_fn).__name__ == "_RotaryFunctionBackward"


def mlps(hidden: int = 16, intermediate: int = 40) -> tuple[LlamaMLP, LlamaMLP]:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, hidden_act="silu", num_attention_heads=4,
                         num_key_value_heads=2)
    plain, fused = LlamaMLP(config), LlamaMLP(config)
    fused.load_state_dict(plain.state_dict())
    assert use_fused_swiglu(fused) == 1 and use_fused_swiglu(fused) == 0  # once per module
    return plain, fused


def test_swiglu_output_is_hugging_faces_bit_for_bit_and_gradients_match():
    plain, fused = mlps()
    x = torch.randn(3, 7, 16) * 4  # gates far into both tails of the SiLU
    x_fused, x_plain = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out, ref = fused(x_fused), plain(x_plain)
    assert torch.equal(out, ref)
    assert any(type(node).__name__ == "_SiluMulFunctionBackward" for node in _graph(out.grad_fn))
    weights = torch.randn_like(ref)
    (out * weights).sum().backward()
    (ref * weights).sum().backward()
    torch.testing.assert_close(x_fused.grad, x_plain.grad, atol=1e-5, rtol=1e-5)
    for name in ("gate_proj", "up_proj", "down_proj"):
        torch.testing.assert_close(getattr(fused, name).weight.grad, getattr(plain, name).weight.grad,
                                   atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        assert torch.equal(fused(x), plain(x))


def test_swiglu_backward_matches_autograd_at_extreme_gates():
    kernels = load_kernels()
    gate = torch.tensor([-200.0, -90.0, -20.0, -1.0, 0.0, 1e-3, 1.0, 20.0, 90.0, 200.0]).requires_grad_(True)
    up = torch.linspace(-3, 3, 10).requires_grad_(True)
    grad = torch.randn(10)
    expected = torch.autograd.grad((torch.nn.functional.silu(gate) * up * grad).sum(), (gate, up))
    got = kernels.silu_mul_backward(grad, gate.detach(), up.detach())
    for a, b in zip(got, expected, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def _graph(node) -> list:
    seen, stack = [], [node]
    while stack:
        current = stack.pop()
        if current is None or current in seen:
            continue
        seen.append(current)
        stack.extend(next_node for next_node, _ in current.next_functions)
    return seen


def test_a_llama_training_forward_is_unchanged_and_its_gradients_match():
    """A whole model: the same logits bit for bit with the nodes on (rotary patched in the modeling module, SwiGLU
    per MLP) as with Hugging Face's code, the same loss, the weights' gradients to rounding."""
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    plain = LlamaForCausalLM(config)
    fused = LlamaForCausalLM(config)
    fused.load_state_dict(plain.state_dict())
    assert use_fused_swiglu(fused) == 2
    use_fused_rotary()
    ids = torch.randint(0, 64, (3, 9))
    out = fused(ids, labels=ids)
    names = {type(node).__name__ for node in _graph(out.loss.grad_fn)}
    assert {"_RotaryFunctionBackward", "_SiluMulFunctionBackward"} <= names
    original = modeling_llama.apply_rotary_pos_emb
    modeling_llama.apply_rotary_pos_emb = _ORIGINALS["llama"]
    try:
        ref = plain(ids, labels=ids)
        ref.loss.backward()
    finally:
        modeling_llama.apply_rotary_pos_emb = original
    assert torch.equal(out.logits, ref.logits) and torch.equal(out.loss, ref.loss)
    out.loss.backward()
    for (name, a), (_, b) in zip(fused.named_parameters(), plain.named_parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-4, msg=name)

"""oneDNN-packed linear layers at inference (verl/models/packed_linear.py): equal to F.linear to rounding, never
in the way of gradients, following the weights through optimizer steps and loads, copied models included."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from verl.models.loader import load_causal_lm
from verl.models.packed_linear import (
    packed_linear_available,
    packed_weights,
    refresh_packed_linear,
    remove_packed_linear,
    use_packed_linear,
)


def test_this_torch_build_has_it():
    assert packed_linear_available()  # every CPU build of torch ships oneDNN


def packed_layer(inputs: int = 48, outputs: int = 80, bias: bool = True, frozen: bool = True) -> nn.Linear:
    torch.manual_seed(0)
    layer = nn.Linear(inputs, outputs, bias=bias).requires_grad_(not frozen)
    assert use_packed_linear(layer) == 1
    return layer


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(16, 48), (4, 1, 48), (2, 7, 48)])
def test_no_grad_forward_equals_f_linear(shape, bias):
    layer = packed_layer(bias=bias)
    x = torch.randn(*shape)
    with torch.no_grad():
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))  # outside packed_weights(): plain
        assert layer._verl_packed.packed is None
        with packed_weights():
            out = layer(x)
    assert layer._verl_packed.packed is not None  # the packed path ran
    torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)


def test_gradients_take_the_plain_path():
    layer = packed_layer()  # frozen, but the input needs its gradient (a LoRA layer further down)
    x = torch.randn(8, 48, requires_grad=True)
    with packed_weights():
        out = layer(x)
    assert torch.equal(out, F.linear(x, layer.weight, layer.bias))  # bit-for-bit: F.linear itself
    out.sum().backward()
    assert x.grad is not None
    assert layer._verl_packed.packed is None  # never packed on this path


@pytest.mark.parametrize("shape", [(8, 48), (2, 7, 48)])
def test_gradients_flow_through_the_packed_copies_when_asked(shape):
    """LoRA training: the frozen base's products by packed weights, forward and input gradient (packed transpose)."""
    layer = packed_layer()
    x = torch.randn(*shape, requires_grad=True)
    reference = x.detach().clone().requires_grad_(True)
    with packed_weights(gradients=True):
        out = layer(x)
    with torch.no_grad(), packed_weights():
        assert torch.equal(out, layer(x))  # the no-grad path's very numbers: an untrained LoRA policy = reference
    expected = F.linear(reference, layer.weight, layer.bias)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert layer._verl_packed.packed_t is None  # built on the first backward only
    upstream = torch.randn_like(out)
    out.backward(upstream)
    expected.backward(upstream)
    torch.testing.assert_close(x.grad, reference.grad, atol=1e-5, rtol=1e-5)
    assert layer._verl_packed.packed_t is not None
    assert layer.weight.grad is None and layer.bias.grad is None  # frozen: no gradient computed or stored


def test_the_packed_transpose_follows_the_weight():
    layer = packed_layer()
    x = torch.randn(8, 48, requires_grad=True)
    with packed_weights(gradients=True):
        layer(x).sum().backward()
        with torch.no_grad():
            layer.weight.mul_(-3.0)
        x.grad = None
        layer(x).sum().backward()
    torch.testing.assert_close(x.grad, layer.weight.sum(0).expand(8, -1), atol=1e-5, rtol=1e-5)


def test_trainable_bias_or_autocast_keeps_the_plain_path():
    layer = packed_layer()
    layer.bias.requires_grad_(True)
    x = torch.randn(8, 48, requires_grad=True)
    with packed_weights(gradients=True):
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    layer.bias.requires_grad_(False)
    with packed_weights(gradients=True), torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(x).dtype == torch.bfloat16  # autocast's own F.linear, not a float32 packed product
    assert layer._verl_packed.packed is None


def test_lora_update_packs_the_frozen_base_and_matches_the_plain_update(tmp_path, monkeypatch):
    """One GRPO step with LoRA and a KL loss: the update (forward and backward) and the reference run the frozen
    base by packed weights; the untrained policy's KL to the reference is exactly zero (same kernels on both
    sides), and loss, gradient norm and adapters equal the F.linear run's to rounding."""
    from tests.test_trainer import tiny_config
    from verl.trainer.local import LocalPPOTrainer

    def run(name: str) -> LocalPPOTrainer:
        config = tiny_config(tmp_path / name, model={"lora": {"rank": 4, "alpha": 8}},
                             actor={"use_kl_loss": True, "kl_loss_coef": 0.1})
        trainer = LocalPPOTrainer(config, quiet=True)
        trainer.fit()
        return trainer

    packed = run("packed")
    monkeypatch.setenv("VERL_PACKED_LINEAR", "0")
    plain = run("plain")
    base_layers = {name: m for name, m in packed.model.named_modules()
                   if hasattr(m, "_verl_packed") and not m.weight.requires_grad}
    assert base_layers and all(m._verl_packed.packed is not None for m in base_layers.values())
    # Input gradients flow through every base layer after the first block (the first one's inputs are frozen
    # embeddings: nothing to propagate to).
    assert all(m._verl_packed.packed_t is not None for name, m in base_layers.items()
               if "layers.0." not in name and "lm_head" not in name)
    rows = [json.loads(line) for line in packed.config.log_path().read_text().splitlines()]
    plain_rows = [json.loads(line) for line in plain.config.log_path().read_text().splitlines()]
    ppo = next(r for r in rows if r["scope"] == "ppo" and r["step"] == 1)
    plain_ppo = next(r for r in plain_rows if r["scope"] == "ppo" and r["step"] == 1)
    assert ppo["kl_div"] == 0.0 and ppo["kl_loss"] == 0.0
    for key in ("policy_loss", "grad_norm", "entropy"):
        assert ppo[key] == pytest.approx(plain_ppo[key], rel=1e-4, abs=1e-6)
    for (name, a), (_, b) in zip(packed.model.named_parameters(), plain.model.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)


def test_trainable_weights_are_never_packed_even_after_a_fused_optimizer_step():
    """The fused AdamW kernel does not bump the weight's version counter: a packed copy of a trainable weight
    would silently keep the old weights (seen as a wrong validation accuracy), so trainable layers never pack."""
    layer = packed_layer(frozen=False)
    x = torch.randn(16, 48)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.5, fused=True)
    with torch.no_grad(), packed_weights():
        layer(x)
    F.linear(torch.randn(4, 48), layer.weight, layer.bias).pow(2).sum().backward()
    optimizer.step()
    with torch.no_grad(), packed_weights():
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert layer._verl_packed.packed is None


def test_a_generation_block_packs_trainable_weights_once_and_drops_them_when_it_ends(monkeypatch):
    """``packed_weights(trainable=True)`` (the rollout's generation loops): a full fine-tuning model's trainable
    layers multiply by packed copies made once in the block; the copies go when it ends, so the next block packs
    the weights a fused optimizer step changed in between (no version bump to notice); with gradients on, outside
    such a block, or for a LoRA factor (a side under 64), the plain path as before."""
    layer = packed_layer(inputs=96, outputs=128, frozen=False)
    x = torch.randn(16, 96)
    adapter = packed_layer(inputs=96, outputs=16, bias=False, frozen=False)  # a LoRA factor: too narrow to gain
    reorders = []
    reorder = torch.ops.mkldnn._reorder_linear_weight
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight",
                        lambda *args: reorders.append(1) or reorder(*args), raising=False)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.5, fused=True)
    with torch.no_grad(), packed_weights(trainable=True):
        first = layer(x)
        again = layer(x)
        with packed_weights():  # a block inside it (the rollout engine's own) keeps its packed copies
            inner = layer(x)
        copy_in_block = layer._verl_packed.snapshot_copy
        assert copy_in_block.packed is not None  # the packed path ran
        assert torch.equal(adapter(x), F.linear(x, adapter.weight)) and adapter._verl_packed.snapshot is None
    assert len(reorders) == 1 and torch.equal(first, again) and torch.equal(first, inner)
    torch.testing.assert_close(first, F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
    assert copy_in_block.packed is None  # dropped with its block
    F.linear(torch.randn(4, 96), layer.weight, layer.bias).pow(2).sum().backward()
    optimizer.step()  # changes the weight in place without bumping its version
    with torch.no_grad(), packed_weights(trainable=True):
        after = layer(x)
    assert len(reorders) == 2
    torch.testing.assert_close(after, F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(after, first, atol=1e-3)
    with packed_weights(trainable=True):  # gradients on: the trainable weight's own product
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    with torch.no_grad(), packed_weights():
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert len(reorders) == 2 and layer._verl_packed.packed is None


def test_packed_copy_follows_in_place_changes_loads_and_refreshes():
    layer = packed_layer()
    x = torch.randn(16, 48)
    with torch.no_grad(), packed_weights():
        before = layer(x)
        layer.weight.mul_(2.0)  # an ordinary in-place op: the version counter moves
        after = layer(x)
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
    layer.load_state_dict({k: torch.zeros_like(v) for k, v in layer.state_dict().items()})
    with torch.no_grad(), packed_weights():
        assert torch.count_nonzero(layer(x)) == 0
        layer.weight.data += 1.0  # behind autograd's back: invisible until refreshed
        refresh_packed_linear(layer)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)


def test_a_deep_copy_packs_its_own_weights():
    layer = packed_layer()
    x = torch.randn(16, 48)
    with torch.no_grad(), packed_weights():
        layer(x)
        twin = copy.deepcopy(layer)
        twin.weight.mul_(2.0)
        torch.testing.assert_close(twin(x), F.linear(x, twin.weight, twin.bias), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)


def test_loaded_models_use_it_and_it_can_be_turned_off(monkeypatch):
    model = load_causal_lm("builtin:tiny-arith")
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    assert linears and all(hasattr(m, "_verl_packed") for m in linears)
    remove_packed_linear(model)
    assert not any(hasattr(m, "_verl_packed") or "forward" in vars(m) for m in linears)
    monkeypatch.setenv("VERL_PACKED_LINEAR", "0")
    assert not any(hasattr(m, "_verl_packed") for m in load_causal_lm("builtin:tiny-arith").modules())


def test_model_logits_match_the_unpacked_model():
    packed = load_causal_lm("builtin:tiny-arith").eval().requires_grad_(False)
    plain = copy.deepcopy(packed)
    remove_packed_linear(plain)
    ids = torch.randint(3, packed.config.vocab_size, (4, 12))
    with torch.no_grad():
        assert torch.equal(packed(ids).logits, plain(ids).logits)  # outside generation: the very same kernels
        with packed_weights():
            torch.testing.assert_close(packed(ids).logits, plain(ids).logits, atol=1e-4, rtol=1e-4)

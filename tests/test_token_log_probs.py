"""Token log-probs from hidden states, a block of rows at a time (verl/models/token_log_probs.py): the same numbers
and gradients as logits -> / temperature -> log_softmax -> gather, and the model forward that uses it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

from verl.algos.losses import entropy_from_log_probs
from verl.config import LoraConfig
from verl.models.loader import load_causal_lm
from verl.models.lora import apply_lora
from verl.models.packed_linear import packed_weights, use_packed_linear
from verl.models.token_log_probs import BLOCK_ROWS, token_log_probs
from verl.workers.forward import _decoder_and_head, response_log_probs


def plain(hidden: torch.Tensor, head: nn.Linear, tokens: torch.Tensor, temperature: float):
    log_probs_all = F.log_softmax(head(hidden) / temperature, dim=-1)
    return log_probs_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), entropy_from_log_probs(log_probs_all)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("rows", [5, BLOCK_ROWS + 13])  # one partial block; two blocks, the last cut mid-chunk
def test_values_and_gradients_equal_the_plain_computation(rows, temperature):
    torch.manual_seed(0)
    head = nn.Linear(24, 300, bias=True)
    with torch.no_grad():
        head.weight.mul_(8.0)  # logits spread over ~+-40: probabilities down to underflow, as a real model's
    hidden = torch.randn(rows, 24, requires_grad=True)
    tokens = torch.randint(0, 300, (rows,))
    log_probs, entropy = token_log_probs(hidden, head, tokens, temperature)
    assert not entropy.requires_grad  # a metric: callers needing its gradient take the plain path
    twin = hidden.detach().clone().requires_grad_(True)
    expected, expected_entropy = plain(twin, head, tokens, temperature)
    torch.testing.assert_close(log_probs, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, expected_entropy, atol=1e-5, rtol=1e-5)
    upstream = torch.randn(rows)
    (log_probs * upstream).sum().backward()
    fused_grads = [hidden.grad, head.weight.grad.clone(), head.bias.grad.clone()]
    head.zero_grad()
    (expected * upstream).sum().backward()
    for got, want in zip(fused_grads, [twin.grad, head.weight.grad, head.bias.grad], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_a_frozen_head_multiplies_by_its_packed_copies_both_ways():
    torch.manual_seed(1)
    head = nn.Linear(24, 300, bias=False).requires_grad_(False)
    assert use_packed_linear(head) == 1
    hidden = torch.randn(2, 9, 24, requires_grad=True)  # (batch, positions, hidden) like the forward's states
    tokens = torch.randint(0, 300, (2, 9))
    with packed_weights(gradients=True):
        log_probs, _ = token_log_probs(hidden, head, tokens, 0.5)
        log_probs.sum().backward()
    assert head._verl_packed.packed is not None and head._verl_packed.packed_t is not None
    twin = hidden.detach().clone().requires_grad_(True)
    expected, _ = plain(twin, head, tokens, 0.5)
    expected.sum().backward()
    assert log_probs.shape == (2, 9)
    torch.testing.assert_close(log_probs, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden.grad, twin.grad, atol=1e-5, rtol=1e-4)


def grouped_batch(model, groups: int = 2, group: int = 3, prompt_len: int = 6, width: int = 5):
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = torch.randint(3, vocab, (groups, prompt_len), generator=generator).repeat_interleave(group, 0)
    responses = torch.randint(3, vocab, (groups * group, width), generator=generator)
    ids = torch.cat([prompts, responses], 1)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "prompts": prompts, "responses": responses,
            "position_ids": torch.arange(ids.shape[1]).expand(ids.shape[0], -1)}


@pytest.mark.parametrize("group_size", [1, 3])  # plain forward and shared-prefix forward
def test_lora_forward_and_gradients_match_the_logits_path(group_size, monkeypatch):
    model = apply_lora(load_causal_lm("builtin:tiny-arith"), LoraConfig(rank=4, alpha=8))
    for name, parameter in model.named_parameters():
        if "lora_B" in name:  # B starts at zero; make the adapters matter
            torch.nn.init.normal_(parameter, std=0.05)
    assert _decoder_and_head(model) is not None
    batch = grouped_batch(model)
    results = []
    for fused in ("1", "0"):
        monkeypatch.setenv("VERL_FUSED_LOG_PROBS", fused)
        model.zero_grad()
        with packed_weights(gradients=True):
            log_probs, entropy = response_log_probs(model, batch, 0.7, with_entropy=True, group_size=group_size,
                                                    entropy_grad=False)
            (log_probs * torch.linspace(-1, 1, log_probs.numel()).view_as(log_probs)).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        results.append((log_probs.detach(), entropy, grads))
    (fused_lp, fused_entropy, fused_grads), (plain_lp, plain_entropy, plain_grads) = results
    assert fused_lp.shape == batch["responses"].shape
    torch.testing.assert_close(fused_lp, plain_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused_entropy, plain_entropy, atol=1e-5, rtol=1e-5)
    assert fused_grads.keys() == plain_grads.keys()
    for name, grad in fused_grads.items():
        torch.testing.assert_close(grad, plain_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_models_outside_the_known_families_keep_the_logits_path():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50, n_positions=32,
                                      bos_token_id=0, eos_token_id=0)).eval()
    assert _decoder_and_head(gpt2) is None  # its forward is not known to be exactly lm_head(hidden states)
    batch = grouped_batch(gpt2, group=1)
    log_probs, _ = response_log_probs(gpt2, batch)
    logits = gpt2(input_ids=batch["input_ids"]).logits[:, -6:-1]
    torch.testing.assert_close(log_probs, F.log_softmax(logits, -1).gather(-1, batch["responses"].unsqueeze(-1))
                               .squeeze(-1), atol=1e-5, rtol=1e-5)

"""Packed sequences (model.use_remove_padding, verl/models/packed_sequences.py): no padded position is computed, and
the log-probs and losses are the padded path's bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.test_trainer import tiny_config, update_ready_batch
from verl.batch import TrainBatch
from verl.config import LoraConfig, load_config
from verl.models.attention import use_cpu_attention
from verl.models.loader import load_causal_lm
from verl.models.lora import apply_lora
from verl.models.packed_linear import packed_weights
from verl.models.packed_sequences import pack_batch
from verl.trainer.local import LocalPPOTrainer
from verl.workers.actor import Actor
from verl.workers.forward import response_log_probs, shared_prefix_group_size


def padded_batch(vocab: int, prompt_lengths: list[int], response_lengths: list[int], group: int, seed: int = 0):
    """A rollout-shaped batch: ``len(prompt_lengths)`` prompts left-padded, each with ``group`` responses
    right-padded to the longest (``response_lengths`` per row), position ids as the rollout builds them."""
    generator = torch.Generator().manual_seed(seed)
    width_p, width_r = max(prompt_lengths), max(response_lengths)
    prompts = torch.zeros(len(prompt_lengths), width_p, dtype=torch.long)
    for i, length in enumerate(prompt_lengths):
        prompts[i, width_p - length :] = torch.randint(3, vocab, (length,), generator=generator)
    prompts = prompts.repeat_interleave(group, 0)
    prompt_mask = (prompts != 0).long()
    response_mask = (torch.arange(width_r) < torch.tensor(response_lengths).unsqueeze(1)).long()
    responses = torch.randint(3, vocab, (len(response_lengths), width_r), generator=generator) * response_mask
    mask = torch.cat([prompt_mask, response_mask], 1)
    return {"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0) * mask,
            "response_mask": response_mask}


def lora_model(model):
    torch.manual_seed(0)
    model = apply_lora(model, LoraConfig(rank=4, alpha=8))
    for name, parameter in model.named_parameters():
        if "lora_B" in name:  # B starts at zero; make the adapters matter
            torch.nn.init.normal_(parameter, std=0.05)
    return model


def grouped_query_llama():
    """A small Llama with grouped K/V heads (as SmolLM2, Qwen): attention through verl's copy-free GQA sdpa."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         attn_implementation="sdpa")
    model = LlamaForCausalLM(config).eval()
    assert use_cpu_attention(model)
    return model


def log_probs_and_grads(model, batch, remove_padding: bool, group: int, with_entropy_grad: bool = False):
    model.zero_grad()
    with packed_weights(gradients=True):
        log_probs, entropy = response_log_probs(model, batch, 0.7, with_entropy=True, group_size=group,
                                                entropy_grad=with_entropy_grad, remove_padding=remove_padding)
        mask = batch["response_mask"]
        loss = (log_probs * mask).sum() / mask.sum()
        if with_entropy_grad:
            loss = loss - 0.01 * (entropy * mask).sum() / mask.sum()
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return log_probs.detach() * mask, (entropy.detach() * mask), loss.detach(), grads


@pytest.mark.parametrize("model_name", ["tiny", "gqa"])
@pytest.mark.parametrize("group", [1, 3])  # plain layout; shared prompt per group
def test_packed_log_probs_and_loss_equal_the_padded_path_bit_for_bit(model_name, group):
    model = lora_model(load_causal_lm("builtin:tiny-arith") if model_name == "tiny" else grouped_query_llama())
    vocab = model.config.vocab_size
    # Prompts of three lengths (left padding), responses of lengths 1 .. 9 (one row a single token, one empty).
    batch = padded_batch(vocab, [11, 7, 9], [9, 4, 1, 6, 0, 8, 9, 2, 5][: 3 * group], group)
    assert shared_prefix_group_size(batch, group) == group
    padded = log_probs_and_grads(model, batch, False, group)
    packed = log_probs_and_grads(model, batch, True, group)
    assert torch.equal(packed[0], padded[0])  # every real token's log-prob, bit for bit
    assert torch.equal(packed[1], padded[1])  # and entropy
    assert torch.equal(packed[2], padded[2])  # so the loss
    for name, grad in packed[3].items():  # gradients sum the same terms in another order: rounding only
        assert (grad - padded[3][name]).abs().max() <= 1e-5 * padded[3][name].abs().max(), name


@pytest.mark.parametrize("group", [1, 3])
def test_logits_path_with_an_entropy_gradient_agrees_to_rounding(group):
    """With an entropy bonus the log-probs come from full logits; the padded shared-prefix path then multiplies the
    prompts' last states by the LM head in a product of one row per group, which MKL rounds differently from the
    same rows inside a larger product: equal to float rounding, not bit for bit."""
    model = lora_model(grouped_query_llama())
    batch = padded_batch(model.config.vocab_size, [11, 7, 9], [9, 4, 1, 6, 0, 8, 9, 2, 5][: 3 * group], group)
    padded = log_probs_and_grads(model, batch, False, group, with_entropy_grad=True)
    packed = log_probs_and_grads(model, batch, True, group, with_entropy_grad=True)
    for got, want in zip(packed[:3], padded[:3], strict=True):
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-6)
    for name, grad in packed[3].items():
        assert (grad - padded[3][name]).abs().max() <= 1e-5 * padded[3][name].abs().max(), name


def test_no_padded_position_is_computed():
    model = load_causal_lm("builtin:tiny-arith")
    batch = padded_batch(model.config.vocab_size, [11, 7], [9, 4, 1, 6], group=2)
    packed = pack_batch(batch, group_size=2)
    # Each prompt once (11 + 7), each response's inputs (its tokens but the last): 8 + 3 + 0 + 5.
    assert packed.num_tokens == 11 + 7 + 8 + 3 + 0 + 5
    assert packed.predictors.numel() == 9 + 4 + 1 + 6  # one prediction per real response token
    rows_seen = []
    hook = model.model.layers[0].mlp.down_proj.register_forward_hook(
        lambda module, inputs, output: rows_seen.append(inputs[0].shape[:-1].numel()))
    with torch.no_grad():
        response_log_probs(model, batch, group_size=2, remove_padding=True)
        response_log_probs(model, batch, group_size=2, remove_padding=False)
    hook.remove()
    assert rows_seen[0] == packed.num_tokens
    padded_rows = sum(rows_seen[1:])  # the shared-prefix path: prompts (2 x 11), then responses (4 x 8)
    assert padded_rows == 2 * 11 + 4 * 8 > packed.num_tokens


def test_batches_it_cannot_pack_take_the_padded_path():
    batch = padded_batch(50, [5, 3], [2, 3], group=1)
    right_padded_prompts = dict(batch)
    right_padded_prompts["attention_mask"] = batch["attention_mask"].clone()
    right_padded_prompts["attention_mask"][1, :5] = torch.tensor([1, 1, 1, 0, 0])
    assert pack_batch(right_padded_prompts) is None
    holes = dict(batch)
    holes["attention_mask"] = batch["attention_mask"].clone()
    holes["attention_mask"][0, 5] = 0  # a masked token inside a response
    assert pack_batch(holes) is None
    assert pack_batch(batch) is not None
    model = load_causal_lm("builtin:tiny-arith")
    with torch.no_grad():  # and the forward still answers, padded
        log_probs, _ = response_log_probs(model, holes | {"responses": holes["responses"]}, remove_padding=True)
    assert log_probs.shape == (2, 3)


@pytest.mark.parametrize("entropy_coeff", [0.0, 0.01])
def test_actor_update_metrics_equal_with_and_without_padding(tmp_path, entropy_coeff):
    """The trainer's own update on a real rollout (tiny model, groups of 2, KL loss): every loss term it logs is
    the padded path's exactly, and the weights after the step agree to rounding."""
    trainer = LocalPPOTrainer(tiny_config(tmp_path, actor={"use_kl_loss": True, "entropy_coeff": entropy_coeff}),
                              quiet=True)
    batch = update_ready_batch(trainer)
    assert pack_batch(dict(batch.batch), 2) is not None  # the rollout's own padding packs
    cfg = trainer.config
    actor_cfg = cfg.actor.model_copy(update={"optim": cfg.actor.optim.model_copy(update={"eps": 1e-4})})
    actors = [Actor(copy.deepcopy(trainer.model), actor_cfg, 1, 1.0, cfg.data.max_response_length, group_size=2,
                    remove_padding=flag) for flag in (False, True)]
    padded, packed = (actor.update_policy(TrainBatch.from_proto(batch), len(batch)) for actor in actors)
    assert {"policy_loss", "kl_loss", "kl_div", "entropy"} <= padded.keys()
    for key in padded.keys() - {"lr", "grad_norm", "nan_skipped", "nan_skipped_total"}:
        if entropy_coeff == 0.0:  # the fused log-prob path: bit for bit
            assert packed[key] == padded[key], key
        elif key.startswith(("sampling/", "rollout_corr/")):  # built from |trainer - rollout| log-prob gaps (near 0):
            # to the log-probs' own 2e-6 above
            assert packed[key] == pytest.approx(padded[key], abs=2e-6), key
        else:  # an entropy bonus takes the logits path: to rounding (see the test above)
            assert packed[key] == pytest.approx(padded[key], rel=1e-6, abs=1e-7), key
    for a, b in zip(actors[0].model.parameters(), actors[1].model.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_packing_is_the_default_and_verls_key_turns_it_off():
    assert load_config(None, []).model.use_remove_padding
    assert not load_config(None, ["actor_rollout_ref.model.use_remove_padding=False"]).model.use_remove_padding


def test_gradient_checkpointing_keeps_the_padded_path():
    """Checkpointed layers run again during the backward, outside the packed forward's attention switch: such a
    model must not be packed."""
    model = load_causal_lm("builtin:tiny-arith")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    batch = padded_batch(model.config.vocab_size, [11, 7], [9, 4, 1, 6], group=2)
    rows_seen = []
    hook = model.model.layers[0].mlp.down_proj.register_forward_hook(
        lambda module, inputs, output: rows_seen.append(inputs[0].shape[:-1].numel()))
    log_probs, _ = response_log_probs(model, batch, group_size=2, remove_padding=True)
    (log_probs * batch["response_mask"]).sum().backward()
    hook.remove()
    assert rows_seen[0] == 4 * (11 + 9)  # whole padded rows, forward (and again in the backward)

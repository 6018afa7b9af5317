"""Forward passes shared by actor, reference and critic: per-token log-probs, entropy and values.

Two things are never computed:

- the prompt's logits: only the last ``response_len + 1`` positions go through the LM head (``logits_to_keep``);
- the same prompt ``n`` times: GRPO-style batches hold each prompt's ``n`` responses side by side, so the prompt
  is run once per group, its KV cache is repeated ``n`` times, and only the response tokens are run per sample
  ("shared prefix"). Gradients flow through the repeated cache, so the update is exactly the plain one; for
  a prompt of ~20 tokens and responses of ~8 this does ~2.5x less work per forward and backward.

and for the model families whose logits are exactly ``lm_head(last hidden state)`` (``FUSED_HEAD_MODEL_TYPES``),
no ``(tokens, vocabulary)`` logits tensor is built either: the decoder's hidden states go to
``verl.models.token_log_probs`` (LM head, log-softmax and entropy a block of rows at a time, in cache).
``VERL_FUSED_LOG_PROBS=0`` turns that off.

With ``remove_padding=True`` (``model.use_remove_padding``, on by default) no padded position is computed either:
the batch's real tokens run as one packed row, each prompt once per group, attention per prompt-and-responses tree
(``verl.models.packed_sequences``); batches it cannot pack (not left/right padded) take the padded path.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from verl.algos.losses import entropy_from_log_probs
from verl.models.packed_sequences import PackedBatch, pack_batch, packable, packed_attention
from verl.models.precision import at_least_float32, autocast_context
from verl.models.token_log_probs import token_log_probs

# CausalLM classes whose forward computes ``logits = lm_head(hidden_states)`` and nothing more (no soft-capping,
# no logit scale): the fused path gives their log-probs to rounding.
FUSED_HEAD_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


def response_log_probs(model: torch.nn.Module, batch: dict[str, torch.Tensor], temperature: float = 1.0,
                       with_entropy: bool = False, autocast_dtype: torch.dtype | None = None, group_size: int = 1,
                       entropy_grad: bool = True,
                       remove_padding: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``responses`` under ``model`` at ``temperature``: ``(batch, response_len)`` (+ entropy).

    ``batch`` holds ``input_ids``/``attention_mask``/``position_ids`` ``(batch, prompt_len + response_len)`` and
    ``responses`` ``(batch, response_len)``. Logits are divided by the sampling temperature so the log-probs are
    those of the distribution the rollout sampled from. ``group_size`` > 1 enables the shared-prefix path when
    the batch really is grouped (checked, else the plain path runs). ``entropy_grad=False``: the entropy is a
    metric only, computed outside the autograd graph. ``remove_padding``: run the real tokens packed (see the
    module docstring); values at pad positions are then 0 instead of whatever the pad token predicted.
    """
    responses = batch["responses"]
    device = responses.device
    # Activation checkpointing turns the KV cache off inside HF models; use the plain path there.
    checkpointing = getattr(model, "is_gradient_checkpointing", False)
    group = 1 if checkpointing else shared_prefix_group_size(batch, group_size)
    parts = _decoder_and_head(model) if autocast_dtype is None and not (with_entropy and entropy_grad) else None
    use_packed = remove_padding and not checkpointing and packable(model, batch["input_ids"].shape[1])
    packed = pack_batch(batch, group) if use_packed else None
    if packed is not None:
        return _packed_log_probs(model, packed, parts, temperature, with_entropy, autocast_dtype, entropy_grad)
    if parts is not None:
        decoder, head = parts
        hidden = _response_states(model, batch, group, decoder)  # (batch, response_len, hidden)
        log_probs, entropy = token_log_probs(hidden, head, responses, temperature)
        return log_probs, entropy if with_entropy else None
    with autocast_context(device, autocast_dtype):
        logits = _response_states(model, batch, group)  # (batch, response_len, vocab)
    return _log_probs_from_logits(logits, responses, temperature, with_entropy, entropy_grad)


def _log_probs_from_logits(logits: torch.Tensor, tokens: torch.Tensor, temperature: float, with_entropy: bool,
                           entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``tokens`` ``(...)`` under ``logits`` ``(..., vocab)`` at ``temperature`` (+ entropy ``(...)``)."""
    logits = at_least_float32(logits)
    if temperature != 1.0:
        logits = logits / temperature
    log_probs_all = F.log_softmax(logits, dim=-1)
    log_probs = torch.gather(log_probs_all, -1, tokens.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        # From the log-softmax above (one exp over the vocabulary, not a softmax and a logsumexp), and outside the
        # graph when only logged, so the update keeps no vocabulary-sized tensors alive for it.
        with contextlib.nullcontext() if entropy_grad else torch.no_grad():
            entropy = entropy_from_log_probs(log_probs_all)
    return log_probs, entropy


def _packed_log_probs(model: torch.nn.Module, packed: PackedBatch, parts: tuple[torch.nn.Module, nn.Linear] | None,
                      temperature: float, with_entropy: bool, autocast_dtype: torch.dtype | None,
                      entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``response_log_probs`` over a packed row: ``(batch, response_len)`` log-probs (+ entropy), 0 at pads."""
    if parts is not None:
        decoder, head = parts
        with packed_attention(model):
            hidden = decoder(**packed.model_inputs()).last_hidden_state[0, packed.predictors]  # (N, hidden)
        log_probs, entropy = token_log_probs(hidden, head, packed.targets, temperature)
        return packed.unpack(log_probs), packed.unpack(entropy) if with_entropy else None
    with autocast_context(packed.input_ids.device, autocast_dtype), packed_attention(model):
        logits = model(**packed.model_inputs(), logits_to_keep=packed.predictors).logits[0]  # (N, vocab)
    log_probs, entropy = _log_probs_from_logits(logits, packed.targets, temperature, with_entropy, entropy_grad)
    return packed.unpack(log_probs), packed.unpack(entropy) if entropy is not None else None


def _decoder_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, nn.Linear] | None:
    """The decoder (hidden states) and LM head of a model the fused log-prob path serves, else None."""
    if os.environ.get("VERL_FUSED_LOG_PROBS", "1") == "0":
        return None
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in FUSED_HEAD_MODEL_TYPES:
        return None
    get_decoder, get_head = getattr(model, "get_decoder", None), getattr(model, "get_output_embeddings", None)
    if get_decoder is None or get_head is None:
        return None
    decoder, head = get_decoder(), get_head()
    if decoder is None or type(head) is not nn.Linear:  # e.g. a LoRA-wrapped head: leave it to the model
        return None
    if isinstance(head.weight.data, DTensor):  # FSDP: only the root module's forward gathers the shards
        return None
    return decoder, head


def _response_states(model: torch.nn.Module, batch: dict[str, torch.Tensor], group: int,
                     decoder: torch.nn.Module | None = None) -> torch.Tensor:
    """What predicts each response token: the logits ``(batch, response_len, vocab)``, or with ``decoder`` (the
    model's decoder stack) its last hidden states ``(batch, response_len, hidden)``."""
    width = batch["responses"].shape[1]
    if group > 1:
        return _shared_prefix_states(model, batch, group, decoder)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
              "position_ids": batch["position_ids"], "use_cache": False}
    if decoder is not None:
        return decoder(**inputs).last_hidden_state[:, -width - 1 : -1, :]
    return model(**inputs, logits_to_keep=width + 1).logits[:, -width - 1 : -1, :]


def shared_prefix_group_size(batch: dict[str, torch.Tensor], group_size: int) -> int:
    """``group_size`` if rows come in runs of ``group_size`` identical prompts, else 1 (use the plain path)."""
    prompts = batch.get("prompts")
    rows = batch["responses"].shape[0]
    if group_size <= 1 or prompts is None or rows % group_size or prompts.shape[1] == 0:
        return 1
    firsts = prompts[::group_size]
    if not torch.equal(firsts.repeat_interleave(group_size, dim=0), prompts):
        return 1
    # The prompt's last column must be a real token for every group (left padding), or the first response
    # token would be predicted from a pad position.
    if not bool(batch["attention_mask"][::group_size, prompts.shape[1] - 1].all()):
        return 1
    return group_size


def _shared_prefix_states(model: torch.nn.Module, batch: dict[str, torch.Tensor], group: int,
                          decoder: torch.nn.Module | None = None) -> torch.Tensor:
    """``_response_states`` with prompts run once per group and responses per sample."""
    prompt_len = batch["prompts"].shape[1]
    width = batch["responses"].shape[1]
    mask, positions = batch["attention_mask"], batch["position_ids"]
    if decoder is not None:
        call, last = decoder, (lambda out: out.last_hidden_state)
        prefix_extra = {}
    else:
        call, last = model, (lambda out: out.logits)
        # The last position as an index tensor, not ``1``: the slice ``[:, -1:]`` is a strided view that sends the
        # LM head down a batched product with the weight broadcast per row (~6 GFLOP/s on CPU, ~70 ms at 49k
        # vocabulary); the indexed copy is contiguous and takes one GEMM.
        prefix_extra = {"logits_to_keep": torch.tensor([prompt_len - 1], device=mask.device)}
    prefix = call(input_ids=batch["prompts"][::group], attention_mask=mask[::group, :prompt_len],
                  position_ids=positions[::group, :prompt_len], use_cache=True, **prefix_extra)
    cache = prefix.past_key_values
    cache.batch_repeat_interleave(group)  # differentiable: each sample's gradient flows into the shared prompt
    first = last(prefix)[:, -1:, :].repeat_interleave(group, dim=0)  # predicts response token 0
    if width == 1:
        return first
    rest = call(input_ids=batch["responses"][:, :-1], attention_mask=mask[:, : prompt_len + width - 1],
                position_ids=positions[:, prompt_len : prompt_len + width - 1], past_key_values=cache, use_cache=True)
    return torch.cat([first, last(rest)], dim=1)


def response_values(critic: torch.nn.Module, batch: dict[str, torch.Tensor],
                    autocast_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Critic values ``(batch, response_len)``: V at the state before each response token."""
    width = batch["responses"].shape[1]
    with autocast_context(batch["responses"].device, autocast_dtype):
        out = critic(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     position_ids=batch["position_ids"], use_cache=False)
    return at_least_float32(out.logits[:, -width - 1 : -1, 0])

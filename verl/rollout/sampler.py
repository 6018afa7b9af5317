"""A lean sampling loop with a shared prompt prefill: prompts are run once, their KV cache repeated ``n`` times.

``transformers``' ``generate(num_return_sequences=n)`` repeats the prompts *before* the prefill, so the prompt
is computed ``n`` times; with ``n = 8`` and short answers the prefill is most of the rollout's compute. This loop
prefills each prompt once, repeats the cache, then decodes all ``batch * n`` sequences together with
transformers' own logits warpers (temperature, top-k, top-p). Greedy output equals ``generate``'s token for
token (tested).

Sampling draws from private generators, one per prompt, seeded from (call seed, prompt id): a prompt's samples
do not depend on which other prompts share the batch, so splitting a batch across data-parallel workers or
micro-batches gives exactly the same rollouts (and the global RNG is untouched).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
from transformers.cache_utils import DynamicLayer

from verl.models.kv_cache import GrowingLayer, growing_cache_from
from verl.models.packed_linear import packed_weights
from verl.rollout.base import SamplingParams


def supports_shared_prefill(model: torch.nn.Module) -> bool:
    """Dynamic-cache decoder models whose cache can be repeated along the batch."""
    config = getattr(model, "config", None)
    return bool(config is not None and getattr(config, "is_encoder_decoder", False) is False
                and hasattr(model, "prepare_inputs_for_generation"))


DROP_FINISHED_ROWS = True  # tests turn it off to compare with the batch that keeps every row to the end


def draw_categorical(probs: torch.Tensor, generator: torch.Generator | None = None,
                     uniform: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of ``probs`` ``(rows, vocab)`` (non-negative, need not sum to one): ``(rows,)`` int64.

    Inverse-CDF sampling: a float64 cumulative sum, one uniform draw per row (from ``generator``, or given as
    ``uniform`` ``(rows, 1)`` float64), a binary search. ``torch.multinomial`` draws one exponential variate per
    vocabulary entry instead (on CPU ~15 ms for 16 rows of 49,152, ~10% of a SmolLM2 decode step); this takes
    < 1 ms and samples the same distribution. A zero-probability entry is never drawn. Rows that are not a
    distribution (NaN, inf, all zero) raise ``ValueError``, as ``torch.multinomial`` does.
    """
    cdf = probs.to(torch.float64).cumsum(-1)
    total = cdf[:, -1:]
    if not bool(torch.isfinite(total).all()) or bool((total <= 0).any()) or bool((probs < 0).any()):
        raise ValueError("probability tensor contains either inf, nan or element < 0, or sums to zero")
    if uniform is None:
        uniform = torch.rand(probs.shape[0], 1, generator=generator, dtype=torch.float64, device=probs.device)
    # Strictly below the total, so the search always lands on an entry with positive probability.
    target = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(-1)


def _warpers(params: SamplingParams) -> LogitsProcessorList:
    warpers = LogitsProcessorList()
    if params.greedy:
        return warpers
    if params.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(params.top_p))
    return warpers


@torch.no_grad()
@packed_weights()  # frozen linear layers multiply by oneDNN-packed weights (verl/models/packed_linear.py)
def sample_with_shared_prefill(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    params: SamplingParams,
    eos_token_id: int,
    pad_token_id: int,
    prompt_seeds: list[int] | None = None,
    stop_when: Callable[[bool], bool] | None = None,
    log_probs_out: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Generate ``(batch * n, <= max_new_tokens)`` token ids for left-padded prompts ``(batch, prompt_len)``.

    Rows ``i*n .. i*n+n-1`` are prompt ``i``'s samples. Tokens after a row's eos are ``pad_token_id``.
    ``prompt_seeds`` (one per prompt) make each prompt's samples independent of the rest of the batch.
    ``stop_when(all_local_rows_finished)`` decides early stopping; sharded (FSDP) models pass an all-reduce so
    every rank runs the same number of forward passes.

    ``log_probs_out``: when given, the behaviour policy's log-prob of each drawn token is appended to it as one
    ``(batch * n, gen_len)`` tensor: ``log_softmax(logits / temperature)`` at the token, the distribution the actor's
    ``compute_log_prob`` scores (temperature only; top-k/top-p truncation is not part of it). One-step off-policy
    training uses them as ``old_log_probs``, so no extra forward pass is needed to correct for staleness.
    """
    n = params.n
    device = input_ids.device
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=True,
                logits_to_keep=1)
    cache = out.past_key_values
    logits = out.logits[:, -1, :].float()
    if n > 1:
        cache.batch_repeat_interleave(n)
        logits = logits.repeat_interleave(n, dim=0)
        attention_mask = attention_mask.repeat_interleave(n, dim=0)
        positions = positions.repeat_interleave(n, dim=0)
    if all(type(layer) is DynamicLayer for layer in getattr(cache, "layers", [None])):
        # Decode into preallocated columns: DynamicLayer would copy the whole cache (torch.cat) at every step.
        cache = growing_cache_from(cache, headroom=params.max_new_tokens)
    rows = logits.shape[0]
    next_position = positions[:, -1:] + 1
    generators: list[torch.Generator] = []
    if not params.greedy:
        base = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
        seeds = prompt_seeds if prompt_seeds is not None else [base]
        for seed in seeds:
            generators.append(torch.Generator(device=device))
            generators[-1].manual_seed((base * 1_000_003 + int(seed)) % 2**63 if prompt_seeds is not None else base)
    warpers = _warpers(params)
    finished = torch.zeros(rows, dtype=torch.bool, device=device)
    # Rows still in the batch (original row ids): finished rows leave the KV cache once a quarter of the batch has
    # finished, so later steps compute only what is still generating (vLLM drops them too). Every row's uniform
    # draw is still taken at every step, so dropping rows never changes what the others sample.
    alive = torch.arange(rows, device=device)
    compactable = DROP_FINISHED_ROWS and bool(cache.layers) and all(isinstance(layer, GrowingLayer)
                                                                     for layer in cache.layers)
    tokens: list[torch.Tensor] = []
    token_log_probs: list[torch.Tensor] = []
    temperature = 1.0 if params.greedy else params.temperature
    generated = torch.empty((rows, 0), dtype=torch.long, device=device)
    for step in range(params.max_new_tokens):
        if params.greedy:
            drawn = logits.argmax(-1)
        else:
            scores = warpers(generated[alive], logits) if warpers else logits
            probs = torch.softmax(scores, dim=-1)
            per_prompt = n if len(generators) > 1 else rows  # one generator per prompt draws that prompt's n rows
            uniform = torch.cat([torch.rand(per_prompt, 1, generator=gen, dtype=torch.float64, device=device)
                                 for gen in generators])
            drawn = draw_categorical(probs, uniform=uniform[alive])
        token = torch.full((rows,), pad_token_id, dtype=torch.long, device=device)
        token[alive] = drawn
        token = token.masked_fill(finished, pad_token_id)
        if log_probs_out is not None:  # (rows,): one log_softmax over the vocabulary per step, as the actor scores it
            chosen = torch.log_softmax(logits / temperature if temperature != 1.0 else logits, dim=-1)
            step_log_probs = torch.zeros(rows, device=device)
            step_log_probs[alive] = chosen.gather(-1, drawn.unsqueeze(-1)).squeeze(-1)
            token_log_probs.append(step_log_probs.masked_fill(finished, 0.0))
        tokens.append(token)
        finished |= token == eos_token_id
        done = bool(finished.all())
        if stop_when is not None:
            done = stop_when(done)
        if done or step == params.max_new_tokens - 1:
            break
        if warpers:
            generated = torch.stack(tokens, dim=1)
        leaving = finished[alive]
        if compactable and int(leaving.sum()) >= max(1, len(alive) // 4) and not bool(leaving.all()):
            keep = (~leaving).nonzero().squeeze(-1)
            cache.batch_select_indices(keep)
            attention_mask, next_position, alive = attention_mask[keep], next_position[keep], alive[keep]
        attention_mask = torch.cat([attention_mask, torch.ones((len(alive), 1), dtype=attention_mask.dtype,
                                                               device=device)], dim=1)
        out = model(input_ids=token[alive].unsqueeze(-1), attention_mask=attention_mask,
                    position_ids=next_position, past_key_values=cache, use_cache=True)
        next_position = next_position + 1
        logits = out.logits[:, -1, :].float()
    if log_probs_out is not None:
        log_probs_out.append(torch.stack(token_log_probs, dim=1) if token_log_probs
                             else torch.empty((rows, 0), device=device))
    return torch.stack(tokens, dim=1) if tokens else torch.empty((rows, 0), dtype=torch.long, device=device)

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

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
from transformers.cache_utils import DynamicLayer

from verl.models.fused_decoder import fused_decoder_layers
from verl.models.kv_cache import GrowingLayer, growing_cache_from
from verl.models.packed_linear import packed_weights
from verl.models.precision import at_least_float32
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
    # One check, one sync: a positive finite total (NaN fails both comparisons) and no negative entry.
    if not bool(((total > 0) & (total < math.inf)).all() & (probs.min() >= 0)):
        raise ValueError("probability tensor contains either inf, nan or element < 0, or sums to zero")
    if uniform is None:
        uniform = torch.rand(probs.shape[0], 1, generator=generator, dtype=torch.float64, device=probs.device)
    # Strictly below the total, so the search always lands on an entry with positive probability.
    target = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(-1)


def logits_warpers(params: SamplingParams) -> LogitsProcessorList:
    """Temperature, top-k and top-p as transformers' warpers (none for greedy decoding)."""
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


@dataclass
class Sampled:
    """What the loop returns: ``tokens`` ``(batch * n, gen_len)`` (pad after a row's eos) and, when asked for,
    ``log_probs`` ``(batch * n, gen_len)``: the behaviour policy's log-prob of each drawn token (0 after eos)."""

    tokens: torch.Tensor
    log_probs: torch.Tensor | None = None


@dataclass
class DecodeState:
    """The rows still generating: their KV cache, attention mask ``(alive, seq)``, next position ``(alive, 1)``,
    next-token logits ``(alive, vocab)``, and ``alive`` ``(alive,)``: their ids among all ``rows = batch * n``.

    Finished rows leave the state (and the cache) once a quarter of those left have finished, so later steps
    compute only what is still generating (vLLM drops them too)."""

    cache: Any
    attention_mask: torch.Tensor
    next_position: torch.Tensor
    logits: torch.Tensor
    alive: torch.Tensor
    rows: int


@torch.no_grad()
@packed_weights(trainable=True)  # linear layers multiply by oneDNN-packed weights (verl/models/packed_linear.py)
@fused_decoder_layers()  # decoder layers' norms, RoPE and SiLU fused (verl/models/fused_decoder.py)
def sample_with_shared_prefill(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                               params: SamplingParams, eos_token_id: int, pad_token_id: int,
                               prompt_seeds: list[int] | None = None, stop_when: Callable[[bool], bool] | None = None,
                               with_log_probs: bool = False) -> Sampled:
    """Generate up to ``max_new_tokens`` for left-padded prompts ``input_ids`` and ``attention_mask``, both
    ``(batch, prompt_len)``: prefill once, then draw and decode one token per step for the rows still alive.

    Rows ``i*n .. i*n+n-1`` are prompt ``i``'s samples. ``prompt_seeds`` (one per prompt) make each prompt's samples
    independent of the rest of the batch. ``stop_when(all_local_rows_finished)`` decides early stopping; sharded
    (FSDP) models pass an all-reduce so every rank runs the same number of forward passes.

    ``with_log_probs``: also return each drawn token's ``log_softmax(logits / temperature)``, the distribution the
    actor's ``compute_log_prob`` scores (temperature only; top-k/top-p truncation is not part of it). One-step
    off-policy training uses them as ``old_log_probs``, so no extra forward pass is needed to correct for staleness.
    """
    state = prefill(model, input_ids, attention_mask, params.n, params.max_new_tokens)
    rows = state.rows
    generators = sampling_generators(params, prompt_seeds, input_ids.device)
    warpers = logits_warpers(params)
    compactable = DROP_FINISHED_ROWS and bool(state.cache.layers) and all(
        isinstance(layer, GrowingLayer) for layer in state.cache.layers)
    finished = torch.zeros(rows, dtype=torch.bool, device=input_ids.device)
    tokens: list[torch.Tensor] = []
    token_log_probs: list[torch.Tensor] = []
    for step in range(params.max_new_tokens):
        history = _history(tokens, state.alive) if warpers else None
        drawn = draw_next(state, history, params, warpers, generators)
        token = torch.full((rows,), pad_token_id, dtype=torch.long, device=finished.device)
        token[state.alive] = drawn
        token = token.masked_fill(finished, pad_token_id)
        if with_log_probs:
            token_log_probs.append(behaviour_log_probs(state, drawn, params).masked_fill(finished, 0.0))
        tokens.append(token)
        finished |= token == eos_token_id
        done = stop_when(bool(finished.all())) if stop_when is not None else bool(finished.all())
        if done or step == params.max_new_tokens - 1:
            break
        leaving = finished[state.alive]
        if compactable and int(leaving.sum()) >= max(1, len(state.alive) // 4) and not bool(leaving.all()):
            drop_rows(state, keep=(~leaving).nonzero().squeeze(-1))
        decode_step(model, state, token[state.alive])
    return Sampled(stack_columns(tokens, rows, torch.long, finished.device),
                   stack_columns(token_log_probs, rows, torch.float32, finished.device) if with_log_probs else None)


def prefill(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, n: int,
            headroom: int) -> DecodeState:
    """Run the prompts ``(batch, prompt_len)`` once and repeat their cache ``n`` times: state for ``batch * n``
    rows, with ``headroom`` preallocated cache columns when the model's cache is a plain ``DynamicCache``."""
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=True,
                logits_to_keep=1)
    cache = out.past_key_values
    logits = at_least_float32(out.logits[:, -1, :])
    if n > 1:
        cache.batch_repeat_interleave(n)
        logits = logits.repeat_interleave(n, dim=0)
        attention_mask = attention_mask.repeat_interleave(n, dim=0)
        positions = positions.repeat_interleave(n, dim=0)
    if all(type(layer) is DynamicLayer for layer in getattr(cache, "layers", [None])):
        # Decode into preallocated columns: DynamicLayer would copy the whole cache (torch.cat) at every step.
        cache = growing_cache_from(cache, headroom=headroom)
    rows = logits.shape[0]
    return DecodeState(cache, attention_mask, positions[:, -1:] + 1, logits, torch.arange(rows, device=logits.device),
                       rows)


def sampling_generators(params: SamplingParams, prompt_seeds: list[int] | None,
                        device: torch.device) -> list[torch.Generator]:
    """Private generators: one per prompt (seeded from the call seed and the prompt's id) when ``prompt_seeds`` is
    given, else one for the whole batch; none for greedy decoding."""
    if params.greedy:
        return []
    base = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
    generators = []
    for seed in prompt_seeds if prompt_seeds is not None else [base]:
        generator = torch.Generator(device=device)
        generator.manual_seed((base * 1_000_003 + int(seed)) % 2**63 if prompt_seeds is not None else base)
        generators.append(generator)
    return generators


def draw_next(state: DecodeState, history: torch.Tensor | None, params: SamplingParams,
              warpers: LogitsProcessorList, generators: list[torch.Generator]) -> torch.Tensor:
    """The next token of every alive row from its logits ``(alive, vocab)``: ``(alive,)``.

    Every row's uniform is drawn at every step, alive or not, so dropping finished rows never changes what the
    others sample. ``history`` ``(alive, step)`` (the tokens so far) feeds warpers that look at it.
    """
    if params.greedy:
        return state.logits.argmax(-1)
    scores = warpers(history, state.logits) if warpers else state.logits
    rows_per_generator = params.n if len(generators) > 1 else state.rows  # a prompt's generator draws its n rows
    uniform = torch.cat([torch.rand(rows_per_generator, 1, generator=gen, dtype=torch.float64,
                                    device=state.logits.device) for gen in generators])
    return draw_categorical(torch.softmax(scores, dim=-1), uniform=uniform[state.alive])


def behaviour_log_probs(state: DecodeState, drawn: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``(rows,)``: the log-prob of each alive row's ``drawn`` token under ``log_softmax(logits / temperature)``
    (one log-softmax over the vocabulary per step, as the actor scores it); 0 for rows no longer alive."""
    temperature = 1.0 if params.greedy else params.temperature
    log_probs = torch.log_softmax(state.logits / temperature if temperature != 1.0 else state.logits, dim=-1)
    out = torch.zeros(state.rows, dtype=log_probs.dtype, device=state.logits.device)
    out[state.alive] = log_probs.gather(-1, drawn.unsqueeze(-1)).squeeze(-1)
    return out


def drop_rows(state: DecodeState, keep: torch.Tensor) -> None:
    """Keep only the alive rows at positions ``keep`` ``(kept,)``, in the cache and every per-row tensor."""
    state.cache.batch_select_indices(keep)
    state.attention_mask, state.next_position = state.attention_mask[keep], state.next_position[keep]
    state.alive = state.alive[keep]


def decode_step(model: torch.nn.Module, state: DecodeState, tokens: torch.Tensor) -> None:
    """Feed each alive row its new token ``(alive,)``: one forward pass; the state moves one position on."""
    ones = torch.ones((len(state.alive), 1), dtype=state.attention_mask.dtype, device=tokens.device)
    state.attention_mask = torch.cat([state.attention_mask, ones], dim=1)
    out = model(input_ids=tokens.unsqueeze(-1), attention_mask=state.attention_mask,
                position_ids=state.next_position, past_key_values=state.cache, use_cache=True)
    state.next_position = state.next_position + 1
    state.logits = at_least_float32(out.logits[:, -1, :])


def _history(tokens: list[torch.Tensor], alive: torch.Tensor) -> torch.Tensor:
    """The tokens drawn so far by the alive rows, ``(alive, step)`` (what history-aware warpers read)."""
    if not tokens:
        return torch.empty((len(alive), 0), dtype=torch.long, device=alive.device)
    return torch.stack(tokens, dim=1)[alive]


def stack_columns(columns: list[torch.Tensor], rows: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One ``(rows,)`` tensor per step -> ``(rows, steps)``; ``(rows, 0)`` when no step ran."""
    return torch.stack(columns, dim=1) if columns else torch.empty((rows, 0), dtype=dtype, device=device)

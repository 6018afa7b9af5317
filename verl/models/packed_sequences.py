"""Packed sequences (verl's ``use_remove_padding``): a batch's real tokens in one row, no padded position computed.

A rollout batch is padded twice: prompts on the left to the longest prompt, responses on the right to the longest
response. Every linear layer, and the LM head, multiplies those pad positions as if they were tokens. Here the
batch becomes one row of real tokens laid out as *trees*: each prompt once (a group's ``n`` responses share it, as
in the shared-prefix forward) followed by its responses, each response seeing its own prompt and its own earlier
tokens, nothing else:

    tree g:  [ prompt_g | response_g,1[:-1] | response_g,2[:-1] | ... ]     positions 0..Lp-1 | Lp.. | Lp.. | ...

The products of the decoder layers (and the LM head) run on ``(1, tokens)`` real tokens only. Attention runs in a
registered transformers attention function that the packed forward switches the model to for its duration: one
batched ``scaled_dot_product_attention`` for the prompts and one for the responses, each query's keys gathered onto
the key axis the padded forward would give it (empty slots where its padding was, the prompt's keys, the response's
own), so the kernel sums over the same positions in the same order. Attention is a small share of the work; the
padded key axis costs little and keeps the arithmetic identical. Only the states that predict a response token are
kept (``PackedBatch.predictors``), and the log-probs go back to their ``(batch, response_len)`` places (zeros at
pad positions, which every loss masks out).

    packed = pack_batch(batch, group_size)        # None when the batch cannot be packed (then pad as before)
    with packed_attention(model):
        hidden = decoder(**packed.model_inputs()).last_hidden_state[0, packed.predictors]  # (N, hidden)
    log_probs = packed.unpack(token_log_probs(hidden, head, packed.targets)[0])          # (batch, response_len)

The per-token arithmetic is the padded forward's: the row-wise layers see the same vectors, a product's row does
not depend on the other rows of a GEMM at these sizes, and attention sums over the same key slots. So log-probs,
entropies and losses equal the padded path's bit for bit, with left-padded prompts too (tests/test_packed_sequences.py);
gradients sum the same terms in another order (rounding). One exception: the full-logits path (an entropy bonus)
of the padded shared-prefix forward multiplies the prompts' last states by the LM head in a product of one row
per group, which MKL rounds differently from the same rows inside a larger product.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel

from verl.models.attention import NAME as ATTENTION_NAME

NAME = "verl_packed"
LAYOUT_KWARG = "verl_packed_layout"


@dataclass(frozen=True)
class Piece:
    """The queries of one packed span and the keys they attend to, laid out as in the padded batch.

    ``query`` is a ``[start, end)`` span of the packed row whose queries sit at ``query_at``.. on a key axis of
    ``width`` slots: ``lead`` empty slots, then the packed spans ``keys`` (a prompt, then a response), then empty
    slots, i.e. exactly the key axis the padded forward gives these queries (left padding, the response columns),
    so the attention kernel sums over the same positions and each query's output is the padded forward's bit for
    bit.
    """

    query: tuple[int, int]
    query_at: int
    keys: tuple[tuple[int, int], ...]
    lead: int
    width: int


@dataclass(frozen=True)
class AttentionGroup:
    """Pieces of one key width run as one batched attention call: ``pieces`` rows of ``queries`` padded queries
    over ``width`` keys, gathered from the packed row (index ``tokens`` = an empty slot: a zero vector).

    ``query_index`` ``(pieces * queries,)``, ``key_index`` ``(pieces * width,)``, ``mask`` ``(pieces, 1, queries,
    width)``.
    """

    query_index: torch.Tensor
    key_index: torch.Tensor
    mask: torch.Tensor
    pieces: int
    queries: int
    width: int


@dataclass(frozen=True)
class PackedBatch:
    """A padded batch's real tokens in one row, and where each response token's prediction goes back to.

    ``input_ids``/``position_ids`` ``(1, tokens)``; ``groups``: the attention calls; ``output_index`` ``(tokens,)``:
    each packed token's row in the groups' concatenated outputs; ``predictors`` ``(N,)``: the packed positions
    whose states predict the ``N`` response tokens; ``rows``/``cols`` ``(N,)``: those tokens' places in ``(batch,
    response_len)``; ``targets`` ``(N,)``: the tokens themselves.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    groups: tuple[AttentionGroup, ...]
    output_index: torch.Tensor
    predictors: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    targets: torch.Tensor
    shape: tuple[int, int]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    def model_inputs(self) -> dict:
        """Keyword arguments of a decoder / causal-LM forward over the packed row."""
        # A 4-D mask is taken as given by transformers (no (tokens, tokens) mask built); the packed attention
        # function ignores it and reads the layout instead.
        dummy_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.input_ids.device)
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, "attention_mask": dummy_mask,
                "use_cache": False, LAYOUT_KWARG: self}

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """``(N,)`` per-token values -> ``(batch, response_len)``, zeros where no response token is."""
        out = values.new_zeros(self.shape)
        return out.index_put((self.rows, self.cols), values)


def _attention_group(pieces: list[Piece], tokens: int, device: torch.device) -> AttentionGroup:
    """Batch pieces of one width: query rows padded to the longest piece; a padding query row sees the first real
    key (a finite output nobody reads, whose gradient is zero) so no row of the kernel is fully masked."""
    width = pieces[0].width
    queries = max(piece.query[1] - piece.query[0] for piece in pieces)
    query_index = torch.full((len(pieces), queries), tokens, dtype=torch.long)
    key_index = torch.full((len(pieces), width), tokens, dtype=torch.long)
    mask = torch.zeros(len(pieces), 1, queries, width, dtype=torch.bool)
    slots = torch.arange(width)
    for i, piece in enumerate(pieces):
        q0, q1 = piece.query
        query_index[i, : q1 - q0] = torch.arange(q0, q1)
        keys = torch.cat([torch.arange(start, end) for start, end in piece.keys])
        key_index[i, piece.lead : piece.lead + len(keys)] = keys
        real = (slots >= piece.lead) & (slots < piece.lead + len(keys))
        at = piece.query_at + torch.arange(q1 - q0)
        mask[i, 0, : q1 - q0] = real & (slots <= at.unsqueeze(1))
        mask[i, 0, q1 - q0 :, piece.lead] = True
    return AttentionGroup(query_index.reshape(-1).to(device), key_index.reshape(-1).to(device), mask.to(device),
                          len(pieces), queries, width)


def pack_batch(batch: dict[str, torch.Tensor], group_size: int = 1) -> PackedBatch | None:
    """The packed form of a rollout batch, or None where the padded forward must run instead.

    ``batch``: ``prompts`` ``(batch, prompt_len)`` left-padded, ``responses`` ``(batch, response_len)``,
    ``attention_mask``/``position_ids`` ``(batch, prompt_len + response_len)``. ``group_size`` > 1: rows come in
    runs of that many identical prompts (checked by the caller: ``shared_prefix_group_size``), each run's prompt is
    packed once and its attention laid out as the shared-prefix forward's (prompt alone, then each response over
    the prompt's cache); 1: each row's as the plain forward's. None when a row's prompt is not left-padded, its
    response tokens are not a prefix of the response columns, a prompt is empty or no response has a token.
    """
    prompts, responses = batch["prompts"], batch["responses"]
    mask, positions = batch["attention_mask"].bool(), batch["position_ids"]
    rows, prompt_len = prompts.shape
    width = responses.shape[1]
    device = mask.device
    prompt_mask, response_mask = mask[:, :prompt_len], mask[:, prompt_len:]
    prompt_lengths, response_lengths = prompt_mask.sum(1), response_mask.sum(1)
    columns = torch.arange(max(prompt_len, width), device=device)
    left_padded = torch.equal(prompt_mask, columns[:prompt_len] >= (prompt_len - prompt_lengths).unsqueeze(1))
    right_padded = torch.equal(response_mask, columns[:width] < response_lengths.unsqueeze(1))
    if not (left_padded and right_padded) or rows % group_size or bool((prompt_lengths == 0).any()) \
            or not bool(response_lengths.any()):
        return None
    shared = group_size > 1
    # The key axis each query has in the padded forward: the shared-prefix path runs the prompts alone (prompt_len
    # keys), then the responses' inputs over the cache (prompt_len + width - 1); the plain path whole rows.
    prefix_width = prompt_len if shared else prompt_len + width
    branch_width = prompt_len + width - 1 if shared else prompt_len + width
    ids, pos, predictors, out_rows = [], [], [], []
    prefixes: list[Piece] = []
    branches: list[Piece] = []
    start = 0
    prompt_lengths_list, response_lengths_list = prompt_lengths.tolist(), response_lengths.tolist()
    for first in range(0, rows, group_size):
        prompt_length = prompt_lengths_list[first]
        lead = prompt_len - prompt_length
        ids.append(prompts[first, lead:])
        pos.append(positions[first, lead:prompt_len])
        prefix = (start, start + prompt_length)
        prefixes.append(Piece(prefix, lead, (prefix,), lead, prefix_width))
        start += prompt_length
        for row in range(first, first + group_size):
            length = response_lengths_list[row]
            if length == 0:
                continue
            body = length - 1  # the last response token is predicted, never an input
            ids.append(responses[row, :body])
            pos.append(positions[row, prompt_len : prompt_len + body])
            predictors.append(prefix[1] - 1)
            predictors.extend(range(start, start + body))
            out_rows.append(torch.full((length,), row, device=device))
            if body:
                branches.append(Piece((start, start + body), prompt_len, (prefix, (start, start + body)), lead,
                                      branch_width))
            start += body
    groups = tuple(_attention_group(pieces, start, device) for pieces in (prefixes, branches) if pieces)
    # Where each packed token's attention output lands in the groups' outputs, concatenated row-major.
    output_index = torch.empty(start, dtype=torch.long)
    offset = 0
    for group in groups:
        index = group.query_index.cpu()
        real = index < start
        output_index[index[real]] = offset + torch.nonzero(real).squeeze(1)
        offset += index.numel()
    out_rows_t = torch.cat(out_rows) if out_rows else torch.zeros(0, dtype=torch.long, device=device)
    out_cols_t = columns[:width].expand(rows, -1)[response_mask]  # row-major, as out_rows
    return PackedBatch(input_ids=torch.cat(ids).unsqueeze(0), position_ids=torch.cat(pos).unsqueeze(0), groups=groups,
                       output_index=output_index.to(device),
                       predictors=torch.tensor(predictors, dtype=torch.long, device=device), rows=out_rows_t,
                       cols=out_cols_t, targets=responses[out_rows_t, out_cols_t], shape=(rows, width))


def packed_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             **kwargs) -> tuple[torch.Tensor, None]:
    """Attention over a packed row, one batched call per group of pieces. query ``(1, heads, tokens, head_dim)``,
    key/value ``(1, kv_heads, tokens, head_dim)`` -> ``(1, tokens, heads, head_dim)``, no weights."""
    layout: PackedBatch | None = kwargs.get(LAYOUT_KWARG)
    if layout is None:
        raise RuntimeError(f"the {NAME!r} attention runs only inside a packed forward (verl.models.packed_sequences)")
    heads, kv_heads, dim = query.shape[1], key.shape[1], query.shape[3]
    # Each tensor gets one zero row at index ``tokens``: the empty key slots and padding query rows read it.
    zero = query.new_zeros(1, 1, dim)
    banks = [torch.cat([t[0], zero.expand(t.shape[1], 1, dim)], dim=1) for t in (query, key, value)]
    outputs = []
    for group in layout.groups:
        n, q_len, width = group.pieces, group.queries, group.width
        q = banks[0].index_select(1, group.query_index).view(heads, n, q_len, dim).transpose(0, 1)
        k = banks[1].index_select(1, group.key_index).view(kv_heads, n, width, dim).transpose(0, 1)
        v = banks[2].index_select(1, group.key_index).view(kv_heads, n, width, dim).transpose(0, 1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, dropout_p=dropout, scale=scaling,
                                             enable_gqa=kv_heads != heads)  # (n, heads, q_len, dim)
        outputs.append(out.transpose(1, 2).reshape(n * q_len, heads, dim))
    output = torch.cat(outputs).index_select(0, layout.output_index)  # (tokens, heads, dim) in packed order
    return output.unsqueeze(0), None


AttentionInterface.register(NAME, packed_attention_forward)


# Decoder families whose layers see a token only through its position id and the attention (checked bit for bit
# against the padded forward for Llama; Mistral and Qwen share its layer code).
PACKABLE_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


def packable(model: torch.nn.Module, sequence_length: int) -> bool:
    """The packed forward can stand in for ``model``'s padded one on rows of ``sequence_length`` tokens: a known
    decoder family on sdpa attention (or verl's CPU sdpa), with no sliding window shorter than the rows
    (the packed attention does not apply one)."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in PACKABLE_MODEL_TYPES:
        return False
    if getattr(config, "_attn_implementation", None) not in ("sdpa", ATTENTION_NAME):
        return False
    window = getattr(config, "sliding_window", None)
    uses_window = window is not None and getattr(config, "use_sliding_window", True)
    return not (uses_window and sequence_length > window)


@contextlib.contextmanager
def packed_attention(model: PreTrainedModel) -> Iterator[None]:
    """Run the model's attention layers as ``packed_attention_forward`` inside this block (attention layers look
    their implementation up at call time; the backward needs no lookup)."""
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = previous

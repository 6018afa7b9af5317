"""A KV cache whose layers append in place (decoding without re-copying the cache at every step), and a batch of
right-aligned rows that sequences join and leave between decode steps (continuous batching)."""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` that appends into spare capacity instead of concatenating.

    ``DynamicLayer.update`` copies the whole layer cache on every step (``torch.cat``). Here every row is
    right-aligned, so all rows append at the same column and a buffer with headroom takes the new token in
    place; the buffer is reallocated (doubling) only when full, and when rows join or leave. The serving engine's
    continuous batching and the rollout sampler both decode into it. Measured on the 25M
    model with 32 rows and 120 cached tokens, those per-step copies were ~30 ms of a ~115 ms decode step.
    ``keys``/``values`` are views of the filled part, which is all the attention code reads.
    """

    _layer_type = None  # never register this class in transformers' layer-type mapping
    HEADROOM = 64

    def __init__(self) -> None:
        super().__init__()
        self._kbuf: torch.Tensor | None = None
        self._vbuf: torch.Tensor | None = None
        self._len = 0

    def set_state(self, keys: torch.Tensor, values: torch.Tensor, headroom: int = HEADROOM) -> None:
        """Make ``keys``/``values`` (batch, heads, length, head_dim) the contents, with ``headroom`` free columns."""
        batch, heads, length, dim = keys.shape
        kbuf = keys.new_empty((batch, heads, length + headroom, dim))
        vbuf = values.new_empty((batch, values.shape[1], length + headroom, values.shape[3]))
        kbuf[:, :, :length] = keys
        vbuf[:, :, :length] = values
        self._kbuf, self._vbuf, self._len = kbuf, vbuf, length
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
        self.keys, self.values = kbuf[:, :, :length], vbuf[:, :, :length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self._kbuf is None:
            self.set_state(key_states, value_states)
            return self.keys, self.values
        new = key_states.shape[-2]
        if self._len + new > self._kbuf.shape[2]:
            self.set_state(self.keys, self.values, headroom=max(self.HEADROOM, self._len, new))
        end = self._len + new
        self._kbuf[:, :, self._len:end] = key_states
        self._vbuf[:, :, self._len:end] = value_states
        self._len = end
        self.keys, self.values = self._kbuf[:, :, :end], self._vbuf[:, :, :end]
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self._kbuf is not None:
            self.set_state(self.keys[indices], self.values[indices])


def new_growing_cache(config) -> DynamicCache:
    """An empty ``DynamicCache`` for ``config`` whose layers append in place."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() for _ in cache.layers]
    return cache


def growing_cache_from(cache: DynamicCache, headroom: int) -> DynamicCache:
    """The same contents as ``cache`` (a prefilled ``DynamicCache`` of plain layers) in growing layers with
    ``headroom`` free columns, so the next ``headroom`` decode steps never reallocate."""
    grown = DynamicCache()
    grown.layers = []
    for layer in cache.layers:
        growing = GrowingLayer()
        growing.set_state(layer.keys, layer.values, headroom=max(1, headroom))
        grown.layers.append(growing)
    return grown


def pad_left(tensor: torch.Tensor, length: int, dim: int = 2) -> torch.Tensor:
    """``tensor`` padded with zeros at the start of ``dim`` to ``length``."""
    missing = length - tensor.shape[dim]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


def left_padded(sequences: list[list[int]] | list[tuple[int, ...]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id sequences as a right-aligned batch: ids and attention mask, both ``(len(sequences), longest)``."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, sequence in enumerate(sequences):
        ids[i, width - len(sequence):] = torch.tensor(sequence, dtype=torch.long)
        mask[i, width - len(sequence):] = 1
    return ids, mask


class RowBatch:
    """Running sequences as rows of one batch: a right-aligned KV cache, its attention mask ``(rows, length)`` and
    each row's next input token ``(rows,)``; ``rows`` holds the caller's object per row.

    Row ``i`` occupies the last ``len_i`` cache columns; the columns before it are padding, masked out, and the
    row's position ids count only its real tokens, so padding never shifts positions. Rows prefilled together
    ``add`` themselves (left-padded to a common length and concatenated); ``keep`` drops finished ones and trims
    columns that became padding for every row. The serving engine and the agent rollout both schedule on it.
    """

    def __init__(self) -> None:
        self.rows: list[Any] = []
        self.cache: DynamicCache | None = None
        self.mask = torch.zeros(0, 0, dtype=torch.long)
        self.next_tokens = torch.zeros(0, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, rows: list[Any], cache: DynamicCache, mask: torch.Tensor, next_tokens: torch.Tensor) -> None:
        if self.cache is None or not self.rows:
            self.rows, self.cache, self.mask, self.next_tokens = list(rows), cache, mask, next_tokens
            return
        length = max(self.mask.shape[1], mask.shape[1])
        for old, new in zip(self.cache.layers, cache.layers, strict=True):
            old.set_state(torch.cat([pad_left(old.keys, length), pad_left(new.keys, length)], dim=0),
                          torch.cat([pad_left(old.values, length), pad_left(new.values, length)], dim=0))
        self.mask = torch.cat([pad_left(self.mask, length, dim=1), pad_left(mask, length, dim=1)], dim=0)
        self.next_tokens = torch.cat([self.next_tokens, next_tokens])
        self.rows.extend(rows)

    def keep(self, keep: list[int]) -> None:
        """Keep only rows ``keep`` and trim columns that are padding in every remaining row."""
        if len(keep) == len(self.rows):
            return
        if not keep:
            self.__init__()
            return
        index = torch.tensor(keep, dtype=torch.long, device=self.mask.device)
        self.rows = [self.rows[i] for i in keep]
        self.mask = self.mask.index_select(0, index)
        self.next_tokens = self.next_tokens.index_select(0, index)
        used = self.mask.any(0).nonzero()
        first = int(used[0]) if len(used) else self.mask.shape[1]
        for layer in self.cache.layers:
            layer.set_state(layer.keys.index_select(0, index)[:, :, first:],
                            layer.values.index_select(0, index)[:, :, first:])
        self.mask = self.mask[:, first:]

"""A KV cache whose layers append in place (decoding without re-copying the cache at every step)."""

from __future__ import annotations

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

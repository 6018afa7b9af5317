"""A KV cache whose layers append in place (decoding without re-copying the cache at every step), and a batch of
right-aligned rows that sequences join and leave between decode steps (continuous batching)."""

from __future__ import annotations

from dataclasses import dataclass
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
        self._start = 0  # the first column in use (columns before it became padding for every row)
        self._rows = 0  # the rows in use: the buffers' first ``_rows``

    def set_state(self, keys: torch.Tensor, values: torch.Tensor, headroom: int = HEADROOM) -> None:
        """Make ``keys``/``values`` (batch, heads, length, head_dim) the contents, with ``headroom`` free columns."""
        batch, heads, length, dim = keys.shape
        kbuf = keys.new_empty((batch, heads, length + headroom, dim))
        vbuf = values.new_empty((batch, values.shape[1], length + headroom, values.shape[3]))
        kbuf[:, :, :length] = keys
        vbuf[:, :, :length] = values
        self._kbuf, self._vbuf, self._len, self._start, self._rows = kbuf, vbuf, length, 0, batch
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
        self._views()

    def adopt(self, kbuf: torch.Tensor, vbuf: torch.Tensor, length: int, rows: int | None = None) -> None:
        """Take ``kbuf``/``vbuf`` (capacity rows, heads, capacity columns, head_dim) as the buffers, the first
        ``length`` columns of their first ``rows`` rows (all when ``None``) filled (no copy)."""
        rows = kbuf.shape[0] if rows is None else rows
        self._kbuf, self._vbuf, self._len, self._start, self._rows = kbuf, vbuf, length, 0, rows
        self.dtype, self.device, self.is_initialized = kbuf.dtype, kbuf.device, True
        self._views()

    def _views(self) -> None:
        rows, columns = slice(0, self._rows), slice(self._start, self._len)
        self.keys, self.values = self._kbuf[rows, :, columns], self._vbuf[rows, :, columns]

    def compact(self, holes: list[int], movers: list[int], rows: int, first: int) -> None:
        """In place, no new buffer: rows ``movers`` move into rows ``holes`` (as many), the first ``rows`` stay in
        use, and the first ``first`` columns in use are dropped. Copies only the moved rows' columns in use, one
        row at a time: advanced-index assignment (gather to a temporary, then scatter) ran at ~3 GB/s and was
        ~4% of the tiny agent's multi-turn rollout; a row's copy is one contiguous block per head."""
        start = self._start + first
        for hole, mover in zip(holes, movers, strict=True):
            self._kbuf[hole, :, start:self._len].copy_(self._kbuf[mover, :, start:self._len])
            self._vbuf[hole, :, start:self._len].copy_(self._vbuf[mover, :, start:self._len])
        self._rows, self._start = rows, start
        self._views()

    def spare_rows(self) -> int:
        return 0 if self._kbuf is None else self._kbuf.shape[0] - self._rows

    def join(self, source: GrowingLayer, index: torch.Tensor | None, width: int, first: int) -> None:
        """In place: ``source``'s rows ``index`` (all when ``None``), their last ``width`` columns, become new rows
        after the ones in use (``spare_rows`` must hold them), right-aligned; ``first`` is the first column in use
        afterwards (below the current one when the new rows are wider: those columns are zeroed for the old
        rows, as padding must be finite)."""
        self.widen(first)
        for buffer, whole in ((self._kbuf, source.keys), (self._vbuf, source.values)):
            tensor = whole[:, :, whole.shape[2] - width:]
            count = tensor.shape[0] if index is None else len(index)
            rows = slice(self._rows, self._rows + count)
            buffer[rows, :, self._start:self._len - width] = 0  # padding: finite, masked out
            target = buffer[rows, :, self._len - width:self._len]
            if index is None:
                target.copy_(tensor)
            else:
                torch.index_select(tensor, 0, index, out=target)
        self._rows += count
        self._views()

    def widen(self, first: int) -> None:
        """Make ``first`` (below the first column in use) the first column in use: the columns gained are zeroed
        for the rows in use (padding must be finite)."""
        if first < self._start:
            self._kbuf[:self._rows, :, first:self._start] = 0
            self._vbuf[:self._rows, :, first:self._start] = 0
            self._start = first
            self._views()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self._kbuf is None:
            self.set_state(key_states, value_states)
            return self.keys, self.values
        new = key_states.shape[-2]
        if self._len + new > self._kbuf.shape[2]:
            self._grow(max(self.HEADROOM, self._len, new))
        end = self._len + new
        self._kbuf[:self._rows, :, self._len:end] = key_states
        self._vbuf[:self._rows, :, self._len:end] = value_states
        self._len = end
        self._views()
        return self.keys, self.values

    def _grow(self, headroom: int) -> None:
        """Out of columns: new buffers holding the columns in use (from column 0) and ``headroom`` free ones, with
        as many rows as before, so the spare rows stay spare (reallocating to the rows in use left none: the
        next rows to join the batch then rebuilt it whole, ~3 times per rollout of the tiny agent)."""
        width = self._len - self._start
        buffers = []
        for buffer in (self._kbuf, self._vbuf):
            grown = buffer.new_empty((buffer.shape[0], buffer.shape[1], width + headroom, buffer.shape[3]))
            grown[:self._rows, :, :width] = buffer[:self._rows, :, self._start:self._len]
            buffers.append(grown)
        self.adopt(buffers[0], buffers[1], width, self._rows)

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


@dataclass
class Joining:
    """Rows that join a ``RowBatch``: their prefill's ``cache`` and attention ``mask`` ``(R, width)``, each row's next
    input token ``(R,)``, and ``index``: which of the ``R`` rows join (all when ``None``); ``rows`` are the caller's
    objects of the joining rows only."""

    rows: list[Any]
    cache: DynamicCache
    mask: torch.Tensor
    next_tokens: torch.Tensor
    index: list[int] | None = None
    # The cache row of each of the ``R`` rows when the cache holds fewer rows than ``R`` (a prompt's ``n`` samples
    # prefilled once: they share one cache row until they join, so it is copied once, into the batch).
    cache_rows: list[int] | None = None

    def cache_index(self) -> torch.Tensor | None:
        """The cache rows of the joining rows ``(len(rows),)`` (``None``: all, in order)."""
        if self.cache_rows is None:
            chosen = self.index
        else:
            chosen = [self.cache_rows[i] for i in (range(len(self.cache_rows)) if self.index is None else self.index)]
        return None if chosen is None else torch.tensor(chosen, dtype=torch.long, device=self.mask.device)


class RowBatch:
    """Running sequences as rows of one batch: a right-aligned KV cache, its attention mask ``(rows, length)`` and
    each row's next input token ``(rows,)``; ``rows`` holds the caller's object per row.

    Row ``i`` occupies the last ``len_i`` cache columns; the columns before it are padding, masked out, and the
    row's position ids count only its real tokens, so padding never shifts positions. ``rebuild`` drops rows and
    adds new ones (left-padded to a common length) in one pass that copies each kept row's cache once, straight into
    the new buffer, and trims columns that became padding for every row; ``keep`` and ``add`` are its two halves.
    When rows only leave, the batch is compacted in place instead (``_compact``: the last rows move into the
    leavers' places, so the order of rows changes; callers index ``rows`` after every call); rows that join go into
    the buffers' spare rows (a rebuild leaves a quarter spare) when those hold them (``_join_in_place``), copying
    only the joining rows.
    The serving engine schedules on it (the agent rollout did, before ``verl.models.slot_cache``). Why one pass:
    the cache is most of the memory a decode step touches, and rows join or leave at most steps of an agent
    rollout; doing a drop and a join as index-select + concatenate + re-buffer copied the whole cache five times
    per step (~16% of a rollout's time on the tiny agent, cProfile).
    """

    def __init__(self) -> None:
        self.rows: list[Any] = []
        self.cache: DynamicCache | None = None
        self.mask = torch.zeros(0, 0, dtype=torch.long)
        self.next_tokens = torch.zeros(0, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, rows: list[Any], cache: DynamicCache, mask: torch.Tensor, next_tokens: torch.Tensor) -> None:
        self.rebuild(None, [Joining(list(rows), cache, mask, next_tokens)])

    def keep(self, keep: list[int]) -> None:
        """Keep only rows ``keep`` and trim columns that are padding in every remaining row."""
        self.rebuild(keep, [])

    def _compact(self, keep: list[int]) -> None:
        """Rows leave and none join: the last kept rows move into the leavers' places, in the same buffers (the
        order of rows changes), and columns that became padding for every row are dropped. Copies the moved rows
        only: rows leave at most steps of an agent rollout, and a rebuild copied the whole cache each time (~10%
        of a 512-trajectory rollout of the tiny agent)."""
        count, kept = len(keep), set(keep)
        holes = [i for i in range(count) if i not in kept]
        movers = [j for j in keep if j >= count]
        if holes:
            device = self.mask.device
            hole_index = torch.tensor(holes, dtype=torch.long, device=device)
            mover_index = torch.tensor(movers, dtype=torch.long, device=device)
            self.mask[hole_index] = self.mask[mover_index]
            self.next_tokens[hole_index] = self.next_tokens[mover_index]
            for hole, mover in zip(holes, movers, strict=True):
                self.rows[hole] = self.rows[mover]
        self.rows, self.mask, self.next_tokens = self.rows[:count], self.mask[:count], self.next_tokens[:count]
        used = self.mask.any(0).nonzero()
        first = int(used[0]) if len(used) else self.mask.shape[1]
        self.mask = self.mask[:, first:]
        for layer in self.cache.layers:
            layer.compact(holes, movers, count, first)

    def _can_join_in_place(self, kept: int, joining: list[Joining]) -> bool:
        """Whether the buffers have spare rows for the joining rows and columns enough for the widest of them."""
        layer = self.cache.layers[0]
        arriving = sum(len(j.rows) for j in joining)
        columns = layer._len  # a joining row may reach back to the buffer's first column
        return (layer.spare_rows() + len(self.rows) - kept >= arriving
                and all(j.mask.shape[1] <= columns for j in joining)
                and all(isinstance(jl, GrowingLayer) for j in joining for jl in j.cache.layers))

    def _join_in_place(self, joining: list[Joining]) -> None:
        """Rows join into the buffers' spare rows: only the joining rows are copied (a rebuild copies the whole
        batch's cache; on the agent rollout queued trajectories join every few steps)."""
        width = max([self.mask.shape[1]] + [j.mask.shape[1] for j in joining])
        indexes = [None if j.index is None else torch.tensor(j.index, dtype=torch.long, device=j.mask.device)
                   for j in joining]
        cache_indexes = [j.cache_index() for j in joining]
        masks, tokens = [pad_left(self.mask, width, dim=1)], [self.next_tokens]
        for number, layer in enumerate(self.cache.layers):
            first = layer._len - width
            for j, cache_index in zip(joining, cache_indexes, strict=True):
                layer.join(j.cache.layers[number], cache_index, j.mask.shape[1], first)
        for j, index in zip(joining, indexes, strict=True):
            mask = j.mask if index is None else j.mask.index_select(0, index)
            masks.append(pad_left(mask, width, dim=1))
            tokens.append(j.next_tokens if index is None else j.next_tokens.index_select(0, index))
            self.rows.extend(j.rows)
        self.mask, self.next_tokens = torch.cat(masks), torch.cat(tokens)

    def rebuild(self, keep: list[int] | None, joining: list[Joining]) -> None:
        """Keep rows ``keep`` (all when ``None``) and append the ``joining`` rows, copying every cache once."""
        keep = list(range(len(self.rows))) if keep is None else keep
        joining = [j for j in joining if j.index is None or j.index]
        if len(keep) == len(self.rows) and not joining:
            return
        if keep and self.cache is not None and all(isinstance(layer, GrowingLayer) for layer in self.cache.layers):
            if not joining:
                self._compact(keep)
                return
            if self._can_join_in_place(len(keep), joining):
                if len(keep) < len(self.rows):
                    self._compact(keep)
                self._join_in_place(joining)
                return
        if (not self.rows and len(joining) == 1 and joining[0].index is None
                and joining[0].cache_rows is None):  # an empty batch adopts the prefill
            j = joining[0]
            self.rows, self.cache, self.mask, self.next_tokens = list(j.rows), j.cache, j.mask, j.next_tokens
            return
        device = self.mask.device if self.rows else joining[0].mask.device
        kept_index = torch.tensor(keep, dtype=torch.long, device=device)
        kept_mask = self.mask.index_select(0, kept_index) if keep else self.mask[:0]
        used = kept_mask.any(0).nonzero()
        first = int(used[0]) if len(used) else kept_mask.shape[1]
        # Parts: (source cache or None, rows' index into it, the rows' mask with only their used columns).
        parts: list[tuple[DynamicCache | None, torch.Tensor | None, torch.Tensor]] = []
        if keep:
            parts.append((self.cache, kept_index, kept_mask[:, first:]))
        for j in joining:
            index = None if j.index is None else torch.tensor(j.index, dtype=torch.long, device=j.mask.device)
            parts.append((j.cache, j.cache_index(), j.mask if index is None else j.mask.index_select(0, index)))
        if not parts:
            self.__init__()
            return
        length = max(mask.shape[1] for _, _, mask in parts)
        rows = sum(mask.shape[0] for _, _, mask in parts)
        spare = rows // 4  # room for rows that join later without a rebuild (``_join_in_place``)
        self.mask = torch.cat([pad_left(mask, length, dim=1) for _, _, mask in parts])
        tokens = [self.next_tokens.index_select(0, kept_index)] if keep else []
        tokens += [j.next_tokens if j.index is None else j.next_tokens.index_select(0, torch.tensor(
            j.index, dtype=torch.long, device=j.next_tokens.device)) for j in joining]
        self.next_tokens = torch.cat(tokens)
        self.rows = [self.rows[i] for i in keep] + [row for j in joining for row in j.rows]
        target = self.cache if self.cache is not None else joining[0].cache
        for number, layer in enumerate(target.layers):
            sources = [(cache.layers[number], index, mask.shape[1]) for cache, index, mask in parts]  # GrowingLayers
            buffers = []
            for name in ("keys", "values"):
                sample = getattr(sources[0][0], name)
                buffer = sample.new_empty((rows + spare, sample.shape[1], length + GrowingLayer.HEADROOM,
                                           sample.shape[3]))
                start = 0
                for source, index, width in sources:
                    whole = getattr(source, name)
                    tensor = whole[:, :, whole.shape[2] - width:]
                    count = tensor.shape[0] if index is None else len(index)
                    buffer[start:start + count, :, :length - width] = 0  # padding: finite, masked out
                    target_view = buffer[start:start + count, :, length - width:length]
                    if index is None:
                        target_view.copy_(tensor)
                    else:
                        torch.index_select(tensor, 0, index, out=target_view)
                    start += count
                buffers.append(buffer)
            layer.adopt(buffers[0], buffers[1], length, rows)
        self.cache = target


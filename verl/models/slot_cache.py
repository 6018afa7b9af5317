"""A KV cache of slots: each sequence keeps one row of a store from its prefill to its end, and a forward runs over
any subset of the rows, each appending at its own length. The agent loop decodes on it (``AgentLoop``).

Why not the right-aligned ``RowBatch``: in an agent rollout a trajectory leaves the decoding batch at every tool
call and comes back when its results arrive. On a dense right-aligned batch each departure copied the row's cache
out (parking it), each return copied it back into a spare row, and each departure left a hole that the last row's
cache was moved into (compaction); on the tiny agent those copies were ~0.17 s of a ~2.8 s rollout, for nothing a
single-turn rollout does. Here nothing moves: a step names its rows (``kv_rows``), the decode kernel reads them in
place (``verl.models.decode_attention``), and a trajectory waiting for its tools simply is not in the step. This is
the idea of vLLM's paged cache (a sequence's blocks stay put; the step's block table says which to read) with one
block per sequence: every slot has room for the longest sequence so far, grown by doubling when one needs more.

Layout: per layer, keys and values ``(slots, kv_heads, columns, head_dim)``; a slot's sequence is left-aligned in
its row (column 0 first), ``lengths[s]`` columns filled, and ``mask[s]`` says which of them are real tokens (a
prefill's left padding and a tool turn's padding inside a block stay in the row as masked columns). Position ids
count real tokens only (``positions[s]``), so padding never shifts them.

    store = SlotCache(model.config, slots=8)
    slots = store.allocate(rows)                        # free slots, one per row
    store.assign(slots, prefill_cache, prefill_mask)    # a prefill's rows copied in (once)
    out = model(input_ids=ids, **store.step(slots, new_mask))   # ids (B, Q): each row appends Q columns
    store.release(slots)                                # the sequences ended

With transformers' own attention implementations (not verl's CPU attention), ``update`` returns the step's rows
gathered (a copy per layer and forward: correct, slower); with ``verl_cpu_sdpa`` it returns the store and the
model call names the rows (``kv_rows``).
"""

from __future__ import annotations

import numpy as np
import torch
from transformers.cache_utils import DynamicCache, DynamicLayer


class SlotLayer(DynamicLayer):
    """One layer's store ``(slots, kv_heads, columns, head_dim)``; ``update`` writes the step's rows' new keys and
    values at each row's columns (``SlotCache.step`` says where) and returns the store's first ``width`` columns
    (or, with ``gather``, the step's rows of them)."""

    _layer_type = None  # never register this class in transformers' layer-type mapping

    def __init__(self, owner: SlotCache) -> None:
        super().__init__()
        self.owner = owner
        self.kbuf: torch.Tensor | None = None
        self.vbuf: torch.Tensor | None = None

    def allocate(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Stores shaped for ``keys``/``values`` ``(any, kv_heads, any, head_dim)``, not zeroed: a column is
        written before any mask lets it be read (the gathered path zeroes what the mask hides, ``gathered``), and
        untouched pages cost no memory, so the store can have a slot for every sequence of a rollout up front."""
        slots, columns = self.owner.capacity
        self.kbuf = keys.new_empty((slots, keys.shape[1], columns, keys.shape[3]))
        self.vbuf = values.new_empty((slots, values.shape[1], columns, values.shape[3]))
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True

    def resize(self, slots: int, columns: int) -> None:
        """Larger stores holding the current contents (rare: only a sequence longer than planned grows it)."""
        for name in ("kbuf", "vbuf"):
            old = getattr(self, name)
            new = old.new_empty((slots, old.shape[1], columns, old.shape[3]))
            new[:old.shape[0], :, :old.shape[2]] = old
            setattr(self, name, new)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """``key_states``/``value_states`` ``(rows, kv_heads, Q, head_dim)``: the step's rows' new columns."""
        owner = self.owner
        index = owner.write_index  # (rows * kv_heads * Q,): each (row, head, position)'s place in the flat store
        # One row copy per (row, head, position) into the store seen as (slots * kv_heads * columns, head_dim):
        # ~3x faster than advanced-index assignment over (slot, :, column).
        for store, states in ((self.kbuf, key_states), (self.vbuf, value_states)):
            store.view(-1, store.shape[-1]).index_copy_(0, index, states.reshape(-1, states.shape[-1]))
        keys, values = self.kbuf[:, :, :owner.width], self.vbuf[:, :, :owner.width]
        if owner.gather:
            return owner.gathered(keys), owner.gathered(values)
        return keys, values

    def get_seq_length(self) -> int:
        return self.owner.width

    def get_mask_sizes(self, query_length: int, *args, **kwargs) -> tuple[int, int]:
        return self.owner.width, 0


class SlotCache(DynamicCache):
    """A ``DynamicCache`` whose layers are slot stores (see the module docstring). ``slots``: how many sequences
    it holds at once (more: it grows, copying); ``columns``: the longest sequence planned (a longer one grows the
    store, copying). ``gather``: return the step's rows gathered, for attention implementations that do not read
    ``kv_rows``. ``device``: where the model runs (the masks and indexes live there; the stores take the device of
    the first prefill copied in)."""

    def __init__(self, config, slots: int, columns: int = 128, gather: bool = False,
                 device: torch.device | str = "cpu") -> None:
        super().__init__(config=config)
        self.layers = [SlotLayer(self) for _ in self.layers]
        self.capacity = (max(1, slots), max(1, columns))
        self.gather = gather
        self.mask = torch.zeros(self.capacity, dtype=torch.bool, device=device)
        self.lengths = np.zeros(self.capacity[0], dtype=np.int64)
        self.positions = np.zeros(self.capacity[0], dtype=np.int64)  # real tokens per slot (the next position id)
        self.free = list(range(self.capacity[0] - 1, -1, -1))  # a stack: the lowest slot first (pages stay warm)
        self.width = 0  # the columns the current step reads: its rows' longest length
        self.write_index: torch.Tensor | None = None
        self.step_rows: torch.Tensor | None = None
        self.step_mask: torch.Tensor | None = None

    def fits(self, slots: int, columns: int, gather: bool) -> bool:
        """Whether this store can serve a run needing ``slots`` x ``columns`` (``reset`` first)."""
        return self.capacity[0] >= slots and self.capacity[1] >= columns and self.gather == gather

    def nbytes(self) -> int:
        """The stores' size (allocated; pages never touched take no memory until used)."""
        return sum(buffer.numel() * buffer.element_size() for layer in self.layers
                   for buffer in (layer.kbuf, layer.vbuf) if buffer is not None)

    def reset(self) -> None:
        """Every slot free again, the stores kept: a store is larger than glibc's largest heap block (32 MB), so a
        new one is fresh memory from the OS whose every page faults on first touch; reusing it across rollouts
        saved ~50 ms of copying prefills in per tiny-agent rollout of 512 trajectories."""
        self.free = list(range(self.capacity[0] - 1, -1, -1))
        self.width, self.write_index, self.step_rows, self.step_mask = 0, None, None, None

    # ---------------------------------------------------------------- slots

    def allocate(self, count: int) -> list[int]:
        """``count`` free slots (the store grows when too few are free)."""
        if count > len(self.free):
            in_use = self.capacity[0] - len(self.free)
            self._resize(max(2 * self.capacity[0], in_use + count), self.capacity[1])
        return [self.free.pop() for _ in range(count)]

    def release(self, slots: list[int]) -> None:
        """The slots' sequences ended: the slots are free (their contents are overwritten by the next ``assign``)."""
        self.free.extend(slots)

    def assign(self, slots: list[int], cache: DynamicCache, mask: torch.Tensor,
               cache_rows: list[int] | None = None) -> None:
        """Copy a prefill into ``slots``: ``cache``'s layers hold ``(R, kv_heads, W, head_dim)`` with attention
        ``mask`` ``(R, W)`` (left-padded rows); slot ``slots[i]`` takes row ``cache_rows[i]`` (row ``i`` when
        ``None``: a prompt's samples share a prefill row and each copies it)."""
        width = mask.shape[1]
        self._ensure_columns(width)
        device = mask.device
        target = torch.tensor(slots, dtype=torch.long, device=device)
        source = None if cache_rows is None else torch.tensor(cache_rows, dtype=torch.long, device=device)
        for layer, prefilled in zip(self.layers, cache.layers, strict=True):
            if layer.kbuf is None or layer.kbuf.dtype != prefilled.keys.dtype \
                    or layer.kbuf.device != prefilled.keys.device:
                layer.allocate(prefilled.keys, prefilled.values)
            for store, tensor in ((layer.kbuf, prefilled.keys), (layer.vbuf, prefilled.values)):
                store[target, :, :width] = tensor if source is None else tensor.index_select(0, source)
        rows_mask = mask if source is None else mask.index_select(0, source)
        self.mask[target] = False
        self.mask[target, :width] = rows_mask.to(self.mask.device, torch.bool)
        index = np.asarray(slots, dtype=np.int64)
        self.lengths[index] = width
        self.positions[index] = rows_mask.sum(-1).cpu().numpy()

    # ---------------------------------------------------------------- a forward

    def step(self, slots: np.ndarray, new_mask: torch.Tensor | None = None) -> dict:
        """Prepare a forward in which slot ``slots[b]`` appends ``Q`` columns (one when ``new_mask`` is None, a
        decode step; else ``new_mask`` ``(B, Q)``: 1 on the row's real new ids, left-padded). Returns the model
        call's keywords: the attention mask ``(B, 1, Q, width)`` bool (each position sees its row's real columns
        up to itself), position ids ``(B, Q)`` counting real tokens, this cache, and ``kv_rows``. Every slot in
        ``slots`` must hold a prefill (``assign``)."""
        slots = np.ascontiguousarray(slots, dtype=np.int64)
        new = 1 if new_mask is None else new_mask.shape[1]
        starts = self.lengths[slots]
        self.width = int(starts.max()) + new
        self._ensure_columns(self.width)
        device = self.mask.device
        rows = torch.from_numpy(slots).to(device)
        start = torch.from_numpy(starts).to(device)
        before = self.positions[slots]
        self.lengths[slots] = starts + new
        columns = start.unsqueeze(-1) + torch.arange(new, device=device)  # (B, Q)
        if new_mask is None:
            self.mask[rows, start] = True
            self.positions[slots] = before + 1
            position_ids = torch.from_numpy(before).to(device).unsqueeze(-1)
            # Columns after a row's own are never set, so its mask row is what its one position sees.
            attention = self.mask[:, :self.width].index_select(0, rows)[:, None, None, :]
        else:
            real = new_mask.to(device, torch.bool)
            self.mask[rows.unsqueeze(-1), columns] = real
            counted = real.long().cumsum(-1)
            self.positions[slots] = before + counted[:, -1].cpu().numpy()
            # A padded id takes its predecessor's position (it is masked out anyway).
            position_ids = (torch.from_numpy(before).to(device).unsqueeze(-1) + counted - 1).clamp(min=0)
            seen = self.mask[:, :self.width].index_select(0, rows)  # (B, width): real columns, new ones included
            # Position q sees the row's columns before its new ones and its new ones up to itself.
            limit = start.unsqueeze(-1) + torch.arange(1, new + 1, device=device)  # (B, Q)
            causal = torch.arange(self.width, device=device) < limit.unsqueeze(-1)  # (B, Q, width)
            attention = (seen.unsqueeze(1) & causal).unsqueeze(1)
        heads = self.layers[0].kbuf.shape[1]
        head_rows = rows.unsqueeze(-1) * heads + torch.arange(heads, device=device)  # (B, kv_heads)
        self.write_index = (head_rows.unsqueeze(-1) * self.capacity[1] + columns.unsqueeze(1)).reshape(-1)
        self.step_rows, self.step_mask = rows, attention
        keywords = {"attention_mask": attention, "position_ids": position_ids, "past_key_values": self,
                    "use_cache": True}
        if not self.gather:
            keywords["kv_rows"] = rows
        return keywords

    def gathered(self, store: torch.Tensor) -> torch.Tensor:
        """The step's rows of ``store`` ``(slots, kv_heads, width, head_dim)`` -> ``(B, kv_heads, width,
        head_dim)``, the columns no position of the step sees zeroed (never-written memory may hold NaN, which
        a masked-out score times its value would carry into the output)."""
        rows = store.index_select(0, self.step_rows)
        hidden = ~self.step_mask.any(2)  # (B, 1, width)
        return rows.masked_fill_(hidden.unsqueeze(-1), 0)

    # ---------------------------------------------------------------- growth

    def _ensure_columns(self, needed: int) -> None:
        if needed > self.capacity[1]:
            self._resize(self.capacity[0], max(2 * self.capacity[1], needed))

    def _resize(self, slots: int, columns: int) -> None:
        old_slots, old_columns = self.capacity
        for layer in self.layers:
            if layer.kbuf is not None:
                layer.resize(slots, columns)
        mask = torch.zeros((slots, columns), dtype=torch.bool, device=self.mask.device)
        mask[:old_slots, :old_columns] = self.mask
        self.mask = mask
        self.lengths = np.concatenate([self.lengths, np.zeros(slots - old_slots, dtype=np.int64)])
        self.positions = np.concatenate([self.positions, np.zeros(slots - old_slots, dtype=np.int64)])
        self.free = list(range(slots - 1, old_slots - 1, -1)) + self.free
        self.capacity = (slots, columns)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.width

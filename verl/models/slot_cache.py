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
    slots = store.allocate(rows)                                  # empty slots, one per row
    out = model(input_ids=prompts, **store.step(slots, mask))     # the prefill (left-padded prompts, their mask)
    out = model(input_ids=ids, **store.step(slots, new_mask))     # ids (B, Q): each row appends Q columns
    out = model(input_ids=next_ids, **store.step(slots))          # a decode step (B, 1)
    store.release(slots)                                          # the sequences ended

With transformers' own attention implementations (not verl's CPU attention), ``update`` returns the step's rows
gathered (a copy per layer and forward: correct, slower); with ``verl_cpu_sdpa`` it returns the store and the
model call names the rows (``kv_rows``).
"""

from __future__ import annotations

import numpy as np
import torch
from transformers.cache_utils import DynamicCache, DynamicLayer


def gather_visible(store: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` (int64 ``(B,)``) of a store ``(slots, kv_heads, width, head_dim)`` -> ``(B, kv_heads, width,
    head_dim)``, the columns that no query position of ``mask`` (bool ``(B, 1, Q, width)``) sees zeroed:
    never-written store memory may hold NaN, which a masked-out score times its value would carry into the output.
    For attention that cannot read a slot store in place (SDPA, transformers' own implementations)."""
    hidden = ~mask.any(2)  # (B, 1, width)
    return store.index_select(0, rows).masked_fill_(hidden.unsqueeze(-1), 0)


class SlotLayer(DynamicLayer):
    """One layer's store ``(slots, kv_heads, columns, head_dim)``, written by ``SlotCache.update``. It holds no
    reference back to its cache: a cycle would leave a released store (hundreds of MB) to Python's cyclic
    collector instead of freeing it when the last reference goes."""

    _layer_type = None  # never register this class in transformers' layer-type mapping

    def __init__(self) -> None:
        super().__init__()
        self.kbuf: torch.Tensor | None = None
        self.vbuf: torch.Tensor | None = None

    def allocate(self, keys: torch.Tensor, values: torch.Tensor, slots: int, columns: int) -> None:
        """Stores shaped for ``keys``/``values`` ``(any, kv_heads, any, head_dim)``, not zeroed: a column is
        written before any mask lets it be read (the gathered path zeroes what the mask hides,
        ``SlotCache.gathered``), and untouched pages cost no memory, so the store can have a slot for every
        sequence of a rollout up front. Called at the first forward (contents are lost if a later one brings
        another dtype)."""
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

    def update(self, *args, **kwargs):
        raise NotImplementedError("a SlotLayer is written through SlotCache.update (the step says where)")


class SlotCache(DynamicCache):
    """A ``DynamicCache`` whose layers are slot stores (see the module docstring). ``slots``: how many sequences
    it holds at once (more: it grows, copying); ``columns``: the longest sequence planned (a longer one grows the
    store, copying). ``gather``: return the step's rows gathered, for attention implementations that do not read
    ``kv_rows``. ``device``: where the model runs (the masks and indexes live there; the stores take the device and
    dtype of the first forward's keys)."""

    def __init__(self, config, slots: int, columns: int = 128, gather: bool = False,
                 device: torch.device | str = "cpu") -> None:
        super().__init__(config=config)
        self.layers = [SlotLayer() for _ in self.layers]
        self.capacity = (max(1, slots), max(1, columns))
        self.kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
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
        new one is fresh memory from the OS whose every page faults on first touch; a tiny-agent rollout of 512
        trajectories took 2.55 s with the store reused against 2.91 s with a new one (one process, alternating)."""
        self.free = list(range(self.capacity[0] - 1, -1, -1))
        self.width, self.write_index, self.step_rows, self.step_mask = 0, None, None, None

    # ---------------------------------------------------------------- slots

    def allocate(self, count: int) -> list[int]:
        """``count`` free slots, empty (the store grows when too few are free): a forward over a prompt's ids
        (``step`` with its mask) prefills one."""
        if count > len(self.free):
            in_use = self.capacity[0] - len(self.free)
            self._resize(max(2 * self.capacity[0], in_use + count), self.capacity[1])
        slots = [self.free.pop() for _ in range(count)]
        index = np.asarray(slots, dtype=np.int64)
        self.mask[torch.from_numpy(index).to(self.mask.device)] = False
        self.lengths[index] = 0
        self.positions[index] = 0
        return slots

    def release(self, slots: list[int]) -> None:
        """The slots' sequences ended: the slots are free (``allocate`` empties them again)."""
        self.free.extend(slots)

    def copy(self, sources: list[int], targets: list[int]) -> None:
        """Slot ``targets[i]`` becomes a copy of slot ``sources[i]`` (its filled columns, mask and positions): a
        prompt's ``n`` samples prefilled once, in the first sample's slot."""
        if not targets:
            return
        source, target = np.asarray(sources, dtype=np.int64), np.asarray(targets, dtype=np.int64)
        width = int(self.lengths[source].max())
        device = self.mask.device
        source_index, target_index = torch.from_numpy(source).to(device), torch.from_numpy(target).to(device)
        for layer in self.layers:
            for store in (layer.kbuf, layer.vbuf):
                store[target_index, :, :width] = store[source_index, :, :width]
        self.mask[target_index] = self.mask[source_index]
        self.lengths[target] = self.lengths[source]
        self.positions[target] = self.positions[source]

    # ---------------------------------------------------------------- a forward

    def step(self, slots: np.ndarray, new_mask: torch.Tensor | None = None) -> dict:
        """Prepare a forward in which slot ``slots[b]`` appends ``Q`` columns (one when ``new_mask`` is None, a
        decode step; else ``new_mask`` ``(B, Q)``: 1 on the row's real new ids, left-padded). Returns the model
        call's keywords: the attention mask ``(B, 1, Q, width)`` bool (each position sees its row's real columns
        up to itself), position ids ``(B, Q)`` counting real tokens, this cache, and ``kv_rows``. On an empty
        slot this is its prefill (left-padded ids; a padded position sees only itself, so no row of the mask is
        empty).
        The stores are allocated at the first call, with the model's K/V dtype: the caller runs the model under
        the same autocast every time."""
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
            # Position q sees the row's columns before its new ones and its new ones up to itself; a padded position
            # sees itself too (a left-padded prefill's would see nothing: SDPA gives such a row NaN, not zeros).
            column = torch.arange(self.width, device=device)
            causal = column <= columns.unsqueeze(-1)  # (B, Q, width): `columns` holds each position's own column
            attention = ((seen.unsqueeze(1) & causal) | (column == columns.unsqueeze(-1))).unsqueeze(1)
        heads = self.kv_heads
        head_rows = rows.unsqueeze(-1) * heads + torch.arange(heads, device=device)  # (B, kv_heads)
        self.write_index = (head_rows.unsqueeze(-1) * self.capacity[1] + columns.unsqueeze(1)).reshape(-1)
        self.step_rows, self.step_mask = rows, attention
        keywords = {"attention_mask": attention, "position_ids": position_ids, "past_key_values": self,
                    "use_cache": True}
        if not self.gather:
            keywords["kv_rows"] = rows
        return keywords

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer_idx``'s new keys/values ``(B, kv_heads, Q, head_dim)`` for the step's rows, written at each
        row's columns (``step``); returns the store's first ``width`` columns, or the step's rows of them with
        ``gather``."""
        layer = self.layers[layer_idx]
        if layer.kbuf is None or layer.kbuf.dtype != key_states.dtype or layer.kbuf.device != key_states.device:
            layer.allocate(key_states, value_states, *self.capacity)  # the model's K/V dtype under autocast
        # One row copy per (row, head, position) into the store seen as (slots * kv_heads * columns, head_dim):
        # ~3x faster than advanced-index assignment over (slot, :, column).
        for store, states in ((layer.kbuf, key_states), (layer.vbuf, value_states)):
            store.view(-1, store.shape[-1]).index_copy_(0, self.write_index, states.reshape(-1, states.shape[-1]))
        keys, values = layer.kbuf[:, :, :self.width], layer.vbuf[:, :, :self.width]
        if self.gather:
            return self.gathered(keys), self.gathered(values)
        return keys, values

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0, *args, **kwargs) -> tuple[int, int]:
        return self.width, 0

    def gathered(self, store: torch.Tensor) -> torch.Tensor:
        """The step's rows of ``store`` (``gather_visible``)."""
        return gather_visible(store, self.step_rows, self.step_mask)

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

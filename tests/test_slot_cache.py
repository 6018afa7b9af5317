"""The slot KV cache (``verl/models/slot_cache.py``) on a real model: sequences keep their slot while others step,
wait, extend by a left-padded block, end and hand their slot to a new sequence, and every forward's logits are the
sequence's own full forward, whichever attention path reads the store."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verl.models.attention import NAME
from verl.models.loader import load_causal_lm, resolve_model_path
from verl.models.slot_cache import SlotCache


@pytest.fixture(scope="module")
def model():
    model = load_causal_lm(resolve_model_path("builtin:tiny-agent")).eval()
    assert model.config._attn_implementation == NAME  # verl's CPU attention: slots are read in place
    return model


def full_forward_logits(model, sequence: list[int]) -> torch.Tensor:
    """The last position's logits of a forward over ``sequence`` with no cache and no padding ``(vocab,)``."""
    out = model(input_ids=torch.tensor([sequence]), use_cache=False)
    return out.logits[0, -1]


@pytest.mark.parametrize("path", ["kernel", "sdpa over gathered rows", "transformers' sdpa (gather)"])
def test_every_forward_on_slots_is_each_sequences_full_forward(model, path, monkeypatch) -> None:
    """Left-padded prefills into slots, a slot copied (a prompt's samples), decode steps over subsets of the slots
    in any order (a waiting slot is not touched), an extend of two slots by a left-padded block (its padding stays
    inside the row, masked), slots released and reused: at every forward each row's logits equal the full forward
    over that sequence's real ids. The store starts too small in both slots and columns (it grows), and memory
    that was never written holds NaN, which no path may read."""
    monkeypatch.setenv("VERL_DECODE_KERNEL", "0" if path == "sdpa over gathered rows" else "1")
    gather = path.startswith("transformers")
    if gather:
        monkeypatch.setattr(model.config, "_attn_implementation", "sdpa")
    generator = torch.Generator().manual_seed(0)
    sequences: dict[int, list[int]] = {}  # slot -> the real ids its row holds, then its pending next id
    store = SlotCache(model.config, slots=2, columns=8, gather=gather)

    def check(logits: torch.Tensor, slots: list[int]) -> None:
        for row, slot in enumerate(slots):
            torch.testing.assert_close(logits[row], full_forward_logits(model, sequences[slot]), atol=1e-4,
                                       rtol=1e-4)

    def prefill(prompts: list[list[int]]) -> list[int]:
        """Left-padded prompts into fresh slots (a padded position sees only itself), the first prompt's slot
        then copied into one more slot (a prompt's samples share a prefill)."""
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        slots = store.allocate(len(prompts))
        out = model(input_ids=ids, logits_to_keep=1, **store.step(np.array(slots), mask))
        for slot, prompt in zip(slots, prompts, strict=True):
            sequences[slot] = list(prompt)
        check(out.logits[:, -1], slots)
        return slots

    def poison() -> None:
        """Never-written memory: every column past a slot's length, and free slots, NaN."""
        for layer in store.layers:
            for buffer in (layer.kbuf, layer.vbuf):
                for slot in range(store.capacity[0]):
                    buffer[slot, :, store.lengths[slot]:] = float("nan")

    def decode(slots: list[int]) -> None:
        tokens = torch.randint(10, 60, (len(slots),), generator=generator)
        for slot, token in zip(slots, tokens.tolist(), strict=True):
            sequences[slot].append(token)
        out = model(input_ids=tokens.unsqueeze(-1), **store.step(np.array(slots)))
        check(out.logits[:, -1], slots)

    def extend(slots: list[int], counts: list[int]) -> None:
        width = max(counts)
        new = [torch.randint(10, 60, (n,), generator=generator).tolist() for n in counts]
        ids = torch.tensor([[0] * (width - len(n)) + n for n in new])
        new_mask = torch.tensor([[0] * (width - len(n)) + [1] * len(n) for n in new])
        for slot, ids_added in zip(slots, new, strict=True):
            sequences[slot] += ids_added
        out = model(input_ids=ids, logits_to_keep=1, **store.step(np.array(slots), new_mask))
        check(out.logits[:, -1], slots)

    with torch.no_grad():
        first = prefill([torch.randint(10, 60, (n,), generator=generator).tolist() for n in (9, 5)])
        poison()
        decode(first[::-1])
        sibling = store.allocate(1)  # the store grows: 2 -> 4 slots
        store.copy([first[0]], sibling)
        sequences[sibling[0]] = list(sequences[first[0]])
        decode([sibling[0], first[1]])
        store.release(sibling)
        del sequences[sibling[0]]
        third = prefill([torch.randint(10, 60, (3,), generator=generator).tolist()])
        assert store.capacity[0] >= 3 and third == sibling  # the freed slot, emptied
        poison()
        waiting = first[1]
        before = [(layer.kbuf[waiting].clone(), layer.vbuf[waiting].clone()) for layer in store.layers]
        length = store.lengths[waiting]
        for _ in range(2):
            decode([third[0], first[0]])  # first[1] waits for its tools
        for layer, (keys, values) in zip(store.layers, before, strict=True):
            assert torch.equal(layer.kbuf[waiting, :, :length], keys[:, :length])
            assert torch.equal(layer.vbuf[waiting, :, :length], values[:, :length])
        assert store.lengths[waiting] == length
        extend([waiting, third[0]], [6, 2])  # 4 padded columns stay inside third[0]'s row
        poison()
        for _ in range(3):  # past the first 8 columns: the store grows its columns
            decode([first[0], waiting, third[0]])
        assert store.capacity[1] > 8
        store.release([first[0]])
        del sequences[first[0]]
        fourth = prefill([torch.randint(10, 60, (4,), generator=generator).tolist()])
        assert fourth == [first[0]]  # the freed slot, its old contents masked out by the new mask
        poison()
        decode([fourth[0], third[0], waiting])
        extend([fourth[0]], [5])


def test_a_store_is_reset_and_reused_when_it_fits(model) -> None:
    store = SlotCache(model.config, slots=4, columns=16)
    assert store.allocate(3) == [0, 1, 2]
    assert store.fits(4, 16, gather=False) and not store.fits(5, 16, gather=False)
    assert not store.fits(4, 17, gather=False) and not store.fits(4, 16, gather=True)
    store.reset()
    assert store.allocate(4) == [0, 1, 2, 3]



def test_a_released_store_is_freed_at_once_not_by_the_cyclic_collector(model) -> None:
    """The store is hundreds of MB on a real model: the last reference going must free it (a layer pointing back
    at its cache made a cycle, and SmolLM2's validation store outlived its rollout into the update)."""
    import gc
    import weakref

    store = SlotCache(model.config, slots=2, columns=8)
    slots = store.allocate(1)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([[11, 12, 13]]), **store.step(np.array(slots), torch.ones(1, 3)))
    alive = weakref.ref(store.layers[0].kbuf)
    gc.disable()
    try:
        del store, out
        assert alive() is None
    finally:
        gc.enable()

"""The CPU decode-attention kernel (``verl/models/decode_attention.py``): the same attention as torch's SDPA for one
query position (grouped heads, left padding, strided cache views, no mask) or a few under a causal mask, used by
every decode step and extend of the engines, and out of the way wherever it does not apply."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.decode_utils import left_padded_prompts, prefill_then_decode
from tests.kernels import require_kernels
from verl.models import decode_attention as kernel
from verl.models.attention import NAME
from verl.models.loader import load_causal_lm, resolve_model_path


def left_padding_mask(rows: int, columns: int, generator: torch.Generator) -> torch.Tensor:
    """(rows, 1, 1, columns) bool: each row's last 1..columns columns are real."""
    lengths = torch.randint(1, columns + 1, (rows,), generator=generator)
    lengths[0] = columns  # one row uses every column
    return (torch.arange(columns)[None, :] >= (columns - lengths)[:, None])[:, None, None, :]


@pytest.mark.parametrize(("rows", "heads", "kv_heads", "columns", "head_dim"),
                         [(7, 4, 4, 33, 32), (5, 9, 3, 70, 64), (1, 2, 1, 5, 128), (16, 8, 2, 1, 64)])
def test_kernel_equals_sdpa_on_padded_grouped_strided_caches(rows, heads, kv_heads, columns, head_dim) -> None:
    require_kernels()
    generator = torch.Generator().manual_seed(rows * 100 + columns)
    # As the KV cache holds them: views of buffers with spare columns (and a spare row) after the used ones.
    key_buffer = torch.randn(rows + 1, kv_heads, columns + 9, head_dim, generator=generator)
    value_buffer = torch.randn(rows + 1, kv_heads, columns + 9, head_dim, generator=generator)
    key, value = key_buffer[:rows, :, 3:columns + 3], value_buffer[:rows, :, 3:columns + 3]
    query = torch.randn(rows, 1, heads, head_dim, generator=generator).transpose(1, 2)  # as the module builds it
    mask = left_padding_mask(rows, columns, generator)
    scale = head_dim ** -0.5
    with torch.no_grad():
        out = kernel.decode_attention(query, key, value, mask, scale)
        reference = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale,
                                                   enable_gqa=heads != kv_heads)
        assert out is not None and out.shape == (rows, 1, heads, head_dim)
        torch.testing.assert_close(out, reference.transpose(1, 2), atol=2e-6, rtol=1e-5)
        # Padding is skipped, not computed: garbage (even NaN) in masked columns does not reach the output.
        key_buffer[:rows, :, 3:columns + 3][~mask[:, 0, 0, :].unsqueeze(1).expand(rows, kv_heads, columns)] = \
            float("nan")
        torch.testing.assert_close(kernel.decode_attention(query, key, value, mask, scale), out)
        unmasked = kernel.decode_attention(query, key_buffer[:rows, :, columns + 3:columns + 9],
                                           value_buffer[:rows, :, columns + 3:columns + 9], None, scale)
        expected = F.scaled_dot_product_attention(query, key_buffer[:rows, :, columns + 3:columns + 9],
                                                  value_buffer[:rows, :, columns + 3:columns + 9], scale=scale,
                                                  enable_gqa=heads != kv_heads)
        torch.testing.assert_close(unmasked, expected.transpose(1, 2), atol=2e-6, rtol=1e-5)
        threads = torch.get_num_threads()
        torch.set_num_threads(2)  # the (row, head) blocks split across threads: the same result
        try:
            torch.testing.assert_close(kernel.decode_attention(query, key, value, mask, scale), out)
        finally:
            torch.set_num_threads(threads)


@pytest.mark.parametrize(("rows", "heads", "kv_heads", "positions", "columns", "head_dim"),
                         [(7, 4, 4, 3, 33, 32), (5, 9, 3, 9, 70, 64), (3, 2, 1, 16, 20, 128)])
def test_a_few_query_positions_per_row_attend_as_their_mask_rows_say(rows, heads, kv_heads, positions, columns,
                                                                      head_dim) -> None:
    """An extend (a tool turn fed into rows' caches): each row's new ids attend causally to each other and to the
    row's real cached columns; each query position follows its own mask row, as SDPA does."""
    require_kernels()
    generator = torch.Generator().manual_seed(rows * 100 + positions)
    key_buffer = torch.randn(rows + 1, kv_heads, columns + 5, head_dim, generator=generator)
    value_buffer = torch.randn(rows + 1, kv_heads, columns + 5, head_dim, generator=generator)
    key, value = key_buffer[:rows, :, 2:columns + 2], value_buffer[:rows, :, 2:columns + 2]
    query = torch.randn(rows, positions, heads, head_dim, generator=generator).transpose(1, 2)
    padding = left_padding_mask(rows, columns, generator)[:, 0, 0, :]
    padding[:, columns - positions:] = True  # the new ids are real
    causal = torch.arange(columns)[None, :] <= (columns - positions + torch.arange(positions))[:, None]
    mask = (padding[:, None, :] & causal[None]).unsqueeze(1)  # (rows, 1, positions, columns)
    scale = head_dim ** -0.5
    with torch.no_grad():
        out = kernel.decode_attention(query, key, value, mask, scale)
        reference = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale,
                                                   enable_gqa=heads != kv_heads)
        assert out is not None and out.shape == (rows, positions, heads, head_dim)
        torch.testing.assert_close(out, reference.transpose(1, 2), atol=2e-6, rtol=1e-5)
        # A later position's column is masked for an earlier one: NaN there reaches only the positions that see it.
        key_buffer[:rows, :, columns + 1] = float("nan")
        poisoned = kernel.decode_attention(query, key, value, mask, scale)
        assert torch.equal(poisoned[:, :-1], out[:, :-1]) and poisoned[:, -1].isnan().all()


@pytest.mark.parametrize(("positions", "heads", "kv_heads", "head_dim"), [(1, 4, 4, 32), (1, 9, 3, 64), (5, 2, 1, 128)])
def test_rows_name_the_cache_rows_each_query_row_reads(positions, heads, kv_heads, head_dim) -> None:
    """A slot cache's step (``rows``): query row ``b`` attends to store row ``rows[b]``, in any order, skipping the
    store's other rows, exactly as the kernel over those rows gathered; a row outside the store is an error."""
    require_kernels()
    generator = torch.Generator().manual_seed(positions * 10 + heads)
    slots, columns, count = 9, 24, 4
    key = torch.randn(slots, kv_heads, columns + 6, head_dim, generator=generator)[:, :, :columns]
    value = torch.randn(slots, kv_heads, columns + 6, head_dim, generator=generator)[:, :, :columns]
    rows = torch.tensor([7, 2, 5, 0])
    query = torch.randn(count, positions, heads, head_dim, generator=generator).transpose(1, 2)
    mask = torch.rand(count, 1, positions, columns, generator=generator) < 0.7
    mask[..., 0] = True
    with torch.no_grad():
        out = kernel.decode_attention(query, key, value, mask, 0.125, rows=rows)
        gathered = kernel.decode_attention(query, key[rows], value[rows], mask, 0.125)
        reference = F.scaled_dot_product_attention(query, key[rows], value[rows], attn_mask=mask, scale=0.125,
                                                   enable_gqa=heads != kv_heads)
        assert out is not None and torch.equal(out, gathered)
        torch.testing.assert_close(out, reference.transpose(1, 2), atol=2e-6, rtol=1e-5)
        others = torch.tensor([i for i in range(slots) if i not in rows.tolist()])
        key[others], value[others] = float("nan"), float("nan")  # rows no query names are never read
        assert torch.equal(kernel.decode_attention(query, key, value, mask, 0.125, rows=rows), out)
        with pytest.raises(RuntimeError, match="outside the cache"):
            require_kernels().decode_attention(query, key, value, mask, 0.125, torch.tensor([0, 1, 2, slots]))


def test_kernel_steps_aside_where_it_does_not_apply(monkeypatch) -> None:
    require_kernels()
    query, key = torch.randn(2, 4, 1, 32), torch.randn(2, 4, 6, 32)
    mask = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    with torch.no_grad():
        assert kernel.decode_attention(query, key, key, mask, 0.1) is not None
        assert kernel.decode_attention(torch.randn(2, 4, 3, 32), key, key, None, 0.1) is None  # 3, no mask
        assert kernel.decode_attention(torch.randn(2, 4, 3, 32), key, key, mask, 0.1) is None  # a 1-position mask
        many = kernel.MAX_QUERY_POSITIONS + 1  # a prefill: the flash kernel's GEMMs
        assert kernel.decode_attention(torch.randn(2, 4, many, 32), key, key,
                                       torch.ones(2, 1, many, 6, dtype=torch.bool), 0.1) is None
        assert kernel.decode_attention(query.double(), key.double(), key.double(), mask, 0.1) is None
        assert kernel.decode_attention(query, key, key, torch.zeros(2, 1, 1, 6), 0.1) is None  # a float mask
        assert kernel.decode_attention(torch.randn(2, 4, 1, 48), torch.randn(2, 4, 6, 48),
                                       torch.randn(2, 4, 6, 48), mask, 0.1) is None  # head_dim not compiled
    trainable = query.clone().requires_grad_()
    assert kernel.decode_attention(trainable, key, key, mask, 0.1) is None  # no backward: autograd goes to SDPA
    monkeypatch.setenv("VERL_DECODE_KERNEL", "0")
    with torch.no_grad():
        assert kernel.decode_attention(query, key, key, mask, 0.1) is None


@pytest.mark.parametrize("model_name", ["builtin:tiny-arith", "builtin:tiny-agent"])
def test_every_decode_step_of_a_loaded_model_runs_the_kernel_with_sdpas_logits(model_name, monkeypatch) -> None:
    """Through ``load_causal_lm`` (trainer, eval, serving): the decode forwards (one new token per row over a
    left-padded cache) and a short prefill call the kernel once per layer, and their logits are SDPA's to float
    rounding."""
    require_kernels()
    model = load_causal_lm(resolve_model_path(model_name)).eval()
    assert model.config._attn_implementation == NAME
    calls = []
    original = kernel.decode_attention

    def counting(*args):
        out = original(*args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr("verl.models.attention.decode_attention", counting)
    ids, mask = left_padded_prompts()

    def decode(kernel_on: str) -> torch.Tensor:
        monkeypatch.setenv("VERL_DECODE_KERNEL", kernel_on)
        with torch.no_grad():
            return prefill_then_decode(model, ids, mask)  # the prefill's last position, then the decode steps

    with_kernel = decode("1")
    layers = model.config.num_hidden_layers
    # Every decode step, every layer, and the 9-id prefill (within MAX_QUERY_POSITIONS, its rows left-padded).
    assert calls.count(True) == 5 * layers
    calls.clear()
    without = decode("0")
    assert not any(calls)
    torch.testing.assert_close(with_kernel, without, atol=1e-5, rtol=1e-5)


def test_a_decode_steps_mask_is_the_padding_mask_without_broadcasting(monkeypatch) -> None:
    """The mask a decode step gets (one query position after every cached column) is ``sdpa_mask``'s, taken from the
    2-D padding mask as a view; prefill, several positions and a query before some columns build it the general way."""
    from transformers.masking_utils import sdpa_mask

    from verl.models import attention

    generator = torch.Generator().manual_seed(3)
    padding = torch.rand(5, 12, generator=generator) > 0.3
    padding[:, -1] = True  # the new token is real
    general = []
    monkeypatch.setattr(attention, "sdpa_mask", lambda *args, **kwargs: general.append(args) or sdpa_mask(
        *args, **kwargs))
    for q_offset, kv_offset, kv_length in ((11, 0, 12), (20, 0, 12), (11, 2, 10)):
        mask = attention.cpu_sdpa_mask(5, 1, kv_length, q_offset=q_offset, kv_offset=kv_offset,
                                       attention_mask=padding, allow_is_causal_skip=False)
        expected = sdpa_mask(5, 1, kv_length, q_offset=q_offset, kv_offset=kv_offset, attention_mask=padding,
                             allow_is_causal_skip=False)
        assert torch.equal(mask, expected) and mask.data_ptr() == padding.data_ptr() + kv_offset  # a view
    assert not general
    attention.cpu_sdpa_mask(5, 1, 12, q_offset=5, attention_mask=padding)  # a query before some columns
    attention.cpu_sdpa_mask(5, 3, 12, q_offset=9, attention_mask=padding)  # several positions
    assert len(general) == 2


def test_a_loaded_models_decode_steps_skip_the_general_mask_builder(monkeypatch) -> None:
    """Through ``load_causal_lm``: the prefill builds its mask the general way, the decode steps do not, and the
    logits are those of transformers' own ``sdpa`` mask builder."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    from verl.models import attention

    model = load_causal_lm(resolve_model_path("builtin:tiny-agent")).eval()
    general = []
    monkeypatch.setattr(attention, "sdpa_mask", lambda *args, **kwargs: general.append(args) or sdpa_mask(
        *args, **kwargs))
    ids, mask = left_padded_prompts()
    with torch.no_grad():
        fast = prefill_then_decode(model, ids, mask)
    assert len(general) == 1  # the prefill
    monkeypatch.setitem(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, NAME, sdpa_mask)
    with torch.no_grad():
        reference = prefill_then_decode(model, ids, mask)
    assert torch.equal(fast, reference)

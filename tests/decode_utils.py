"""A prefill then decode steps through the engines' growing KV cache, for tests comparing two attention or layer
paths on the same model."""

from __future__ import annotations

import torch

from verl.models.kv_cache import new_growing_cache


def left_padded_prompts(rows: int = 3, length: int = 9, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``(rows, length)`` and a left-padding mask: row 1 has 4 padded columns, row 2 has 7."""
    ids = torch.randint(10, 60, (rows, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    mask[2, :7] = 0
    return ids, mask


def prefill_then_decode(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, steps: int = 4) -> torch.Tensor:
    """The last position's logits of the prefill and of ``steps`` one-token decode steps, ``(steps + 1, rows,
    vocab)``; the caller sets the grad / inference mode and any context the paths under test read."""
    rows = ids.shape[0]
    cache = new_growing_cache(model.config)
    out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                past_key_values=cache, use_cache=True)
    logits = [out.logits[:, -1]]
    for step in range(steps):
        mask = torch.cat([mask, torch.ones(rows, 1, dtype=mask.dtype)], dim=1)
        out = model(input_ids=torch.full((rows, 1), 20 + step), attention_mask=mask,
                    position_ids=mask.sum(-1, keepdim=True) - 1, past_key_values=cache, use_cache=True)
        logits.append(out.logits[:, -1])
    return torch.stack(logits)

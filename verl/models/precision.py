"""Float widths: logits and log-probs are computed at least in float32, and in float64 for a float64 model.

``model.dtype=float64`` is for numerical checks on CPU (for example, that two executors differ only by
rounding); bf16/fp16 models upcast their logits to float32 before any softmax, as before.
"""

from __future__ import annotations

import contextlib

import torch

LOW_PRECISION = (torch.float16, torch.bfloat16)


def at_least_float32(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in float32 if it is a half-width float, else unchanged (float32 stays, float64 stays)."""
    return tensor.float() if tensor.dtype in LOW_PRECISION else tensor


def autocast_context(device: torch.device, dtype: torch.dtype | None):
    """``torch.autocast`` to ``dtype`` on ``device``'s type (``model.autocast_dtype``); no autocast for None."""
    return contextlib.nullcontext() if dtype is None else torch.autocast(device_type=device.type, dtype=dtype)

"""Forward passes shared by actor, reference and critic: per-token log-probs, entropy and values.

Only the last ``response_len + 1`` positions go through the LM head (``logits_to_keep``): the prompt's logits
are never needed, and on small models the head is a large share of the compute.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from verl.algos.losses import entropy_from_logits


def autocast_context(device: torch.device, dtype: torch.dtype | None):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def response_log_probs(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    temperature: float = 1.0,
    with_entropy: bool = False,
    autocast_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``responses`` under ``model`` at ``temperature``: ``(batch, response_len)`` (+ entropy).

    ``batch`` holds ``input_ids``/``attention_mask``/``position_ids`` ``(batch, prompt_len + response_len)`` and
    ``responses`` ``(batch, response_len)``. Logits are divided by the sampling temperature so the log-probs are
    those of the distribution the rollout sampled from.
    """
    responses = batch["responses"]
    width = responses.shape[1]
    device = responses.device
    with autocast_context(device, autocast_dtype):
        out = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
            logits_to_keep=width + 1,
            use_cache=False,
        )
    logits = out.logits[:, -width - 1 : -1, :].float()
    if temperature != 1.0:
        logits = logits / temperature
    log_probs = torch.gather(F.log_softmax(logits, dim=-1), -1, responses.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        entropy = entropy_from_logits(logits)
    return log_probs, entropy


def response_values(
    critic: torch.nn.Module, batch: dict[str, torch.Tensor], autocast_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Critic values ``(batch, response_len)``: V at the state before each response token."""
    width = batch["responses"].shape[1]
    with autocast_context(batch["responses"].device, autocast_dtype):
        out = critic(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
            use_cache=False,
        )
    return out.logits[:, -width - 1 : -1, 0].float()

"""The reference role: log-probs under the frozen initial policy.

With LoRA the reference is the same module with its adapters disabled, so no second copy of the weights is
held; otherwise it is a frozen copy loaded from ``model.path`` (optionally kept on CPU).
"""

from __future__ import annotations

import contextlib

import torch

from verl.models.packed_linear import packed_weights
from verl.protocol import DataProto
from verl.workers.forward import response_log_probs

MODEL_KEYS = ("input_ids", "attention_mask", "position_ids", "responses", "prompts")


class Reference:
    def __init__(self, model: torch.nn.Module, temperature: float, micro_batch_size: int | None = None,
                 adapters_disabled: bool = False, autocast_dtype: torch.dtype | None = None, group_size: int = 1,
                 remove_padding: bool = False):
        self.model = model
        self.remove_padding = remove_padding  # packed sequences (verl/models/packed_sequences.py)
        self.group_size = group_size
        self.temperature = temperature
        self.micro_batch_size = micro_batch_size
        self.adapters_disabled = adapters_disabled
        self.autocast_dtype = autocast_dtype
        if not adapters_disabled:
            model.eval()
            model.requires_grad_(False)

    def weights(self):
        """Context in which ``self.model`` computes the reference policy (LoRA: adapters disabled)."""
        return self.model.disable_adapter() if self.adapters_disabled else contextlib.nullcontext()

    @torch.no_grad()
    def compute_ref_log_prob(self, data: DataProto) -> torch.Tensor:
        """``(batch, response_len)`` log-probs of the responses under the reference policy."""
        device = next(self.model.parameters()).device
        was_training = self.model.training
        self.model.eval()
        parts = []
        # With LoRA the actor's frozen base multiplies by packed weights (Actor.update_policy) and the reference is
        # that base, so it does too: an untrained policy's log-probs equal the reference's bit for bit. A separate
        # reference model keeps F.linear, as a fully trained actor's trainable layers do.
        packing = packed_weights() if self.adapters_disabled else contextlib.nullcontext()
        with self.weights(), packing:
            for micro in data.split(self.micro_batch_size) if self.micro_batch_size else [data]:
                batch = {k: micro.batch[k].to(device) for k in MODEL_KEYS}
                log_probs, _ = response_log_probs(self.model, batch, self.temperature,
                                                  autocast_dtype=self.autocast_dtype, group_size=self.group_size,
                                                  remove_padding=self.remove_padding)
                parts.append(log_probs.cpu())
        self.model.train(was_training)
        return torch.cat(parts)

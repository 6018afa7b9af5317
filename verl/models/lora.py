"""LoRA through ``peft``: adapters on the actor; the reference is the base model with adapters disabled."""

from __future__ import annotations

import copy

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model

from verl.config import LoraConfig
from verl.models.patches import LORA_PATCH


def apply_lora(model: torch.nn.Module, config: LoraConfig) -> torch.nn.Module:
    peft_config = PeftLoraConfig(r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout,
                                 target_modules=config.target_modules, task_type="CAUSAL_LM")
    model = get_peft_model(model, peft_config)
    # Each adapted layer as one autograd node, the adapter's term summed inside a GEMM (CPU fp32; peft's own
    # forward elsewhere); see verl/models/fused_lora.py.
    LORA_PATCH.apply(model)
    return model


def is_lora(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def merged_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A plain HF model with the adapters folded in (for export and weight sync to engines)."""
    return copy.deepcopy(model).merge_and_unload() if is_lora(model) else model

"""Model weights in a checkpoint directory: read the full state dict, or load it (or LoRA adapter weights) into a
model. Model-level IO, so role workers and the trainer's checkpoint code share it without importing the trainer."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import set_peft_model_state_dict
from safetensors.torch import load_file

from verl.errors import CheckpointError


def read_model_weights(path: Path) -> dict[str, torch.Tensor]:
    """The full-weight state dict saved in a checkpoint dir (``model.safetensors``)."""
    weights = path / "model.safetensors"
    if not weights.is_file():
        raise CheckpointError(f"{path} has no model.safetensors")
    return load_file(weights)


def load_model_weights(model: torch.nn.Module, path: Path) -> None:
    """Load ``model.safetensors`` (or adapter weights for a PEFT model) from a checkpoint into ``model``."""
    if hasattr(model, "peft_config"):
        adapter = path / "adapter_model.safetensors"
        if not adapter.is_file():
            raise CheckpointError(f"{path} has no adapter_model.safetensors to resume a LoRA run from")
        set_peft_model_state_dict(model, load_file(adapter))
        return
    weights = path / "model.safetensors"
    if not weights.is_file():
        raise CheckpointError(f"{path} has no model.safetensors")
    state = load_file(weights)
    missing, unexpected = model.load_state_dict(state, strict=False)
    # Tied embeddings are saved once; anything else missing means the checkpoint is for another model.
    missing = [k for k in missing if "lm_head" not in k]
    if missing or unexpected:
        raise CheckpointError(
            f"{weights} does not match the model (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )

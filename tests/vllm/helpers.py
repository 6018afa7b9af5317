"""Shared pieces of the vLLM test group: skip cleanly where vllm is absent, engine settings, process checks."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import psutil
import torch

# Prompts are <= 64 tokens and tests generate <= 32; the built-in models allow 256 positions.
MAX_MODEL_LEN = 128


def engine_processes() -> list[psutil.Process]:
    """This process's live vLLM children (EngineCore and Worker), found by their process titles."""
    out = []
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if child.status() != psutil.STATUS_ZOMBIE and "VLLM" in " ".join([child.name(), *child.cmdline()]):
                out.append(child)
    return out


@contextlib.contextmanager
def restored_weights(model: torch.nn.Module, engine) -> Iterator[None]:
    """Let a test change ``model``'s weights (and the engine's); put both back afterwards for later tests."""
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    try:
        yield
    finally:
        model.load_state_dict(saved)
        engine.sync_weights(model)

"""Seeding and RNG state capture, so a resumed run continues the same random stream."""

from __future__ import annotations

import random

import numpy as np
import torch

from verl.utils.allocator import keep_freed_memory


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def set_num_threads(num_threads: int) -> None:
    """Pin torch's intra-op threads; 0 keeps torch's default. One thread is fastest on small shared CPUs.

    Every computing process (trainer, rollout process, Ray worker) calls this first, so it also keeps freed
    tensor memory in the heap (``verl.utils.allocator``)."""
    keep_freed_memory()
    if num_threads > 0:
        torch.set_num_threads(num_threads)

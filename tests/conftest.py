"""Shared fixtures: one torch thread, a repo-local model/data cache, tiny built-in models."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Built-in models and datasets are materialised once into the repo-local cache and reused across tests.
os.environ.setdefault("VERL_CACHE_DIR", str(REPO / ".cache"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def tiny_base_dir() -> str:
    """A randomly initialised built-in model dir (no training): fast to build, deterministic."""
    from verl.models.loader import resolve_model_path

    return resolve_model_path("builtin:tiny-arith-base")


@pytest.fixture(scope="session")
def warm_start_dir() -> str:
    """The shipped SFT warm start (``builtin:tiny-arith``)."""
    from verl.models.loader import resolve_model_path

    return resolve_model_path("builtin:tiny-arith")

"""Module-scoped ``tokenizer`` and ``model`` fixtures of one built-in model, for the modules that roll it out."""

from __future__ import annotations

import pytest
import torch

from verl.models.loader import load_causal_lm, load_tokenizer


def model_fixtures(name: str):
    """``tokenizer, model = model_fixtures("builtin:tiny-agent")`` at a module's top: both loaded once per module,
    the model in eval mode with torch's seed set first (its dropout-free init is then the same in every module)."""

    @pytest.fixture(scope="module")
    def tokenizer():
        return load_tokenizer(name)

    @pytest.fixture(scope="module")
    def model():
        torch.manual_seed(0)
        return load_causal_lm(name).eval()

    return tokenizer, model

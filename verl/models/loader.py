"""Resolve model paths (HF dirs, hub ids, ``builtin:NAME``) and load models and tokenizers.

Built-in models are ordinary HF model directories:

- ``builtin:tiny-arith``: the shipped SFT warm start for the arithmetic task (``verl/models/assets``), produced
  by ``verl sft --config configs/sft_tiny.yaml``. If the asset is missing it is trained on first use and cached.
- ``builtin:tiny-arith-base`` / ``builtin:small-arith-base``: randomly initialised models (seeded), written to
  the cache on first use.

Everything downstream calls ``from_pretrained`` on the resolved directory, so a built-in model and a Qwen
checkpoint take the same code path.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from verl.errors import ModelError
from verl.models.tiny import BUILTIN_SPECS, build_char_tokenizer, build_tiny_model
from verl.utils.fs import atomic_dir

BUILTIN_PREFIX = "builtin:"
ASSETS_DIR = Path(__file__).parent / "assets"
SHIPPED_MODELS = ("tiny-arith",)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cache_dir() -> Path:
    return Path(os.environ.get("VERL_CACHE_DIR", Path.home() / ".cache" / "verl-suite"))


def builtin_names() -> list[str]:
    return sorted([*SHIPPED_MODELS, *BUILTIN_SPECS])


def resolve_model_path(path: str) -> str:
    """A local directory (or hub id) for ``path``; builtin models are materialised on first use."""
    if not path.startswith(BUILTIN_PREFIX):
        local = Path(path).expanduser()
        if local.exists():
            if not (local / "config.json").is_file():
                raise ModelError(f"model path '{path}' exists but has no config.json; point it at a HF model dir")
            return str(local)
        if path.startswith((".", "/", "~")) or os.sep in path.strip("/").split("/", 1)[-1]:
            raise ModelError(f"model path '{path}' does not exist")
        return path  # a hub id: from_pretrained resolves it (offline machines need a local copy)
    name = path[len(BUILTIN_PREFIX) :]
    if name in SHIPPED_MODELS:
        shipped = ASSETS_DIR / name
        if (shipped / "model.safetensors").is_file():
            return str(shipped)
        return str(_build_warm_start(name))
    if name in BUILTIN_SPECS:
        target = cache_dir() / "models" / name
        if not (target / "model.safetensors").is_file():
            tokenizer = build_char_tokenizer()
            model = build_tiny_model(tokenizer, BUILTIN_SPECS[name], seed=0)
            with atomic_dir(target, overwrite=True) as tmp:
                model.save_pretrained(tmp)
                tokenizer.save_pretrained(tmp)
        return str(target)
    available = ", ".join(BUILTIN_PREFIX + n for n in builtin_names())
    raise ModelError(f"unknown built-in model '{path}'; available: {available}")


def _build_warm_start(name: str) -> Path:
    """Train the SFT warm start into the cache (only when the shipped asset is missing)."""
    target = cache_dir() / "models" / name
    if (target / "model.safetensors").is_file():
        return target
    from verl.trainer.sft import train_builtin_warm_start

    train_builtin_warm_start(target)
    return target


def load_tokenizer(path: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    local = resolve_model_path(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(local, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot load a tokenizer from '{path}': {exc}") from None
    if tokenizer.pad_token is None:
        # Causal LMs often ship without a pad token; eos is the conventional stand-in.
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def load_causal_lm(
    path: str, dtype: str = "float32", device: str | torch.device = "cpu", trust_remote_code: bool = False
) -> PreTrainedModel:
    local = resolve_model_path(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            local, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code, use_safetensors=True
        )
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot load a causal LM from '{path}': {exc}") from None
    return model.to(device)


def pick_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ModelError("trainer.device=cuda but no CUDA device is available; use trainer.device=cpu")
    return torch.device(name)

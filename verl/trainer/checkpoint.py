"""Checkpoints: HF model directories written atomically, a ``latest`` pointer, retention, resume.

Layout of ``<run>/checkpoints/global_step_<N>/``:

- the HF model (``config.json``, ``model.safetensors``, ``generation_config.json``) and tokenizer files, so
  ``AutoModelForCausalLM.from_pretrained`` and vLLM load the directory as it is (with LoRA: the adapter files);
- ``critic/``: the critic as an HF token-classification model, when there is one;
- ``actor_state.pt`` / ``critic_state.pt``: optimizer, scheduler and shuffle state of the roles (per rank
  ``actor_state_rank<r>.pt`` under FSDP);
- ``trainer_state.pt``: the driver's state: step, data position, KL controller, RNG;
- ``meta.json``: step, time, metrics at save time, and ``files``: the size and SHA-256 of every other file, so a
  checkpoint damaged after it was written (a full disk, a copy cut short) is recognised before it is loaded.

A checkpoint is assembled in a ``.tmp-*`` sibling and renamed when complete; ``latest`` (a text file naming the
directory) is updated last. A crash therefore never leaves a partial ``global_step_*`` that resume would pick; one
damaged later is skipped by ``trainer.resume=auto`` with a warning naming it, and the newest intact one is used.
Retention (``max_ckpt_to_keep``) never deletes the checkpoint that ``latest`` or ``best`` names.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from verl.errors import CheckpointError
from verl.utils.fs import atomic_dir, atomic_write_json, atomic_write_text, sha256_file
from verl.utils.log import say_once

STEP_DIR = re.compile(r"^global_step_(\d+)$")
TRAINER_STATE = "trainer_state.pt"
META = "meta.json"


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run, oldest first."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = STEP_DIR.match(child.name)
        if match and child.is_dir() and (child / META).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def read_pointer(run_dir: str | Path, name: str = "latest") -> Path | None:
    pointer = checkpoint_root(run_dir) / name
    if not pointer.is_file():
        return None
    target = checkpoint_root(run_dir) / pointer.read_text().strip()
    return target if (target / META).is_file() else None


def write_pointer(run_dir: str | Path, target: Path, name: str = "latest") -> None:
    atomic_write_text(checkpoint_root(run_dir) / name, target.name + "\n")


def write_checkpoint(run_dir: str | Path, step: int, write_parts: Callable[[Path], None], trainer_state: dict[str, Any],
                     metrics: dict[str, float] | None = None, max_to_keep: int | None = None) -> Path:
    """Assemble ``global_step_<step>`` atomically: ``write_parts(tmp)`` writes the model(s) and role states,
    then the trainer state and ``meta.json``; the directory is renamed into place, ``latest`` updated last,
    then retention applied."""
    target = checkpoint_root(run_dir) / f"global_step_{step}"
    with atomic_dir(target, overwrite=True) as tmp:
        write_parts(tmp)
        torch.save(trainer_state, tmp / TRAINER_STATE)
        atomic_write_json(tmp / META, {"step": step, "time": time.time(), "metrics": metrics or {},
                                       "files": file_manifest(tmp)})
    write_pointer(run_dir, target)
    if max_to_keep:
        apply_retention(run_dir, max_to_keep)
    return target


def save_checkpoint(run_dir: str | Path, step: int, model: torch.nn.Module, tokenizer: Any,
                    trainer_state: dict[str, Any], metrics: dict[str, float] | None = None,
                    max_to_keep: int | None = None) -> Path:
    """A checkpoint of one model and its tokenizer (the SFT trainer's)."""

    def write_parts(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)

    return write_checkpoint(run_dir, step, write_parts, trainer_state, metrics, max_to_keep)


def apply_retention(run_dir: str | Path, max_to_keep: int) -> list[Path]:
    """Delete the oldest checkpoints beyond ``max_to_keep``, never the ``latest`` or ``best`` one."""
    protected = {p for p in (read_pointer(run_dir, "latest"), read_pointer(run_dir, "best")) if p is not None}
    checkpoints = [path for _, path in list_checkpoints(run_dir)]
    removable = [p for p in checkpoints if p not in protected]
    excess = len(checkpoints) - max_to_keep
    removed = []
    for path in removable[: max(0, excess)]:
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def remove_stale_temp_dirs(run_dir: str | Path) -> list[Path]:
    """Delete ``.tmp-*`` leftovers of checkpoints a killed run was writing (never complete, never resumed)."""
    root = checkpoint_root(run_dir)
    stale = [p for p in root.glob(".tmp-*") if p.is_dir()] if root.is_dir() else []
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def file_manifest(directory: Path) -> dict[str, dict[str, Any]]:
    """``{relative path: {"bytes": size, "sha256": hex}}`` for every file under ``directory`` except meta.json."""
    return {str(f.relative_to(directory)): {"bytes": f.stat().st_size, "sha256": sha256_file(f)}
            for f in sorted(directory.rglob("*")) if f.is_file() and f.name != META}


_VERIFIED: dict[tuple[str, float], str | None] = {}  # (meta.json path, mtime) -> problem; resume asks 3 times


def checkpoint_problem(path: Path) -> str | None:
    """Why the checkpoint at ``path`` cannot be loaded, or None when it is intact: meta.json readable, the trainer
    state present, every file of the manifest there with its size and SHA-256 (checkpoints written before the
    manifest existed: every safetensors header readable)."""
    meta_file = path / META
    try:
        key = (str(meta_file), meta_file.stat().st_mtime)
    except OSError:
        return f"no {META}"
    if key in _VERIFIED:
        return _VERIFIED[key]
    problem = _find_problem(path, meta_file)
    _VERIFIED[key] = problem
    return problem


def _find_problem(path: Path, meta_file: Path) -> str | None:
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError) as exc:
        return f"{META} is unreadable ({exc})"
    if not (path / TRAINER_STATE).is_file():
        return f"no {TRAINER_STATE}"
    manifest = meta.get("files") if isinstance(meta, dict) else None
    if isinstance(manifest, dict):
        for name, facts in manifest.items():
            file = path / name
            if not file.is_file():
                return f"{name} is missing"
            if file.stat().st_size != facts.get("bytes"):
                return f"{name} has {file.stat().st_size} bytes, {facts.get('bytes')} were written"
            if sha256_file(file) != facts.get("sha256"):
                return f"{name} does not match the SHA-256 recorded when it was written"
        return None

    for file in sorted(path.rglob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except (SafetensorError, OSError) as exc:
            return f"{file.relative_to(path)} is damaged ({exc})"
    return None


def find_resume_checkpoint(run_dir: str | Path, resume: str) -> Path | None:
    """``auto``: the newest intact checkpoint (``latest`` first; a damaged one is skipped with a warning naming it);
    ``disable``: None; otherwise the given path, which must be an intact checkpoint."""
    if resume == "disable":
        return None
    if resume == "auto":
        latest = read_pointer(run_dir)
        candidates = ([latest] if latest is not None else []) + [p for _, p in reversed(list_checkpoints(run_dir))]
        skipped: list[str] = []
        for path in dict.fromkeys(candidates):
            problem = checkpoint_problem(path)
            if problem is None:
                for note in skipped:
                    say_once(f"skipping damaged checkpoint {note}; resuming from {path.name}", label="warning")
                return path
            skipped.append(f"{path} ({problem})")
        if skipped:
            raise CheckpointError("trainer.resume=auto found no intact checkpoint: " + "; ".join(skipped)
                                  + ". Start a new run (trainer.resume=disable or another experiment_name)")
        return None
    path = Path(resume)
    if not (path / TRAINER_STATE).is_file():
        raise CheckpointError(
            f"trainer.resume='{resume}' is not a complete checkpoint (no {TRAINER_STATE}); "
            "use auto, disable, or a checkpoints/global_step_<N> directory"
        )
    problem = checkpoint_problem(path)
    if problem is not None:
        raise CheckpointError(f"trainer.resume='{resume}' is damaged: {problem}; use trainer.resume=auto (the "
                              "newest intact checkpoint) or an earlier global_step_<N>")
    return path


def checkpoint_step(path: Path) -> int:
    """The step a checkpoint was written at (its meta.json)."""
    try:
        return int(json.loads((path / META).read_text())["step"])
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"cannot read the step of {path} from {META}: {exc}") from None


def load_trainer_state(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path / TRAINER_STATE, map_location="cpu", weights_only=False)
    except Exception as exc:
        raise CheckpointError(f"cannot read {path / TRAINER_STATE}: {exc}") from None

"""Atomic writes: a reader (or a crash) never sees a half-written file or directory."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from verl.errors import VerlError


def cache_dir() -> Path:
    """Where built data, converted models and compiled kernels are kept: ``$VERL_CACHE_DIR``, default
    ``~/.cache/verl-suite``."""
    return Path(os.environ.get("VERL_CACHE_DIR", Path.home() / ".cache" / "verl-suite"))


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    """SHA-256 of a file's bytes, read in chunks (model weights can be gigabytes)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def ensure_writable_dir(path: str | os.PathLike, what: str) -> Path:
    """Create ``path`` (and parents) as a directory we can write into, or raise one line naming ``what`` (the
    flag or config key it came from) and the fix. Called before any slow work, so a bad ``--out`` fails at once."""
    path = Path(path)
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        where = "is" if existing == path else f"is inside '{existing}', which is"
        raise VerlError(f"{what} '{path}' {where} a file, not a directory; give a directory path (it is created "
                        "if missing)")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise VerlError(f"{what} '{path}' cannot be created: {exc.strerror}; pick a directory you can write to") \
            from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise VerlError(f"{what} '{path}' is not writable by this user; pick a directory you can write to")
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling of ``path``; on success rename it onto ``path``, on error remove it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; the result should look like any other file
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_text(text)
    return Path(path)


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def _umask_modes(root: Path) -> None:
    """Give files written 0600 by libraries (safetensors' writer, mkstemp) the umask's mode like every other file,
    so a service running as another user can read a checkpoint or export."""
    mode = 0o666 & ~_umask()
    for file in root.rglob("*"):
        if file.is_file() and not file.is_symlink() and (file.stat().st_mode & 0o777) == 0o600 and mode != 0o600:
            os.chmod(file, mode)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling directory; rename it to ``path`` when the block completes.

    The temp name starts with ``.tmp-`` so directory scans (``global_step_*``) never pick it up.
    With ``overwrite`` an existing ``path`` is replaced only after the new one is complete.
    """
    path = Path(path)
    ensure_writable_dir(path.parent, "the parent directory")
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{path.name}-", dir=path.parent))
    except OSError as exc:  # writable by mode bits, refused anyway (a read-only or special filesystem)
        raise VerlError(f"cannot write '{path}': {exc.strerror}; pick a directory you can write to") from None
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700
    try:
        yield tmp
        _umask_modes(tmp)
        if path.exists():
            if not overwrite:
                raise FileExistsError(f"{path} already exists")
            trash = path.with_name(f".trash-{path.name}-{os.getpid()}")
            os.replace(path, trash)
            os.replace(tmp, path)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

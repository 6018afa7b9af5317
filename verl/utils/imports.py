"""Importing a user's Python file by path (``path/to/file.py:name`` specs of tools and evaluators)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def import_file(file: Path, prefix: str) -> ModuleType:
    """The module in ``file``, imported once per resolved path under a private name (``<prefix>_<stem>_<hash>``).
    A file that fails to import is not cached, and the exception it raised propagates for the caller to name."""
    name = f"{prefix}_{file.stem}_{abs(hash(str(file.resolve())))}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"'{file}' cannot be imported as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module

"""Importing a user's code by name: ``package.module:name`` or ``path/to/file.py:name`` (tools, evaluators,
environment classes)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from verl.errors import ConfigError


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


def load_attribute(target: str, what: str, prefix: str) -> Any:
    """The object ``module:name`` or ``path/to/file.py:name`` names; errors start with ``what`` (``tool function
    'x'``) and say what is missing."""
    where, sep, attr = target.rpartition(":")
    if not sep or not where or not attr:
        raise ConfigError(f"{what} '{target}' is not module:name or path/to/file.py:name")
    if where.endswith(".py") or "/" in where:
        file = Path(where).expanduser()
        if not file.is_file():
            raise ConfigError(f"{what} '{target}': file '{where}' does not exist")
        try:
            module = import_file(file, prefix)
        except Exception as exc:
            raise ConfigError(f"{what} '{target}': importing '{where}' failed: {exc!r}") from exc
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            raise ConfigError(f"{what} '{target}': cannot import '{where}' ({exc})") from None
    if not hasattr(module, attr):
        raise ConfigError(f"{what} '{target}': '{where}' has no '{attr}'")
    return getattr(module, attr)

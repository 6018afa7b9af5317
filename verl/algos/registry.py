"""The rule every registry of pure functions here follows (advantage estimators, policy losses)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def register(table: dict[str, Any], name: str, fn: Callable, kind: str) -> None:
    """Put ``fn`` in ``table`` under ``name``. Registering a name again with another function raises: a plug-in
    silently replacing a built-in would change every run that names it. The same function again (a module
    imported twice, a reload) is fine; functions are compared by module and qualified name, not identity."""
    known = table.get(name)
    if known is not None and _qualname(known) != _qualname(fn):
        raise ValueError(f"{kind} '{name}' is already registered ({_qualname(known)}); register yours under "
                         "another name")
    table[name] = fn


def _qualname(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"

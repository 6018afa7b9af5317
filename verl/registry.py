"""``Registry``: the one type of every pluggable table (docs/architecture.md §2, "Registries").

A name defined again by another definition raises ``RegistryError`` naming both (the same definition again, a
re-import, is fine); ``lazy(name, "module:attr")`` imports a definition when first looked up; with ``group=``, installed
packages' entry points of that group are entries too; an unknown name is a ``ConfigError`` naming the config key.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Iterator, MutableMapping
from typing import Any, Generic, TypeVar

from verl.errors import ConfigError

T = TypeVar("T")


class RegistryError(ConfigError, ValueError):
    """A name registered twice with two different definitions."""


def definition_of(obj: Any) -> str:
    """Where ``obj`` is defined, as ``module:qualname`` (a lazy entry's string as it is; other objects by their
    ``target`` attribute, as tools carry one, else their repr)."""
    if isinstance(obj, str):
        return obj
    qualname = getattr(obj, "__qualname__", None)
    if qualname is not None:
        return f"{getattr(obj, '__module__', '?')}:{qualname}"
    return str(getattr(obj, "target", None) or repr(obj))


def load_target(target: str) -> Any:
    """The object a ``"module:attr"`` string names."""
    module, _, attr = target.partition(":")
    found: Any = importlib.import_module(module)
    for part in attr.split("."):
        found = getattr(found, part)
    return found


class Registry(MutableMapping[str, T], Generic[T]):
    """Names -> definitions of one ``kind`` of plug-in, chosen by config ``key`` (for errors)."""

    def __init__(self, kind: str, key: str | None = None, group: str | None = None, hint: str = ""):
        self.kind, self.key, self.group, self.hint = kind, key, group, hint  # hint: appended to an unknown name's error
        self._entries: dict[str, Any] = {}  # a definition, or a "module:attr" string not imported yet

    def register(self, name: str, obj: Any = None) -> Any:
        """Add ``obj`` under ``name``; without ``obj``, a decorator that does."""
        if obj is None:
            return lambda target: self.register(name, target)
        known = self._entries.get(name)
        if known is not None and definition_of(known) != definition_of(obj):
            raise RegistryError(f"{self.kind} '{name}' is defined twice: {definition_of(known)} and "
                                f"{definition_of(obj)}; register yours under another name")
        self._entries[name] = obj
        return obj

    def lazy(self, name: str, target: str) -> None:
        """Add the definition ``"module:attr"`` names, imported when ``name`` is first looked up."""
        self.register(name, target)

    def entry_points(self) -> dict[str, importlib.metadata.EntryPoint]:
        """``name -> entry point`` of ``group`` across every installed distribution (``importlib.metadata``'s
        ``entry_points()`` keeps one distribution per name on ``sys.path``, so a stale egg-info could hide one)."""
        found: dict[str, importlib.metadata.EntryPoint] = {}
        for dist in importlib.metadata.distributions() if self.group else ():
            for point in dist.entry_points:
                if point.group == self.group:
                    found.setdefault(point.name, point)
        return found

    def available(self) -> list[str]:
        return sorted(set(self._entries) | set(self.entry_points()))

    def __getitem__(self, name: str) -> T:
        points = self.entry_points()
        if name in self._entries:
            known = self._entries[name]
            if name in points and points[name].value != definition_of(known):
                raise ConfigError(f"{self.kind} '{name}' is registered here ({definition_of(known)}) and also "
                                  f"declared by the package of entry point {points[name].value}; rename that entry "
                                  "point")
            if isinstance(known, str):
                self._entries[name] = known = load_target(known)
            return known
        if name not in points:
            where = f"{self.key}='{name}'" if self.key else f"{self.kind} '{name}'"
            raise ConfigError(f"{where} is unknown; available: {', '.join(self.available())}"
                              + (f"; {self.hint}" if self.hint else ""))
        try:
            return points[name].load()
        except Exception as exc:
            raise ConfigError(f"{self.kind} '{name}': loading entry point {points[name].value} failed: "
                              f"{type(exc).__name__}: {exc}") from exc

    def __setitem__(self, name: str, obj: T) -> None:
        self.register(name, obj)

    def __delitem__(self, name: str) -> None:
        del self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def copy(self) -> Registry[T]:
        """A registry with the same entries (tests register into a copy)."""
        other: Registry[T] = Registry(self.kind, self.key, self.group, self.hint)
        other._entries = dict(self._entries)
        return other

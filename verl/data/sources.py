"""Data sources by name: one syntax wherever data goes (``data.train_files``, ``data.val_files``, ``verl eval
--data``, ``verl ship --gate-data``, ``verl data materialize``).

A name is a path (parquet file, or a ``verl data from-records`` export directory) or ``<scheme>:<target>[?key=value
&...]``. The schemes ``builtin``, ``reasoning_gym``, ``openenv``, ``verifiers`` and ``env`` are reserved
(docs/environments.md); the query is parsed by ``urllib.parse`` (``&``-separated, ``%``-escapes allowed). Every
scheme resolves to a parquet file (generated sources are written once into the cache, keyed by their spec), so
everything that reads data files reads them all.

On a shell line a list of sources is ``'data.train_files=[reasoning_gym:chain_sum?size=200&seed=1]'`` (quote it: the
shell reads ``&`` and ``?``); an element holding a comma needs YAML quotes inside: ``'[\"a?b=1,2\"]'``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qsl

from verl.data.builtin import resolve_builtin
from verl.data.tasks.arithmetic import ArithmeticSpec
from verl.errors import DataError
from verl.registry import Registry

RESERVED = ("builtin", "reasoning_gym", "openenv", "verifiers", "env")
# Reserved schemes this version does not read yet: refused by name, never read as a file path.
NOT_YET = {
    "verifiers": "verifiers environments (verifiers:<id>)",
}


@dataclass(frozen=True)
class SourceName:
    """``scheme:target?query`` split; ``scheme`` is None for a plain path."""

    text: str
    scheme: str | None
    target: str
    params: dict[str, str] = field(default_factory=dict)


def parse_source(name: str) -> SourceName:
    """Split a data source name (see the module docstring); a repeated query key is an error."""
    scheme, sep, rest = name.partition(":")
    if not sep or not (scheme in RESERVED or (scheme.isidentifier() and scheme in SOURCES.available())):
        return SourceName(name, None, name)
    target, _, query = rest.partition("?")
    params: dict[str, str] = {}
    for key, value in parse_qsl(query, keep_blank_values=True, strict_parsing=False):
        if key in params:
            raise DataError(f"data source '{name}': the key '{key}' is given twice")
        params[key] = value
    return SourceName(name, scheme, target, params)


def _builtin(source: SourceName, spec: ArithmeticSpec | None, disjoint_from: Sequence[SourceName]) -> Path:
    return resolve_builtin(source.text, spec)  # built-in splits are disjoint by construction


# scheme -> fn(source, arithmetic spec, training sources) -> parquet path. Adapters are named by "module:attr" (a
# package one needs is imported only when its scheme is used); a package's entry points (group verl.sources) add more.
SOURCES: Registry = Registry("data source scheme", group="verl.sources")
SOURCES.register("builtin", _builtin)
SOURCES.lazy("reasoning_gym", "verl.data.reasoning_gym:materialize_source")
SOURCES.lazy("openenv", "verl.envs.openenv:materialize_source")
SOURCES.lazy("env", "verl.envs.classes:materialize_source")


def resolve_data_file(name: str, spec: ArithmeticSpec | None = None, disjoint_from: Sequence[str] = ()) -> Path:
    """The parquet file (or export directory) a source name stands for. ``spec``: the built-in arithmetic task's
    (``data.arithmetic``); ``disjoint_from``: the training sources, when ``name`` is validation data (a generated
    source then takes items the training sources do not hold)."""
    source = parse_source(str(name))
    if source.scheme is None:
        return Path(source.target).expanduser()
    if source.scheme in NOT_YET:
        raise DataError(f"data source '{name}': {NOT_YET[source.scheme]} are not read by this version of verl "
                        "suite; give parquet files, builtin:TASK/SPLIT, reasoning_gym:<dataset>, openenv:<url> or "
                        "env:<module>:<Class> (docs/environments.md)")
    return SOURCES[source.scheme](source, spec, [parse_source(str(t)) for t in disjoint_from])

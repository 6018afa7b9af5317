"""Tools a model may call: the built-ins, and the user's own from a YAML file shaped like verl's tool config.

A tool is a plain Python function with an OpenAI function schema. ``rollout.multi_turn.tools`` names built-ins;
``rollout.multi_turn.tool_config_path`` points at a YAML file::

    tools:
      - name: calculator                    # a built-in, by name
      - function: my_tools.py:lookup        # or package.module:function (verl's `class_name` is read too)
        tool_schema:                        # OpenAI's function schema, as verl writes it
          type: function
          function:
            name: lookup
            description: Look a word up.
            parameters: {type: object, properties: {word: {type: string}}, required: [word]}
        timeout_s: 5                        # default 10
        pure: false                         # default: a user's function runs in a tool process, not the trainer

A *pure* tool (no side effects, bounded time: ``calculator``) runs on a thread of the trainer's process; any other
runs in a separate tool process that is killed when it overruns its timeout. Which tools a data row may use, and
the per-row keyword arguments they get, come from the row (``tools_for_row``): ``extra_info.tools_kwargs`` as in
verl's rows, or a ``tools`` column of OpenAI function schemas (a list, or that list as JSON text).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from verl.errors import ConfigError, DataError
from verl.registry import Registry
from verl.tools.calculator import SCHEMA as CALCULATOR_SCHEMA
from verl.utils.imports import load_attribute

DEFAULT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Tool:
    """A callable tool: its OpenAI ``schema`` (``{"type": "function", "function": {name, description,
    parameters}}``), the function ``target`` (``module:function`` or ``path.py:function``), whether it is ``pure``
    (runs in-process) and its ``timeout_s``."""

    schema: dict[str, Any]
    target: str
    pure: bool = False
    timeout_s: float = DEFAULT_TIMEOUT_S

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]

    @property
    def parameters(self) -> dict[str, Any]:
        return self.schema["function"].get("parameters") or {"type": "object", "properties": {}}


# Tools by name (``rollout.multi_turn.tools=[NAME]``): every entry is a ``Tool``, called with its schema's arguments.
BUILTIN_TOOLS: Registry[Tool] = Registry("tool", key="rollout.multi_turn.tools")
BUILTIN_TOOLS.register("calculator", Tool(CALCULATOR_SCHEMA, "verl.tools.calculator:calculator", pure=True,
                                          timeout_s=5.0))


def load_function(target: str) -> Callable[..., Any]:
    """The function ``module:function`` or ``path/to/file.py:function`` names."""
    function = load_attribute(target, "tool function", "verl_user_tool")
    if not callable(function):
        raise ConfigError(f"tool function '{target}' is not a function")
    return function


# ---------------------------------------------------------------------------------------------- the configured set


@dataclass
class ToolSet:
    """The tools a run may call, by name."""

    tools: dict[str, Tool] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.tools)

    def names(self) -> list[str]:
        return list(self.tools)

    def schemas(self, names: Iterable[str] | None = None) -> list[dict[str, Any]]:
        """OpenAI schemas of ``names`` (all when None), in configuration order."""
        wanted = self.names() if names is None else list(names)
        return [self.tools[name].schema for name in wanted if name in self.tools]


def build_tool_set(names: Iterable[str] = (), config_path: str | None = None) -> ToolSet:
    """The built-ins ``names`` and the tools of the YAML file ``config_path`` (see the module docstring)."""
    tools: dict[str, Tool] = {}
    for name in names:
        if name not in BUILTIN_TOOLS:
            raise ConfigError(f"rollout.multi_turn.tools: unknown tool '{name}'; built-in: "
                              f"{', '.join(BUILTIN_TOOLS)}; add your own with rollout.multi_turn.tool_config_path")
        tools[name] = BUILTIN_TOOLS[name]
    for tool in load_tool_config(config_path) if config_path else []:
        if tool.name in tools and tools[tool.name] != tool:
            raise ConfigError(f"{config_path}: tool '{tool.name}' is defined twice")
        tools[tool.name] = tool
    return ToolSet(tools)


def load_tool_config(path: str) -> list[Tool]:
    """Tools from a YAML file; an error names the file, the entry and the key."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"rollout.multi_turn.tool_config_path: file '{path}' does not exist")
    try:
        data = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc})") from None
    entries = data.get("tools") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{path}: expected a non-empty list under 'tools:'")
    return [_tool_from_entry(entry, f"{path}: tools[{i}]") for i, entry in enumerate(entries)]


def _tool_from_entry(entry: Any, where: str) -> Tool:
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: expected a mapping with 'name' (a built-in) or 'function' and 'tool_schema'")
    target = entry.get("function") or entry.get("class_name")
    if target is None:
        name = entry.get("name")
        if name not in BUILTIN_TOOLS:
            raise ConfigError(f"{where}: '{name}' is not a built-in tool ({', '.join(BUILTIN_TOOLS)}); give "
                              "'function: module:function' and 'tool_schema' for your own")
        return BUILTIN_TOOLS[name]
    schema = entry.get("tool_schema")
    check_function_schema(schema, f"{where}.tool_schema")
    if ":" not in str(target) and "." in str(target):  # verl's class_name: pkg.module.Name
        module, _, attr = str(target).rpartition(".")
        target = f"{module}:{attr}"
    load_function(str(target))  # fail now, naming the entry, not at the first call
    timeout = entry.get("timeout_s", DEFAULT_TIMEOUT_S)
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ConfigError(f"{where}.timeout_s must be a positive number of seconds, got {timeout!r}")
    return Tool(schema, str(target), pure=bool(entry.get("pure", False)), timeout_s=float(timeout))


def check_function_schema(schema: Any, where: str) -> None:
    """An OpenAI function tool schema: ``{"type": "function", "function": {"name", "parameters"?}}``, with
    parameters a valid JSON Schema object."""
    if not isinstance(schema, dict) or schema.get("type") != "function" or not isinstance(schema.get("function"), dict):
        raise ConfigError(f"{where}: expected {{type: function, function: {{name, description, parameters}}}}")
    function = schema["function"]
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise ConfigError(f"{where}.function.name: a non-empty string is required")
    parameters = function.get("parameters", {"type": "object"})
    from jsonschema import Draft202012Validator, SchemaError  # noqa: PLC0415  (only where schemas are checked)

    try:
        Draft202012Validator.check_schema(parameters)
    except SchemaError as exc:
        raise ConfigError(f"{where}.function.parameters is not a valid JSON Schema: {exc.message}") from None


# ---------------------------------------------------------------------------------------------- per data row


def _tools_column(row: dict[str, Any], where: str) -> Any:
    column = row.get("tools")
    if isinstance(column, str):  # JSON text: parquet cannot hold schema-free structs in every column
        try:
            column = json.loads(column)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: the 'tools' column is not JSON ({exc.msg})") from None
    return column


def brings_tools(row: dict[str, Any]) -> bool:
    """Whether ``row``'s environment brings its own tools (an ``env:`` class's methods, an OpenEnv server's): its
    ``tools`` column is then theirs, not a choice among the configured ones."""
    extra = row.get("extra_info")
    return (isinstance(extra, dict) and isinstance(extra.get("env"), dict)
            and extra["env"].get("kind") in ("env", "openenv"))


def environment_tools(row: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """The OpenAI schemas of the tools ``row``'s environment brings (none for other rows)."""
    return list(_tools_column(row, where) or []) if brings_tools(row) else []


def tools_for_row(row: dict[str, Any], tool_set: ToolSet, where: str) -> tuple[list[str], dict[str, dict]]:
    """Which configured tools ``row`` may call, and the hidden keyword arguments each gets.

    As verl's rows carry them: ``extra_info.tools_kwargs`` (``{name: {"create_kwargs": {...}}}`` or
    ``{name: {...}}``) names the row's tools and their per-row arguments (a ground truth, a document id ...), which
    the tool receives but the model never sees; a ``tools`` column holds OpenAI function schemas (or names) of the
    row's tools. With neither, every configured tool. A tool the run does not configure is an error naming the row.
    """
    extra = row.get("extra_info") or {}
    per_tool = extra.get("tools_kwargs") if isinstance(extra, dict) else None
    column = None if brings_tools(row) else _tools_column(row, where)
    if per_tool:
        names = list(per_tool)
    elif column is not None and len(column):
        names = [entry if isinstance(entry, str) else (entry.get("function") or {}).get("name") for entry in column]
    else:
        return tool_set.names(), {}
    unknown = [n for n in names if n not in tool_set.tools]
    if unknown:
        raise DataError(f"{where}: tools {unknown} are not configured (rollout.multi_turn.tools / tool_config_path: "
                        f"{', '.join(tool_set.names()) or 'none'})")
    kwargs = {}
    for name, value in (per_tool or {}).items():
        value = value or {}
        kwargs[name] = dict(value.get("create_kwargs", value) if isinstance(value, dict) else {})
    return names, kwargs

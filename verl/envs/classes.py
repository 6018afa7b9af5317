"""``env:<module>:<Class>`` (or ``env:path/to/file.py:Class``): a Python class as an environment, written to TRL's
``environment_factory`` contract:

- ``Class()`` takes no arguments; one instance per trajectory;
- ``reset(**row) -> str | None`` starts an episode. It gets the keys of the row its signature accepts (all of them
  with ``**kwargs``): ``seed`` and ``index`` for generated episodes (``?episodes=N&seed=S``: episode ``i`` resets
  with ``seed=S+i, index=i``), or the columns of a data file's row (``?data=PATH``: a parquet file or a source name,
  ``%``-escaped where it holds ``?`` or ``&``). The string it returns is the episode's prompt (generated episodes) or
  is appended to the row's last user message (data rows); None leaves the row's prompt as it is;
- its public methods that have a docstring are the episode's tools: their OpenAI schemas come from the signature's
  type hints and the Google-style docstring (transformers' ``get_json_schema``, as TRL builds them); a call runs the
  method of the trajectory's own instance, and what it returns (or the error it raises) is the tool's answer;
- the episode ends when the model answers without a tool call; its reward is ``reward`` (an attribute or property)
  or ``get_reward()``, read then. A class with neither is refused when the source is read.

Reading the source runs one instance's ``reset`` per row (the prompt and the tools are written into the parquet);
rolling out runs it again per trajectory, and a reset that answers another prompt than when the data was read is
the sample's error, not a silent mismatch.

A class with ``start(row)`` instead is one of ours (``verl.envs.base.Environment``, e.g.
``verl.envs.tool_tasks:ToolTasks``): one instance per run, ``start`` gets each data row (``?data=`` is then
required), its ``tools`` (name -> OpenAI schema) are rendered into the rows' prompts, and its episodes follow the
agent loop's protocol (``step`` or ``replies = False``, ``call``, ``outcome(response_text)``, ``close``).
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from verl.data.sources import SourceName
from verl.envs.base import EpisodeError, Observation
from verl.errors import DataError
from verl.utils.fs import cache_dir
from verl.utils.imports import load_attribute

# Methods of the contract, never tools.
CONTRACT = ("reset", "reward", "get_reward")


def load_class(target: str, where: str) -> type:
    """The environment class ``target`` names (``module:Class`` or ``file.py:Class``), checked against the
    contract (module docstring)."""
    cls = load_attribute(target, f"{where}: environment class", "verl_user_env")
    if not isinstance(cls, type):
        raise DataError(f"{where}: '{target}' is not a class")
    if is_native(cls):
        return cls
    if not callable(getattr(cls, "reset", None)):
        raise DataError(f"{where}: {cls.__name__} has no reset(**row) method (TRL's environment_factory contract)")
    return cls


def is_native(cls: type) -> bool:
    """Whether ``cls`` is one of our environments (``start(row)``), not a TRL-contract class (``reset``)."""
    return callable(getattr(cls, "start", None)) and not callable(getattr(cls, "reset", None))


def read_reward(instance: Any, where: str) -> float | None:
    """The episode's reward: ``get_reward()``, else ``reward`` (called when it is a method); None when unset."""
    get_reward = getattr(instance, "get_reward", None)
    reward = get_reward() if callable(get_reward) else getattr(instance, "reward", None)
    if callable(reward):
        reward = reward()
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))):
        raise EpisodeError(f"{where}: the reward must be a number or None; got {reward!r}")
    return None if reward is None else float(reward)


def tool_methods(cls: type) -> list[str]:
    """Names of ``cls``'s tools: its public methods with a docstring, in definition order."""
    names = []
    for klass in reversed(cls.__mro__[:-1]):  # object's methods are not tools
        for name, value in vars(klass).items():
            if (name.startswith("_") or name in CONTRACT or name in names or not inspect.isfunction(value)
                    or not inspect.getdoc(value)):
                continue
            names.append(name)
    return names


def tool_schemas(cls: type, where: str) -> list[dict[str, Any]]:
    """OpenAI function schemas of ``cls``'s tools (transformers' ``get_json_schema``, which TRL uses too)."""
    from transformers.utils import get_json_schema  # noqa: PLC0415 - transformers imports slowly

    schemas = []
    for name in tool_methods(cls):
        try:
            schema = get_json_schema(getattr(cls, name))
        except Exception as exc:  # transformers raises its own parsing errors
            raise DataError(f"{where}: the tool {cls.__name__}.{name} has no schema: {exc} (type-hint every "
                            "argument and describe each under 'Args:' in its docstring)") from None
        parameters = schema["function"].get("parameters") or {}
        parameters.get("properties", {}).pop("self", None)
        if "required" in parameters:
            parameters["required"] = [r for r in parameters["required"] if r != "self"]
        schema["function"].pop("return", None)
        schemas.append(schema)
    return schemas


def reset_arguments(cls: type, row: dict[str, Any]) -> dict[str, Any]:
    """The keys of ``row`` that ``cls.reset`` accepts (every key when it takes ``**kwargs``)."""
    parameters = inspect.signature(cls.reset).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return dict(row)
    names = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - {"self"}
    return {k: v for k, v in row.items() if k in names}


def reset(instance: Any, row: dict[str, Any], where: str) -> str | None:
    """``instance.reset`` on the keys of ``row`` it takes (``reset_arguments``): the string it returns, or None."""
    observation = instance.reset(**reset_arguments(type(instance), row))
    if observation is not None and not isinstance(observation, str):
        raise EpisodeError(f"{where}: reset() must return a string or None; got {type(observation).__name__}")
    return observation


def episode_prompt(base: list[dict[str, Any]], observation: str | None, where: str) -> list[dict[str, Any]]:
    """The prompt an episode starts from: ``base`` (a data row's messages; empty for generated episodes) with what
    ``reset`` returned appended to its last user message (or as the only message)."""
    messages = [dict(m) for m in base]
    if not messages:
        if not observation:
            raise EpisodeError(f"{where}: reset() returned no prompt for a generated episode (give ?data= rows, or "
                               "return the episode's first message)")
        return [{"role": "user", "content": observation}]
    if observation:
        last = max(i for i, m in enumerate(messages) if m.get("role") == "user")
        messages[last]["content"] = f"{messages[last]['content']}{observation}"
    return messages


def _rows(source: SourceName, where: str) -> list[dict[str, Any]]:
    """The rows episodes start from: a data file's, or ``episodes`` generated ones."""
    unknown = sorted(set(source.params) - {"episodes", "seed", "data"})
    if unknown:
        raise DataError(f"{where}: {', '.join(unknown)} not a key here; env: takes episodes, seed and data")
    if "data" in source.params:
        if {"episodes", "seed"} & set(source.params):
            raise DataError(f"{where}: give data= or episodes=/seed=, not both")
        from verl.data.dataset import read_rows  # noqa: PLC0415 - dataset imports this module's package

        rows = read_rows([source.params["data"]], where)
        return [{k: v for k, v in row.items() if not k.startswith("__")} for row in rows]
    try:
        episodes, seed = int(source.params.get("episodes", 16)), int(source.params.get("seed", 0))
    except ValueError:
        raise DataError(f"{where}: episodes and seed must be integers") from None
    return [{"seed": seed + index, "index": index} for index in range(episodes)]


def materialize_source(source: SourceName, _arithmetic: Any = None, disjoint_from: Sequence[SourceName] = ()) -> Path:
    """One row per episode: the prompt ``reset`` gives, the class's tools (a ``tools`` column of OpenAI schemas, as
    JSON text) and what the episode needs to start again (``extra_info.env``)."""
    from verl.data.builtin import write_parquet  # noqa: PLC0415
    from verl.data.dataset import as_messages  # noqa: PLC0415

    where = f"data source '{source.text}'"
    cls = load_class(source.target, where)
    native = is_native(cls)
    if native and "data" not in source.params:
        raise DataError(f"{where}: {cls.__name__} starts episodes from data rows: give ?data=<source>")
    schemas = json.dumps(list(getattr(cls(), "tools", {}).values()) if native else tool_schemas(cls, where))
    generated = "data" not in source.params
    out = []
    for index, row in enumerate(_rows(source, where)):
        base = [] if generated else as_messages(row.get("prompt"))
        if native:  # the row as it is; its episodes start when trajectories do
            extra = dict(row.get("extra_info") or {})
            extra.update(source=source.text, index=index, env={"kind": "env", "target": source.target,
                                                               "reset": json.dumps(row, default=str), "prompt": ""})
            out.append({**row, "prompt": base, "tools": schemas, "extra_info": extra})
            continue
        try:
            instance = cls()
            prompt = episode_prompt(base, reset(instance, row, where), where)
        except EpisodeError as exc:
            raise DataError(str(exc)) from None
        except Exception as exc:
            raise DataError(f"{where}: {cls.__name__}().reset() failed on row {index}: "
                            f"{type(exc).__name__}: {exc}") from None
        if not hasattr(instance, "reward") and not callable(getattr(instance, "get_reward", None)):
            raise DataError(f"{where}: {cls.__name__} has neither a 'reward' attribute nor get_reward(); the "
                            "episode's reward is read from one of them when its trajectory ends")
        extra = dict(row.get("extra_info") or {}) if not generated else {}
        seed = row.get("seed", index) if generated else extra.get("seed", index)
        extra.update(source=source.text, seed=seed, index=index, kind=f"env/{cls.__name__}",
                     items=f"env:{source.target}",
                     env={"kind": "env", "target": source.target, "reset": json.dumps(row, default=str),
                          "prompt": prompt[-1]["content"]})
        out.append({**({} if generated else row), "data_source": row.get("data_source") or f"env/{cls.__name__}",
                    "prompt": prompt, "tools": schemas, "extra_info": extra,
                    "reward_model": row.get("reward_model") or {"style": "env", "ground_truth": ""}})
    try:  # keyed by the spec and the class's source text: editing the class writes new rows
        code = inspect.getsource(cls)
    except (OSError, TypeError):
        code = repr(out)
    key = hashlib.sha256(f"{source.text}|{code}|{schemas}".encode()).hexdigest()[:12]
    return write_parquet(out, cache_dir() / "data" / f"env-{key}" / "items.parquet")


class ClassEpisode:
    """One trajectory's instance of the class. Its tools are the instance's methods (``call``); it never replies to
    a turn (``replies``): a turn without tool calls ends the trajectory, and ``outcome`` reads the reward then,
    whatever ended it (a turn or length limit too, as TRL reads ``env.reward`` after generation)."""

    replies = False

    def __init__(self, cls: type, tools: dict[str, dict[str, Any]], spec: dict[str, Any]):
        self.name = cls.__name__
        self.instance = cls()
        self.tools = tools
        observation = reset(self.instance, json.loads(spec["reset"]), self.name)
        if observation and not spec["prompt"].endswith(observation):
            raise EpisodeError(f"{self.name}: reset() gave another prompt than when the data was read; an episode "
                               "must start the same way from the same row")

    def call(self, name: str, arguments: dict[str, Any]) -> Any:
        """The tool ``name`` of this episode's instance, called with the model's arguments."""
        return getattr(self.instance, name)(**arguments)

    def step(self, messages: list[dict[str, Any]]) -> Observation:
        raise EpisodeError(f"{self.name}: an environment class does not answer turns")  # replies is False

    def outcome(self, response: str) -> float | None:
        """The reward the instance holds now (TRL's classes score their own state, not ``response``)."""
        return read_reward(self.instance, self.name)

    def close(self) -> None:
        """Nothing: the contract has no close (the instance goes with the trajectory)."""


class ClassEnvironment:
    """Episodes of rows an ``env:`` source wrote (``extra_info.env``); each class is imported, and its tools'
    schemas built, once."""

    name = "env"

    def __init__(self) -> None:
        self._classes: dict[str, tuple[type, dict[str, dict[str, Any]]]] = {}
        self._native: dict[str, Any] = {}  # our environments: one instance per run

    def start(self, row: dict[str, Any]) -> Any:
        spec = (row.get("extra_info") or {}).get("env") or {}
        target = spec["target"]
        if target not in self._classes and target not in self._native:
            where = f"env:{target}"
            cls = load_class(target, where)
            if is_native(cls):
                self._native[target] = cls()
            else:
                self._classes[target] = (cls, {s["function"]["name"]: s for s in tool_schemas(cls, where)})
        if target in self._native:
            return self._native[target].start({**json.loads(spec["reset"]), "messages": row.get("messages")})
        cls, tools = self._classes[target]
        return ClassEpisode(cls, tools, spec)

"""verl's ``interaction_config_path`` as an environment: the user side of a conversation written as a
``verl.interactions.base.BaseInteraction`` subclass, loaded from verl's YAML::

    interaction:
      - name: retry                     # optional: the class name without "Interaction", lower case
        class_name: my_pkg.retry.RetryInteraction
        config: {max_tries: 2}

A row picks its interaction by ``extra_info.interaction_kwargs.name`` (the only one when the file has one), and
the rest of ``interaction_kwargs`` is passed to ``start_interaction`` and ``generate_response``, as verl does.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Any

import yaml

from verl.envs.base import EpisodeError, Observation
from verl.envs.runner import EpisodeRunner
from verl.errors import ConfigError

KEY = "rollout.multi_turn.interaction_config_path"


def load_interactions(path: str | Path) -> dict[str, Any]:
    """``name -> interaction instance`` from verl's interaction YAML (errors name the file and the entry)."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"{KEY}: no file '{path}'")
    try:
        entries = (yaml.safe_load(file.read_text()) or {}).get("interaction")
    except (yaml.YAMLError, AttributeError) as exc:
        raise ConfigError(f"{KEY}: {path} is not verl's interaction YAML ({exc})") from None
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{KEY}: {path} needs a list 'interaction: [{{class_name: module.Class, config: {{}}}}]'")
    found: dict[str, Any] = {}
    for number, entry in enumerate(entries):
        where = f"{KEY}: {path} interaction[{number}]"
        target = entry.get("class_name") if isinstance(entry, dict) else None
        if not isinstance(target, str) or "." not in target:
            raise ConfigError(f"{where}: class_name must be a dotted path, module.Class")
        module_name, _, class_name = target.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"{where}: cannot import {target} ({exc}); is its package on PYTHONPATH?") from None
        simple = class_name[: -len("Interaction")] if class_name.endswith("Interaction") else class_name
        name = entry.get("name") or simple.lower()
        if name in found:
            raise ConfigError(f"{where}: the name '{name}' is taken by an earlier entry")
        found[name] = cls(config={**(entry.get("config") or {}), "name": name})
    return found


def _accepts_instance_id(method: Any) -> bool:
    params = list(inspect.signature(method).parameters.values())
    return any(p.kind in (p.POSITIONAL_OR_KEYWORD, p.POSITIONAL_ONLY, p.VAR_POSITIONAL) for p in params)


class InteractionEpisode:
    def __init__(self, runner: EpisodeRunner, interaction: Any, name: str, kwargs: dict[str, Any]):
        self.runner, self.interaction, self.name, self.kwargs = runner, interaction, name, kwargs
        self.instance_id = runner.coroutine(interaction.start_interaction(None, **kwargs))

    def step(self, messages: list[dict[str, Any]]) -> Observation:
        answer = self.runner.coroutine(self.interaction.generate_response(self.instance_id, messages, **self.kwargs))
        if not (isinstance(answer, tuple) and len(answer) == 4):
            raise EpisodeError(f"interaction '{self.name}': generate_response must return (should_terminate, text, "
                               f"score, extra); got {str(answer)[:120]}")
        terminate, text, score, extra = answer
        done = bool(terminate)
        messages_out = [] if done else [{"role": "user", "content": text}]
        reward = None if score is None else float(score)
        return Observation(messages_out, reward, done, dict(extra or {})).checked(f"interaction '{self.name}'")

    def close(self) -> None:
        finalize = self.interaction.finalize_interaction
        self.runner.coroutine(finalize(self.instance_id) if _accepts_instance_id(finalize) else finalize())


class InteractionEnvironment:
    """The interactions of one YAML file; ``start(row)`` picks a row's by ``interaction_kwargs.name``."""

    def __init__(self, interactions: dict[str, Any], runner: EpisodeRunner):
        self.interactions, self.runner = interactions, runner
        self.name = "interaction"

    def start(self, row: dict[str, Any]) -> InteractionEpisode:
        kwargs = dict((row.get("extra_info") or {}).get("interaction_kwargs") or {})
        name = kwargs.get("name")
        if name is None and len(self.interactions) == 1:
            name = next(iter(self.interactions))
        if name not in self.interactions:
            raise EpisodeError(f"extra_info.interaction_kwargs.name is {name!r}; {KEY} defines "
                               f"{', '.join(sorted(self.interactions))}")
        return InteractionEpisode(self.runner, self.interactions[name], name, kwargs)

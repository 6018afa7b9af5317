"""``openenv:<url>[?episodes=N&seed=S]``: any OpenEnv server as a source of episodes, through its ``/ws`` sessions.

Reading the source (``materialize_source``): ``GET <url>/schema`` must show an action with exactly one string field
(besides ``metadata``): the model's turn text goes there. Anything else is a one-line error that shows the schema
(an MCP environment's tool actions are not driven yet). Then one session per episode ``i`` resets with
``seed = S + i`` and its first observation becomes the row's prompt (a user message); the row remembers the url,
the field and the seed (``extra_info.env``).

Rolling out (``OpenEnvEnvironment``): each trajectory opens its own ``/ws`` session (openenv's
``GenericEnvClient``), resets with the row's seed, and must see the same first observation (a server whose reset
is not a function of the seed is an error, not a silent mismatch); each model turn is one ``step`` whose
observation is the next user message, with its reward and done. A server at ``max_concurrent_envs`` answers
``CAPACITY_REACHED``: the episode waits and tries again until the environment timeout, then fails as a sample.

The observation's text: its only string field when it has one (metadata aside), else its fields as JSON. A
server whose first observation lists ``tools`` (OpenAI schemas: ``verl env serve`` of the tool tasks) gets them
rendered into the prompt and every turn, calls included: its answer's ``messages`` (role ``tool``) follow.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from verl.data.sources import SourceName
from verl.envs.base import EpisodeError, Observation
from verl.errors import DataError, MissingDependencyError
from verl.utils.fs import cache_dir

INSTALL = "pip install -e '.[envs]'"
CAPACITY = "CAPACITY_REACHED"
CAPACITY_WAIT_S = 0.2  # between tries of a session the server had no room for


def _client(url: str) -> Any:
    try:
        from openenv.core.generic_client import GenericEnvClient  # noqa: PLC0415 - lazy: openenv is optional
    except ImportError:
        raise MissingDependencyError("openenv", "openenv: environment sources", INSTALL) from None
    return GenericEnvClient(base_url=url).sync()


def action_field(url: str, where: str) -> str:
    """The action's one string field, from the server's ``/schema``."""
    import httpx  # noqa: PLC0415

    try:
        schema = httpx.get(url.rstrip("/") + "/schema", timeout=10).json()
    except (httpx.HTTPError, ValueError) as exc:
        raise DataError(f"{where}: cannot read {url}/schema ({exc}); is the OpenEnv server up?") from None
    action = schema.get("action") or {}
    properties = {k: v for k, v in (action.get("properties") or {}).items() if k != "metadata"}
    strings = [k for k, v in properties.items() if v.get("type") == "string"]
    if len(properties) == 1 and len(strings) == 1:
        return strings[0]
    kind = "an MCP environment (tool actions), which is not driven yet" if "tool_name" in json.dumps(action) else (
        "not one string field")
    raise DataError(f"{where}: the server's action is {kind}; verl drives actions with one string field. Its "
                    f"action schema: {json.dumps(properties)[:300]}")


def observation_text(observation: dict[str, Any]) -> str:
    fields = {k: v for k, v in (observation or {}).items() if k != "metadata"}
    strings = [v for v in fields.values() if isinstance(v, str)]
    return strings[0] if len(strings) == 1 else json.dumps(fields, sort_keys=True, default=str)


def observation_messages(observation: dict[str, Any]) -> list[dict[str, str]]:
    """A first observation as the prompt: its ``messages`` when it carries chat messages (``verl env serve``'s do),
    else its text as one user message."""
    messages = (observation or {}).get("messages")
    if isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role") for m in messages):
        return [{"role": str(m["role"]), "content": m["content"]} for m in messages]
    return [{"role": "user", "content": observation_text(observation)}]


def _reset(client: Any, seed: int, deadline: float) -> Any:
    """``client.reset(seed=seed)``, waiting while the server is at capacity (until ``deadline``)."""
    while True:
        try:
            return client.reset(seed=seed)
        except RuntimeError as exc:
            if CAPACITY not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(CAPACITY_WAIT_S)


def materialize_source(source: SourceName, _arithmetic: Any = None, disjoint_from: Sequence[SourceName] = ()) -> Path:
    """One row per episode: its first observation as the prompt (module docstring)."""
    from verl.data.builtin import write_parquet  # noqa: PLC0415

    where = f"data source '{source.text}'"
    url = source.target
    unknown = sorted(set(source.params) - {"episodes", "seed"})
    if unknown:
        raise DataError(f"{where}: {', '.join(unknown)} not a key here; openenv: takes episodes and seed")
    try:
        episodes, seed = int(source.params.get("episodes", 16)), int(source.params.get("seed", 0))
    except ValueError:
        raise DataError(f"{where}: episodes and seed must be integers") from None
    field = action_field(url, where)
    rows = []
    for index in range(episodes):
        client = _client(url)
        try:
            first = _reset(client, seed + index, time.monotonic() + 60)
        except (RuntimeError, ConnectionError, OSError) as exc:
            raise DataError(f"{where}: reset(seed={seed + index}) failed: {exc}") from None
        finally:
            client.close()
        rows.append({"data_source": "openenv", "prompt": observation_messages(first.observation),
                     "tools": json.dumps(first.observation.get("tools") or []),
                     "reward_model": {"style": "env", "ground_truth": ""},
                     "extra_info": {"source": source.text, "seed": seed + index, "index": index,
                                    "items": f"openenv:{url}", "kind": "openenv",
                                    "env": {"kind": "openenv", "url": url, "field": field, "seed": seed + index}}})
    key = hashlib.sha256(f"{source.text}|{time.time_ns()}".encode()).hexdigest()[:12]  # a server may change
    return write_parquet(rows, cache_dir() / "data" / f"openenv-{key}" / "items.parquet")


class OpenEnvEpisode:
    def __init__(self, spec: dict[str, Any], prompt: str, timeout_s: float):
        self.field, self.name = spec["field"], "openenv"
        self.client = _client(spec["url"])
        try:
            first = _reset(self.client, int(spec["seed"]), time.monotonic() + timeout_s)
        except Exception:
            self.client.close()
            raise
        if observation_messages(first.observation)[-1]["content"] != prompt:
            self.client.close()
            raise EpisodeError(f"openenv:{spec['url']}: reset(seed={spec['seed']}) gave another first observation "
                               "than when the data was read; the server's reset must be a function of the seed")
        # A server that lists tools runs them: it takes every turn, calls included (module docstring).
        self.tools = {s["function"]["name"]: s for s in first.observation.get("tools") or []}
        self.takes_calls = bool(self.tools)

    def step(self, messages: list[dict[str, Any]]) -> Observation:
        result = self.client.step({self.field: messages[-1]["content"]})
        done = bool(result.done)
        replied = (result.observation or {}).get("messages")
        if not done and isinstance(replied, list) and replied:
            follow = [{"role": str(m.get("role")), "content": m.get("content")} for m in replied]
        else:
            follow = [] if done else [{"role": "user", "content": observation_text(result.observation)}]
        return Observation(follow, None if result.reward is None else float(result.reward), done,
                           dict(result.metadata or {}))

    def close(self) -> None:
        self.client.close()


class OpenEnvEnvironment:
    """Episodes of rows an ``openenv:`` source wrote (``extra_info.env``)."""

    name = "openenv"

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s

    def start(self, row: dict[str, Any]) -> OpenEnvEpisode:
        spec = (row.get("extra_info") or {}).get("env") or {}
        prompt = row["messages"][-1]["content"] if row.get("messages") else ""
        return OpenEnvEpisode(spec, prompt, self.timeout_s)

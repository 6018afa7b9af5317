"""``verl env serve <source>``: any of our sources as an OpenEnv server (openenv's own ``create_app``), so other
frameworks' OpenEnv clients can train on our tasks.

An episode is one row: ``reset(seed=i)`` opens row ``i % rows`` (its observation: ``prompt``, the last user message,
and ``messages``, the whole chat prompt); ``step(VerlAction(message=...))`` scores the answer with the row's reward
(``reward.name=auto``: the task's own rule, reasoning-gym's ``score_answer`` for its rows) and ends the episode, the
score as its reward. A row with tools (a ``tools`` column naming built-ins: the tool tasks) is served with them: its
first observation carries their schemas (``tools``), a step whose message calls tools (Hermes ``<tool_call>``
blocks, as the agent loop parses them) runs the calls here and answers with the tool messages (``messages``, role
``tool``; at most ``max_parallel_calls`` a turn, results cut at ``max_tool_response_length``: ``MultiTurnConfig``'s
defaults, as an in-process rollout has them), and a step without calls scores the message and ends the episode.
"""

from __future__ import annotations

from typing import Any
from uuid import uuid4

from verl.config import MultiTurnConfig
from verl.data.dataset import as_messages, get_nested, read_rows
from verl.errors import MissingDependencyError
from verl.rewards.registry import score_row
from verl.tools.calls import parse_tool_calls
from verl.tools.registry import BUILTIN_TOOLS, ToolSet, tools_for_row
from verl.tools.runner import ToolRunner, failed

INSTALL = "pip install -e '.[envs]'"


def build_app(source: str, max_concurrent_envs: int = 8, prompt_key: str = "prompt",
              ground_truth_key: str = "reward_model.ground_truth") -> Any:
    """The FastAPI app serving ``source``'s rows as OpenEnv episodes."""
    try:
        from openenv.core.env_server.http_server import create_app  # noqa: PLC0415 - lazy: openenv is optional
        from openenv.core.env_server.interfaces import Environment  # noqa: PLC0415
        from openenv.core.env_server.types import Action, Observation, State  # noqa: PLC0415
    except ImportError:
        raise MissingDependencyError("openenv", "verl env serve", INSTALL) from None
    from pydantic import Field  # noqa: PLC0415

    rows = read_rows([source], "SOURCE")
    # The built-ins the rows' tools name (a row without a tools column then has none: single-turn).
    tool_set = ToolSet(dict(BUILTIN_TOOLS.items()))
    row_tools = [tools_for_row(r, tool_set, f"SOURCE row {r['__row__']}") if r.get("tools") is not None else ([], {})
                 for r in rows]
    defaults = MultiTurnConfig()
    runner = ToolRunner(tool_set, max_response_chars=defaults.max_tool_response_length)

    class VerlAction(Action):
        message: str = Field(..., description="The model's answer to the episode's prompt.")

    class VerlObservation(Observation):
        prompt: str = Field("", description="The last user message of the episode's prompt.")
        messages: list[dict[str, str]] = Field(default_factory=list, description="The whole chat prompt (reset), "
                                               "or the tool messages answering a turn's calls (step).")
        tools: list[dict[str, Any]] = Field(default_factory=list, description="OpenAI schemas of the episode's tools.")

    class SourceEnvironment(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self) -> None:
            super().__init__()
            self._row: dict[str, Any] | None = None
            self._tools: tuple[list[str], dict[str, dict]] = ([], {})
            self._state = State(episode_id=str(uuid4()), step_count=0)

        def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> VerlObservation:
            index = (seed or 0) % len(rows)
            self._row, self._tools = rows[index], row_tools[index]
            self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
            messages = as_messages(self._row[prompt_key])
            return VerlObservation(prompt=messages[-1]["content"], messages=messages, done=False, reward=None,
                                   tools=tool_set.schemas(self._tools[0]), metadata={"source": source, "index": index})

        def step(self, action: VerlAction, timeout_s: float | None = None, **kwargs: Any) -> VerlObservation:
            if self._row is None:
                raise RuntimeError("step before reset: an episode starts with reset(seed=...)")
            self._state.step_count += 1
            names, hidden = self._tools
            turn = parse_tool_calls(action.message)
            if names and turn.has_calls:  # run them, as the agent loop would in process
                answers = [runner.run(call, names, hidden.get(call.name)) if i < defaults.max_parallel_calls else
                           failed(f"at most {defaults.max_parallel_calls} calls per turn")
                           for i, call in enumerate(turn.calls)]
                return VerlObservation(messages=[{"role": "tool", "content": a.content} for a in answers], done=False,
                                       reward=None, metadata={"tool_errors": [a.error for a in answers]})
            row, self._row = self._row, None
            score, extras = score_row(row, action.message, get_nested(row, ground_truth_key))
            return VerlObservation(done=True, reward=score, metadata=extras)

        @property
        def state(self) -> State:
            return self._state

    return create_app(SourceEnvironment, VerlAction, VerlObservation, env_name="verl",
                      max_concurrent_envs=max_concurrent_envs)

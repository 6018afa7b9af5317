"""The built-in tool tasks as an environment (``env:verl.envs.tool_tasks:ToolTasks?data=builtin:tool_word_problems/
val``): the calculator is the episode's tool and the row's own rule its reward, scored on the whole response as the
reward manager scores an in-process tool rollout. The same rows through the configured tool
(``rollout.multi_turn.tools=[calculator]``), through this class, or served (``verl env serve``) and read back over
OpenEnv give the same trajectories and rewards for the same seed (tests/envs/test_transports.py).
"""

from __future__ import annotations

from typing import Any

from verl.rewards.registry import score_row
from verl.tools.registry import BUILTIN_TOOLS, load_function


class ToolTaskEpisode:
    """One trajectory: calls run the built-in tools; a turn without calls ends it; ``outcome`` is the row's rule."""

    replies = False

    def __init__(self, row: dict[str, Any], tools: dict[str, dict[str, Any]]):
        self.row, self.tools, self.name = row, tools, "tool_tasks"

    def call(self, name: str, arguments: dict[str, Any]) -> Any:
        return load_function(BUILTIN_TOOLS[name].target)(**arguments)

    def outcome(self, response: str) -> float:
        return score_row(self.row, response, (self.row.get("reward_model") or {}).get("ground_truth"))[0]

    def close(self) -> None:
        """Nothing to release."""


class ToolTasks:
    """Episodes of the built-in tool tasks' rows (their prompts as they are), the calculator as their tool."""

    name = "tool_tasks"
    tools = {"calculator": BUILTIN_TOOLS["calculator"].schema}

    def start(self, row: dict[str, Any]) -> ToolTaskEpisode:
        return ToolTaskEpisode(row, self.tools)

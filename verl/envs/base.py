"""The environment interface the agent loop drives.

An ``Environment`` starts an ``Episode`` from a dataset row; after each model turn the episode answers with an
``Observation``: the messages that follow (a user's reply, feedback), a reward for that turn (or None) and whether
the episode is done. ``Episode.step`` may block (a remote server, a slow checker): the agent loop calls it on a
worker thread with a timeout and keeps decoding other trajectories meanwhile. An episode that raises, times out or
answers something that is not an ``Observation`` ends its trajectory as a *failed* sample: its loss mask is
zeroed and its reward is missing (NaN, which the trainer masks and counts), never 0; the reason travels in the
rollout's ``env_error`` field.

Rewards: each turn's reward sits at that turn's last generated token (``turn_rewards``: (response position,
reward) pairs), so an outcome estimator (grpo, rloo, ...) sums them into the return and gae / reinforce++ see them
where they were earned; their source is ``env:<name>``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

from verl.errors import VerlError


class EpisodeError(VerlError):
    """An environment failed an episode (raised, timed out, or answered malformed)."""


@dataclass
class Observation:
    """What an environment answers a model turn with."""

    messages: list[dict[str, Any]] = field(default_factory=list)  # chat messages that follow (role user or tool)
    reward: float | None = None  # this turn's reward; None: the turn earns nothing (yet)
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)

    def checked(self, where: str) -> Observation:
        """Self, or an ``EpisodeError`` naming what is malformed."""
        if not isinstance(self.messages, list) or any(
                not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in
                ("user", "tool") for m in self.messages):
            raise EpisodeError(f"{where}: observation messages must be a list of {{role: user|tool, content: "
                                    f"str}}; got {str(self.messages)[:120]}")
        if self.reward is not None and (not isinstance(self.reward, (int, float)) or math.isnan(self.reward)):
            raise EpisodeError(f"{where}: the reward must be a number or None; got {self.reward!r}")
        if not self.done and not self.messages:
            raise EpisodeError(f"{where}: an episode that is not done must answer with a message")
        return self


class Episode(Protocol):
    """One trajectory's side of the environment."""

    def step(self, messages: list[dict[str, Any]]) -> Observation:
        """The conversation so far (the prompt's messages, then the turns; the last is the model's) -> what
        follows."""
        ...

    def close(self) -> None:
        """Release the episode's state (called once, whatever happened)."""
        ...


class Environment(Protocol):
    name: str

    def start(self, row: dict[str, Any]) -> Episode:
        """An episode for one dataset row (its ``extra_info``, ground truth and prompt messages)."""
        ...

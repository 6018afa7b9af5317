"""``BaseInteraction``: verl's documented interface for the user side of a multi-turn conversation.

The agent loop calls, per trajectory: ``start_interaction(instance_id, **interaction_kwargs)`` (the row's
``extra_info.interaction_kwargs``), then after every model turn that calls no tool
``generate_response(instance_id, messages, **interaction_kwargs)`` -> ``(should_terminate, text, score, extra)``
(``text`` becomes the next user message unless it terminates; ``score`` is that turn's reward), and
``finalize_interaction(instance_id)`` at the end. The methods are coroutines, as in verl.
"""

from __future__ import annotations

from typing import Any
from uuid import uuid4


class BaseInteraction:
    """Subclass it and override the coroutines; ``config`` is the YAML entry's ``config`` (with its ``name``)."""

    def __init__(self, config: dict[str, Any]):
        self.config = config
        self.name: str = config.get("name", "interaction_agent")

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        """Start an instance (one trajectory's state); returns its id."""
        return instance_id if instance_id is not None else str(uuid4())

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]],
                                **kwargs: Any) -> tuple[bool, str, float, dict[str, Any]]:
        """The user's reply to the conversation so far: (should_terminate, text, this turn's score, extra)."""
        return False, "Your current result seems acceptable.", 0.0, {}

    async def calculate_score(self, *args: Any, **kwargs: Any) -> float:
        """A score for the interaction so far (called by subclasses' ``generate_response``, as verl's are)."""
        return 0.0

    async def finalize_interaction(self, *args: Any, **kwargs: Any) -> None:
        """Release the instance's state."""

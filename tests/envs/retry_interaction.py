"""A verl user's interaction, written against verl's documented ``BaseInteraction`` (as verl's own gsm8k example
is): the model answers an arithmetic question; a wrong answer gets "try again" and a score of 0, a right one ends
the conversation with a score of 1. Nothing here knows verl suite: it imports verl's module path only."""

import re
from typing import Any
from uuid import uuid4

from verl.interactions.base import BaseInteraction


class RetryInteraction(BaseInteraction):
    def __init__(self, config: dict):
        super().__init__(config)
        self._instance_dict = {}
        self.wrong_text = config.get("wrong_text", "Your response is incorrect! Try again.")

    async def start_interaction(self, instance_id: str | None = None, ground_truth: str | None = None,
                                **kwargs) -> str:
        if instance_id is None:
            instance_id = str(uuid4())
        self._instance_dict[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]],
                                **kwargs) -> tuple[bool, str, float, dict]:
        content = ""
        for item in reversed(messages):
            if item.get("role") == "assistant":
                content = item.get("content") or ""
                break
        self._instance_dict[instance_id]["response"] = content
        reward = await self.calculate_score(instance_id)
        if reward == 1.0:
            return True, "Your response is correct!", reward, {}
        return False, self.wrong_text, reward, {}

    async def calculate_score(self, instance_id: str, **kwargs) -> float:
        state = self._instance_dict[instance_id]
        numbers = re.findall(r"-?\d+", state["response"])
        return 1.0 if numbers and numbers[-1] == str(state["ground_truth"]) else 0.0

    async def finalize_interaction(self, instance_id: str, **kwargs) -> None:
        del self._instance_dict[instance_id]

"""Interactions that misbehave, one way each (config ``mode``), for the failure tests; every other row answers
as ``RetryInteraction`` does, so one rollout mixes failed and healthy samples."""

import asyncio
from typing import Any

from tests.envs.retry_interaction import RetryInteraction


class HostileInteraction(RetryInteraction):
    async def start_interaction(self, instance_id: str | None = None, ground_truth: str | None = None,
                                **kwargs) -> str:
        if self.config["mode"] == "start_raises" and kwargs.get("hostile"):
            raise RuntimeError("the environment could not start")
        return await super().start_interaction(instance_id, ground_truth, **kwargs)

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]], **kwargs):
        if kwargs.get("hostile"):
            mode = self.config["mode"]
            if mode == "raises":
                raise ValueError("the checker crashed")
            if mode == "hangs":
                await asyncio.sleep(3600)
            if mode == "malformed":
                return "not a tuple"
            if mode == "bad_reward":
                return False, "again", "high", {}
        return await super().generate_response(instance_id, messages, **kwargs)

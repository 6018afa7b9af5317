"""The run's reward: its rule function (``reward.name`` / by data source), a custom function or a reward model.

The runner scores every response once with the run's ``RewardManager`` (the code the trainer uses), so
``reward_mean`` equals the trainer's ``eval/reward_mean`` on the same checkpoint and prompts.
"""

from __future__ import annotations

import numpy as np

from verl.errors import VerlError
from verl.evaluators.base import EvalBatch, EvalResult, Evaluator


class Reward(Evaluator):
    name = "reward"
    needs = frozenset({"generations", "rewards"})
    directions = {"reward_mean": True}

    def __init__(self) -> None:
        self.options = {}

    def evaluate(self, batch: EvalBatch) -> EvalResult:
        if batch.rewards is None:
            raise VerlError("the reward evaluator got no rewards; it needs the runner to score responses "
                            "(needs={'rewards'})")
        rewards = np.asarray(batch.rewards, dtype=np.float64)
        binary = bool(np.isin(rewards, (0.0, 1.0)).all())
        result = EvalResult(per_sample={"reward": rewards})
        result.metrics["reward_mean"] = self.mean("reward_mean", rewards, batch, binary=binary, column="reward")
        return result

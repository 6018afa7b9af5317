"""Environment classes written to TRL's ``environment_factory`` contract, for the ``env:`` tests: no constructor
arguments, ``reset(**row)``, public methods with docstrings as tools, the reward read at the end."""

from __future__ import annotations

import random

from verl.tools.calculator import calculator as evaluate


class CalculatorEnv:
    """A data row's arithmetic question; the reward is 1 when one of the calculator's answers is the row's answer
    (what the episode saw, not the final text: TRL's environments score their own state)."""

    def __init__(self):
        self.answer = None
        self.results: list[str] = []
        self.reward = 0.0

    def reset(self, reward_model, **kwargs) -> None:
        self.answer = str(reward_model["ground_truth"])
        self.results, self.reward = [], 0.0

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression (numbers, + - * / // % **, parentheses).

        Args:
            expression: e.g. 37*412
        """
        result = evaluate(expression)
        self.results.append(result)
        self.reward = float(self.answer in self.results)
        return result

    def _private(self) -> str:
        """Not a tool: private."""
        return "never"

    def helper(self):  # not a tool: no docstring
        return "never"


class CountdownEnv:
    """Generated episodes: reset(seed) picks a number; the question is the episode's whole prompt."""

    def reset(self, seed: int, index: int) -> str:
        self.target = random.Random(seed).randint(10, 99)
        return f"Episode {index}: what is {self.target} minus 7?"

    def get_reward(self) -> float:
        return float(self.target)


class NoReward:
    def reset(self, **kwargs) -> str:
        return "hello"


class Silent:
    reward = 0.0

    def reset(self) -> None:
        return None


class NoSchema:
    reward = 0.0

    def reset(self, **kwargs) -> str:
        return "hello"

    def lookup(self, word):
        """Look a word up (no type hints, no Args: no schema)."""
        return word


class Drifting:
    """reset() answers another prompt each time: the episode cannot start as its row did."""

    count = 0
    reward = 0.0

    def reset(self, **kwargs) -> str:
        Drifting.count += 1
        return f"call {Drifting.count}"


class Broken(CalculatorEnv):
    """Its calculator raises (the model sees the error) and its reward is not a number (the sample fails)."""

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression (numbers, + - * / // % **, parentheses).

        Args:
            expression: e.g. 37*412
        """
        raise RuntimeError("the abacus is broken")

    @property
    def reward(self):
        return "lots"

    @reward.setter
    def reward(self, value):
        pass


class Sleepy(CalculatorEnv):
    """Its calculator answers after 4 s: past a 1 s env_timeout_s the model reads a timeout error instead."""

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression (numbers, + - * / // % **, parentheses).

        Args:
            expression: e.g. 37*412
        """
        import time

        time.sleep(4)
        return evaluate(expression)

"""An OpenEnv server built the package's own way (create_app), for the openenv: tests: guess a number 0-9 in at
most three tries; "higher"/"lower" after a miss (reward 0), reward 1 and done on a hit. ``reset(seed)`` picks
``seed % 10``. One process serves four games: ``/guess`` (2 sessions at once), ``/slow`` (3 s a step), ``/two`` (an
action with two fields: not drivable, the schema error) and ``/die`` (kills the process at its first step)."""

import argparse
import os
import re
import time
from typing import Any
from uuid import uuid4

import uvicorn
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

PROMPT = "Guess my number from 0 to 9. Answer with the number."


class GuessAction(Action):
    guess: str = Field(..., description="the guess, as text")


class TwoFieldAction(Action):
    guess: str = ""
    confidence: float = 0.5


class GuessObservation(Observation):
    text: str = ""


class GuessEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self.number = 0

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> GuessObservation:
        self.number = (seed or 0) % 10
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return GuessObservation(text=PROMPT, done=False, reward=None)

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:
        self._state.step_count += 1
        numbers = re.findall(r"\d+", action.guess)
        guess = int(numbers[-1]) if numbers else -1
        if guess == self.number:
            return GuessObservation(text="Right!", done=True, reward=1.0)
        hint = "higher" if guess < self.number else "lower"
        return GuessObservation(text=f"No, {hint}.", done=self._state.step_count >= 3, reward=0.0)

    @property
    def state(self) -> State:
        return self._state


def guess_app(max_concurrent_envs: int, action: type = GuessAction, slow_s: float = 0.0, die_after: int = 0):
    """One game app; each mounted app gets its own environment class (its own slowness and step count)."""
    state = {"steps": 0}

    class Game(GuessEnvironment):
        def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:
            time.sleep(slow_s)
            state["steps"] += 1
            if die_after and state["steps"] >= die_after:
                os._exit(1)  # the whole server: every open session's socket closes mid-episode
            return super().step(action, timeout_s, **kwargs)

    return create_app(Game, action, GuessObservation, env_name="guess", max_concurrent_envs=max_concurrent_envs)


if __name__ == "__main__":
    from starlette.applications import Starlette
    from starlette.routing import Mount

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    app = Starlette(routes=[Mount("/guess", app=guess_app(2)), Mount("/slow", app=guess_app(4, slow_s=3.0)),
                            Mount("/two", app=guess_app(1, TwoFieldAction)),
                            Mount("/die", app=guess_app(8, die_after=1))])
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")

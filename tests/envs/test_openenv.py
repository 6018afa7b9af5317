"""openenv: sources against real OpenEnv servers built with the package's own create_app, each in its own process
on 127.0.0.1: episodes over /ws sessions, rewards checked by hand, max_concurrent_envs respected; and the reverse,
`verl env serve` serving our own task to openenv's client."""

from __future__ import annotations

import re

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.envs.guess_server import PROMPT
from tests.ports import serve
from verl.config import DataConfig, MultiTurnConfig, RewardConfig
from verl.data.dataset import RLHFDataset
from verl.data.sources import resolve_data_file
from verl.errors import DataError
from verl.rollout.agent_loop import AgentRollout
from verl.rollout.base import SamplingParams
from verl.rollout.hf import HFRollout
from verl.tools.templates import ToolPrompting
from verl.workers.reward import RewardManager


@pytest.fixture(scope="module")
def server():
    """The games' process (tests/envs/guess_server.py); the module's last test kills it through /die."""
    process, url = serve("-m", "tests.envs.guess_server", health="/guess/health")
    yield url
    process.kill()


@pytest.fixture(scope="module")
def guess(server):
    return server + "/guess"


def rollout(model, tokenizer, files, n=4, temperature=1.0, budget=96, timeout=30.0):
    config = MultiTurnConfig(enable=True, max_assistant_turns=4, env_timeout_s=timeout)
    dataset = RLHFDataset(files, tokenizer, DataConfig(max_prompt_length=160), "data",
                          tools=ToolPrompting.from_config(config, tokenizer))
    engine = AgentRollout(HFRollout(model, tokenizer), config, max_response_length=budget)
    try:
        return dataset, engine.generate(dataset.collate(list(range(len(dataset.rows)))), SamplingParams(
            n=n, temperature=temperature, max_new_tokens=budget, seed=3, logprobs=True))
    finally:
        engine.shutdown()


def test_episodes_are_rows_of_first_observations(guess):
    rows = pq.read_table(resolve_data_file(f"openenv:{guess}?episodes=3&seed=5")).to_pylist()
    assert [r["prompt"] for r in rows] == [[{"role": "user", "content": PROMPT}]] * 3
    assert [(r["extra_info"]["seed"], r["extra_info"]["index"]) for r in rows] == [(5, 0), (6, 1), (7, 2)]
    assert {r["extra_info"]["env"]["field"] for r in rows} == {"guess"}


def test_a_rollout_plays_the_game_over_ws_sessions_and_the_rewards_are_the_servers_by_hand(guess, model,
                                                                                          tokenizer):
    """4 episodes x 4 samples = 16 sessions on a server that holds 2 at once: they queue, none fails. Each turn's
    reward is what the game gives the guess the model wrote, worked out here from the text."""
    source = f"openenv:{guess}?episodes=4&seed=0"
    _, batch = rollout(model, tokenizer, [source])
    non, responses = batch.non_tensor, batch.batch["responses"]
    width = responses.shape[1]
    present = batch.batch["attention_mask"][:, -width:]
    retries = 0
    assert list(non["env_error"]) == [None] * 16 and set(non["env_name"]) == {"openenv"}
    for i in range(16):
        number = (i // 4) % 10  # episode i // 4 reset with seed i // 4
        rewards = non["turn_rewards"][i]
        ids = responses[i][present[i].bool()].tolist()
        turns, start = [], 0
        for position, _ in rewards:  # each reward sits at a turn's eos: the text before it is that turn's guess
            turns.append(tokenizer.decode(ids[start:position + 1], skip_special_tokens=True))
            start = position + 1
        by_hand = []
        for text in turns:
            guessed = re.findall(r"\d+", text.split("<|assistant|>")[-1])
            by_hand.append(1.0 if guessed and int(guessed[-1]) == number else 0.0)
        assert [r for _, r in rewards] == by_hand, (turns, number)
        assert 1 <= len(rewards) <= 3 and all(r == 0.0 for r in by_hand[:-1])  # the game ends at a hit
        retries += len(rewards) > 1
    assert retries  # some trajectories played on after a miss
    scores, extras, _ = RewardManager(tokenizer, RewardConfig()).compute(batch)
    assert np.allclose(scores.sum(-1).numpy(), [sum(r for _, r in t) for t in non["turn_rewards"]])


def test_an_action_that_is_not_one_string_is_refused_with_its_schema(server):
    with pytest.raises(DataError) as caught:
        resolve_data_file(f"openenv:{server}/two?episodes=1")
    assert "not one string field" in str(caught.value) and '"confidence"' in str(caught.value)


def test_a_slow_server_past_the_timeout_costs_masked_samples(server, model, tokenizer):
    _, batch = rollout(model, tokenizer, [f"openenv:{server}/slow?episodes=2"], n=2, timeout=1.0)
    errors = batch.non_tensor["env_error"]
    assert all(e is not None and "did not answer within 1 s" in e for e in errors), errors
    assert batch.batch["response_mask"].sum() == 0


def test_verl_env_serve_gives_our_task_to_openenvs_client_with_the_same_prompts_and_rewards(model, tokenizer):
    """`verl env serve builtin:arithmetic/val`, read back through openenv: — the same prompts as the rows, and a
    greedy rollout over the sessions scores what our reward gives the same answers in process."""
    process, url = serve("-m", "verl.cli", "env", "serve", "builtin:arithmetic/val", "--max-concurrent-envs", "4")
    try:
        served = pq.read_table(resolve_data_file(f"openenv:{url}?episodes=6")).to_pylist()
        rows = pq.read_table(resolve_data_file("builtin:arithmetic/val")).to_pylist()[:6]
        assert [r["prompt"] for r in served] == [list(r["prompt"]) for r in rows]
        _, batch = rollout(model, tokenizer, [f"openenv:{url}?episodes=6"], n=1, temperature=0.0)
    finally:
        process.kill()
    texts = tokenizer.batch_decode(batch.batch["responses"], skip_special_tokens=True)
    from verl.rewards.registry import reward_for_data_source

    for i, row in enumerate(rows):
        fn = reward_for_data_source(row["data_source"])
        local = fn(row["data_source"], texts[i], row["reward_model"]["ground_truth"], row.get("extra_info"))
        assert batch.non_tensor["turn_rewards"][i][0][1] == local["score"]
        assert batch.non_tensor["num_turns"][i] == 1  # the served episode ends after one answer


def test_a_server_that_dies_mid_episode_costs_the_open_episodes_with_their_reason(server, model, tokenizer):
    """Last in the module: /die ends the games' process at its first step, closing every session mid-episode (no
    step ever answers, so no trajectory can end on a hit first: all eight cost)."""
    rows = resolve_data_file(f"openenv:{server}/die?episodes=4")  # read while it lives (resets only)
    _, batch = rollout(model, tokenizer, [str(rows)], n=2, timeout=20.0)
    errors = [e for e in batch.non_tensor["env_error"] if e is not None]
    assert len(errors) == 8, errors  # open when the server died, or unable to connect after
    assert all("ConnectionClosed" in e or "Failed to connect" in e for e in errors), errors
    assert batch.batch["response_mask"].sum() == 0

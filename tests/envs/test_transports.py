"""One environment, three transports, one answer: the built-in tool tasks (word problems, and the arithmetic the
tiny agent was warm-started on, so that some rewards are 1) rolled out with the configured calculator
(in-process), as an env: class (``verl.envs.tool_tasks:ToolTasks``), and served by ``verl env serve`` and read back
over OpenEnv's sessions give bit-identical trajectories (ids, loss masks) and rewards for the same seed, at
temperature 0 and 1 (sampling is seeded per trajectory); served on the arithmetic rows (one server process:
openenv's import alone takes seconds). Behaviour log-probs agree to float noise: which rows decode
together depends on when tool results arrive, and a batch's width moves the last bits of a matmul."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.model_fixtures import model_fixtures
from tests.ports import serve
from verl.config import DataConfig, MultiTurnConfig, RewardConfig
from verl.data.dataset import RLHFDataset
from verl.rollout.agent_loop import AgentRollout
from verl.rollout.base import SamplingParams
from verl.rollout.hf import HFRollout
from verl.tools.templates import ToolPrompting
from verl.workers.reward import RewardManager

MODEL = "builtin:tiny-agent"
ROWS = 8


tokenizer, model = model_fixtures(MODEL)  # the tiny agent, over the package's tiny-arith


@pytest.fixture(scope="module")
def agent(model, tokenizer):
    return model, tokenizer


def rollout(agent, source: str, config: MultiTurnConfig, temperature: float):
    """``ROWS`` rows of ``source`` (n=4 at temperature 1) -> the rollout batch and each trajectory's reward."""
    model, tokenizer = agent
    dataset = RLHFDataset([source], tokenizer, DataConfig(max_prompt_length=320), "data",
                          tools=ToolPrompting.from_config(config, tokenizer))
    engine = AgentRollout(HFRollout(model, tokenizer), config, max_response_length=128)
    try:
        batch = engine.generate(dataset.collate(list(range(ROWS))), SamplingParams(
            n=4 if temperature else 1, temperature=temperature, max_new_tokens=128, seed=7, logprobs=True))
    finally:
        engine.shutdown()
    scores, _, _ = RewardManager(tokenizer, RewardConfig()).compute(batch)
    return batch, scores.sum(-1)


@pytest.fixture(scope="module", params=[(t, d) for d in ("tool_arithmetic", "tool_word_problems") for t in (0.0, 1.0)],
                ids=["arithmetic-greedy", "arithmetic-sampled", "word_problems-greedy", "word_problems-sampled"])
def in_process(agent, request):
    temperature, task = request.param
    data = f"builtin:{task}/val"
    config = MultiTurnConfig(enable=True, tools=["calculator"], max_assistant_turns=3)
    return temperature, data, rollout(agent, data, config, temperature)


def same_trajectories(x, y) -> None:
    for key in ("responses", "response_mask", "attention_mask"):
        assert torch.equal(x.batch[key], y.batch[key]), key
    assert torch.allclose(x.batch["rollout_log_probs"], y.batch["rollout_log_probs"], atol=1e-4, rtol=0)
    for key in ("num_tool_calls", "num_tool_errors", "num_turns"):
        assert x.non_tensor[key].tolist() == y.non_tensor[key].tolist(), key


def same(a, b) -> None:
    (x, rx), (y, ry) = a, b
    assert torch.equal(x.batch["prompts"], y.batch["prompts"])
    same_trajectories(x, y)
    assert torch.equal(rx, ry), (rx, ry)


def test_the_env_class_gives_the_in_process_trajectories_and_rewards(agent, in_process):
    temperature, data, expected = in_process
    calls = expected[0].non_tensor["num_tool_calls"]
    if temperature:  # the comparison covers both kinds of trajectory
        assert int(np.sum(calls > 0)) >= 2 and int(np.sum(calls == 0)) >= 2, calls
    if temperature and "arithmetic" in data:  # and both rewards
        assert 0 < float(expected[1].mean()) < 1, expected[1]
    got = rollout(agent, f"env:verl.envs.tool_tasks:ToolTasks?data={data}", MultiTurnConfig(
        enable=True, max_assistant_turns=3), temperature)
    same(expected, got)
    assert set(got[0].non_tensor["env_name"]) == {"tool_tasks"}


@pytest.fixture(scope="module")
def served():
    """``verl env serve builtin:tool_arithmetic/val`` for the module (one server: openenv's import alone is seconds;
    the word problems take the same code path, and the env class test covers them)."""
    process, url = serve("-m", "verl.cli", "env", "serve", "builtin:tool_arithmetic/val")
    yield {"builtin:tool_arithmetic/val": url}
    process.kill()


@pytest.mark.parametrize("in_process", [(0.0, "tool_arithmetic"), (1.0, "tool_arithmetic")], indirect=True,
                         ids=["arithmetic-greedy", "arithmetic-sampled"])
def test_served_and_read_over_openenv_sessions_gives_the_same_trajectories(agent, in_process, served):
    """``verl env serve`` runs the calls itself (the client sends every turn), so the ids match to the last turn;
    a served episode scores its final answer, which is the in-process reward wherever the trajectory ended with one
    (a trajectory cut by a turn or length limit has no final step: no reward over OpenEnv, masked)."""
    temperature, data, (expected, rewards) = in_process
    batch, got = rollout(agent, f"openenv:{served[data]}?episodes={ROWS}", MultiTurnConfig(
        enable=True, max_assistant_turns=3), temperature)
    same_trajectories(expected, batch)
    non = batch.non_tensor
    ended = np.array([f == "stop" for f in non["finish_reason"]])
    assert torch.equal(got[ended], rewards[ended]), (got, rewards)
    assert torch.isnan(got[~ended]).all() and set(non["env_error"]) == {None}


def test_verl_eval_on_the_env_class_equals_verl_eval_with_the_configured_tool(tmp_path):
    """The same numbers through ``verl eval`` (pass@k over episodes with --n): every metric's value and CI."""
    from tests.eval.test_cli_e2e import cli

    common = ["eval", "--ckpt", MODEL, "--max-samples", "8", "--n", "4", "--max-new-tokens", "128", "--seed", "3"]
    results = {}
    for name, data in (("tools", ["--data", "builtin:tool_arithmetic/val", "--tools", "calculator"]),
                       ("env", ["--data", "env:verl.envs.tool_tasks:ToolTasks?data=builtin:tool_arithmetic/val"])):
        cli(*common, *data, "--out", str(tmp_path / name))
        results[name] = json.loads((tmp_path / name / "results.json").read_text())["metrics"]
    keys = ("value", "ci_low", "ci_high")
    assert {m: [v[k] for k in keys] for m, v in results["env"].items()} == \
        {m: [v[k] for k in keys] for m, v in results["tools"].items()}
    assert {"eval/pass@1", "eval/pass@4", "eval/tool_call_rate"} <= set(results["env"])
    assert 0 < results["env"]["eval/accuracy"]["value"] < 1 and results["env"]["eval/tool_call_rate"]["value"] > 0

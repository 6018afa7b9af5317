"""``env:<module>:<Class>``: a class written to TRL's ``environment_factory`` contract (tests/envs/calc_env.py) as
a source of episodes, rolled out on the shipped tool-using warm start: the class's methods are the tools the
prompt shows and the calls reach (each trajectory its own instance), its reward is the trajectory's, and a class
that breaks the contract is a one-line error or a counted, masked sample."""

from __future__ import annotations

import json
import random

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.model_fixtures import model_fixtures
from verl.config import DataConfig, MultiTurnConfig, RewardConfig, load_config
from verl.data.dataset import RLHFDataset
from verl.data.sources import resolve_data_file
from verl.errors import ConfigError, DataError
from verl.rollout.agent_loop import AgentRollout
from verl.rollout.base import SamplingParams
from verl.rollout.hf import HFRollout
from verl.tools.calculator import calculator
from verl.tools.templates import ToolPrompting
from verl.workers.reward import RewardManager

MODEL = "builtin:tiny-agent"  # calls the calculator in some trajectories at temperature 1
CALC = "env:tests.envs.calc_env:CalculatorEnv?data=builtin:tool_arithmetic/val"
TURNS = MultiTurnConfig(enable=True, max_assistant_turns=3)  # no configured tools: the class brings its own


tokenizer, model = model_fixtures(MODEL)  # the tiny agent, over the package's tiny-arith


@pytest.fixture(scope="module")
def agent(model, tokenizer):
    return model, tokenizer


def rollout(agent, source, rows=8, n=4, budget=96, turns=TURNS):
    model, tokenizer = agent
    dataset = RLHFDataset([source], tokenizer, DataConfig(max_prompt_length=256), "data",
                          tools=ToolPrompting.from_config(turns, tokenizer))
    engine = AgentRollout(HFRollout(model, tokenizer), turns, max_response_length=budget)
    try:
        return dataset, engine.generate(dataset.collate(list(range(rows))), SamplingParams(
            n=n, temperature=1.0, max_new_tokens=budget, seed=2, logprobs=True))
    finally:
        engine.shutdown()


def test_data_rows_are_episodes_with_the_class_methods_as_their_tools():
    data = pq.read_table(resolve_data_file("builtin:tool_arithmetic/val")).to_pylist()
    rows = pq.read_table(resolve_data_file(CALC)).to_pylist()
    assert [r["prompt"] for r in rows] == [r["prompt"] for r in data]  # reset() returned None: the row's prompt
    (schema,) = json.loads(rows[0]["tools"])  # calculator; not _private, not helper (no docstring), not reset
    assert schema["function"]["name"] == "calculator"
    assert schema["function"]["parameters"] == {"type": "object", "required": ["expression"], "properties": {
        "expression": {"type": "string", "description": "e.g. 37*412"}}}
    assert rows[3]["extra_info"]["env"]["kind"] == "env" and rows[3]["extra_info"]["index"] == 3
    assert json.loads(rows[3]["extra_info"]["env"]["reset"])["reward_model"]["ground_truth"] == \
        data[3]["reward_model"]["ground_truth"]


def test_generated_episodes_take_their_prompt_from_reset_and_a_file_path_names_the_class():
    rows = pq.read_table(resolve_data_file("env:tests/envs/calc_env.py:CountdownEnv?episodes=3&seed=5")).to_pylist()
    assert [r["prompt"] for r in rows] == [
        [{"role": "user", "content": f"Episode {i}: what is {random.Random(5 + i).randint(10, 99)} minus 7?"}]
        for i in range(3)]
    assert [(r["extra_info"]["seed"], json.loads(r["tools"])) for r in rows] == [(5, []), (6, []), (7, [])]


def test_the_calls_reach_each_trajectorys_own_instance_and_its_reward_is_the_trajectorys(agent):
    """Each trajectory's trace is its instance's history: the reward the class computes from its own calls
    (recomputed here from the trace, by the class's rule) sits at the trajectory's last generated token."""
    dataset, batch = rollout(agent, CALC)
    non = batch.non_tensor
    calls = non["num_tool_calls"]
    assert int(np.sum(calls > 0)) >= 4 and int(np.sum(calls == 0)) >= 4, calls
    mask = batch.batch["response_mask"]
    rewarded = 0
    for i in range(len(batch)):
        row = dataset.rows[i // 4]
        results = [t["result"] for t in non["tool_trace"][i] if t["error"] is None]
        assert all(t["result"] == calculator(t["arguments"]["expression"]) for t in non["tool_trace"][i]
                   if t["error"] is None)
        expected = float(str(row["reward_model"]["ground_truth"]) in results)
        last = int(mask[i].nonzero().max())
        assert non["env_error"][i] is None and non["turn_rewards"][i] == [(last, expected)], (i, non["turn_rewards"][i])
        rewarded += expected == 1.0
    assert rewarded >= 2
    scores, extras, _ = RewardManager(agent[1], RewardConfig()).compute(batch)
    assert scores.sum(-1).tolist() == [sum(r for _, r in t) for t in non["turn_rewards"]]
    assert np.allclose(extras["env_reward"], scores.sum(-1).numpy())
    assert np.allclose(extras["acc"], extras["env_reward"])  # an environment's row: its accuracy is the env's verdict


def test_a_class_that_breaks_the_contract_costs_its_samples_with_the_reason(agent):
    """Broken: its tool raises (the model reads the error; a tool error, not a failed sample) and its reward is
    not a number (every sample fails, masked, with the reason). Drifting: its reset answers a new prompt each time."""
    _, batch = rollout(agent, "env:tests.envs.calc_env:Broken?data=builtin:tool_arithmetic/val", rows=4, n=2)
    non = batch.non_tensor
    assert all("the reward must be a number" in e for e in non["env_error"]), non["env_error"]
    errors = [t["error"] for trace in non["tool_trace"] for t in trace]
    assert errors and all("failed: the abacus is broken" in e for e in errors)
    assert int(batch.batch["response_mask"].sum()) == 0
    _, batch = rollout(agent, "env:tests.envs.calc_env:Drifting?episodes=2", rows=2, n=2)
    assert all("gave another prompt" in e for e in batch.non_tensor["env_error"])


def test_a_tool_that_hangs_answers_the_model_with_the_timeout_and_the_sample_goes_on(agent):
    turns = MultiTurnConfig(enable=True, max_assistant_turns=3, env_timeout_s=1.0)
    _, batch = rollout(agent, "env:tests.envs.calc_env:Sleepy?data=builtin:tool_arithmetic/val", rows=4, n=4,
                       turns=turns)
    non = batch.non_tensor
    errors = [t["error"] for trace in non["tool_trace"] for t in trace]
    assert errors and all("did not answer within 1 s" in e for e in errors), errors
    assert set(non["env_error"]) == {None} and all(r == [(r[0][0], 0.0)] for r in non["turn_rewards"])


@pytest.mark.parametrize(("name", "needles"), [
    ("env:tests.envs.calc_env:NoReward", ["NoReward has neither a 'reward' attribute nor get_reward()"]),
    ("env:tests.envs.calc_env:NoSchema", ["the tool NoSchema.lookup has no schema", "type-hint every argument"]),
    ("env:tests.envs.calc_env:Missing", ["has no 'Missing'"]),
    ("env:tests/envs/nowhere.py:X", ["file 'tests/envs/nowhere.py' does not exist"]),
    ("env:tests.envs.calc_env:CalculatorEnv?turns=3", ["turns not a key here; env: takes episodes, seed and data"]),
    ("env:tests.envs.calc_env:CountdownEnv?data=x.parquet&seed=1", ["give data= or episodes=/seed=, not both"]),
])
def test_bad_classes_are_one_line_errors(name, needles):
    with pytest.raises((DataError, ConfigError)) as caught:
        resolve_data_file(name)
    assert all(n in str(caught.value) for n in needles), str(caught.value)


def test_a_reset_that_gives_no_prompt_or_cannot_take_the_row_is_refused_when_read():
    with pytest.raises(DataError, match="reset\\(\\) returned no prompt for a generated episode"):
        resolve_data_file("env:tests.envs.calc_env:Silent?episodes=2")
    with pytest.raises(DataError, match="CalculatorEnv\\(\\).reset\\(\\) failed on row 0: TypeError.*reward_model"):
        resolve_data_file("env:tests.envs.calc_env:CalculatorEnv?episodes=2")  # it needs data rows


def test_a_run_on_environment_episodes_needs_the_multi_turn_rollout_and_no_configured_tools():
    source = f"data.train_files=[{CALC}]"
    with pytest.raises(ConfigError, match="is an environment's episodes.*set rollout.multi_turn.enable=true"):
        load_config(None, [source])
    cfg = load_config(None, [source, f"data.val_files=[{CALC}]", "rollout.multi_turn.enable=true"])
    assert cfg.rollout.multi_turn.tools == [] and cfg.data.train_files == [CALC]
    with pytest.raises(ConfigError, match="needs tools .* or an environment's episodes as data"):
        load_config(None, ["rollout.multi_turn.enable=true"])


def test_the_readmes_environment_line_trains(tmp_path):
    """README "Environments": its command as written, shortened to one step, trains on the env class's episodes
    and logs the environment's own metrics."""
    import shlex

    from tests.eval.test_cli_e2e import cli
    from tests.readme import readme_block
    from verl.utils.log import read_jsonl

    words = shlex.split(readme_block("## Environments: reasoning-gym").replace("\\\n", " "))
    assert words[:2] == ["verl", "train"]
    cli(*words[1:], "trainer.total_steps=1", "trainer.test_freq=0", "trainer.val_before_train=false",
        "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=2", "trainer.save_freq=0",
        f"trainer.output_dir={tmp_path}")
    rollout = next(r for r in read_jsonl(next(tmp_path.rglob("verl_logs.jsonl"))) if r.get("scope") == "rollout")
    assert rollout["env/tool_tasks/error_rate"] == 0.0 and rollout["env/tool_tasks/step_seconds_mean"] > 0

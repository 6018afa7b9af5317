"""``verl train`` with your agent (issue 64, item 3): the trainer serves its policy, runs an agent written against
the official ``openai`` client (examples/openai_agent.py) ``rollout.n`` times per prompt, learns from the recorded
ids and log-probs, and pushes each update's weights into the serving engine in place. Wrong agents are masked or
refused with their reason."""

from __future__ import annotations

import copy
import json
import sys
import time

import pyarrow.parquet as pq
import pytest
import torch

from tests.trainer_utils import fit_and_shutdown, rows
from verl.config import SFTConfig, build_config
from verl.data.builtin import resolve_builtin, write_parquet
from verl.errors import ConfigError
from verl.rollout.base import SamplingParams
from verl.trainer.local import LocalPPOTrainer
from verl.trainer.sft import AGENT_WARM_START, SFTTrainer

AGENT = "examples/openai_agent.py:solve"
HERE = __file__


def gateway_config(tmp_path, agent: str, steps: int = 2, **rollout) -> dict:
    return {
        "model": {"path": "builtin:tiny-agent"},
        "data": {"train_files": ["builtin:tool_arithmetic/train"], "val_files": ["builtin:tool_arithmetic/val"],
                 "max_prompt_length": 64, "max_response_length": 64, "train_batch_size": 2, "val_max_samples": 4},
        "rollout": {"n": 2, "gateway": {"agent": agent, "max_concurrent_episodes": 4, **rollout}},
        "actor": {"ppo_mini_batch_size": 2, "optim": {"lr": 1e-3}},
        "trainer": {"total_steps": steps, "test_freq": 0, "val_before_train": False, "save_freq": 0,
                    "logger": ["jsonl"], "output_dir": str(tmp_path), "experiment_name": "g", "seed": 3},
    }


def test_an_openai_client_agent_trains_and_the_served_weights_follow_the_actor(tmp_path):
    trainer = LocalPPOTrainer(build_config(gateway_config(tmp_path, AGENT)), quiet=True)
    gateway = trainer.rollout
    service = gateway.policy.service
    try:
        trainer.fit()
        # After the last update the engine serves exactly the actor's weights (copied in place, not reloaded).
        served = dict(service.lifecycle.engine.model.named_parameters())
        for name, param in trainer.model.named_parameters():
            assert torch.equal(served[name], param.detach()), name
        records = [r for r in service.records.snapshot() if r.get("episode")]
    finally:
        trainer.shutdown()
    # Each step's rollout sampled with the weights of the step before it: versions 1 (the start), then 2.
    by_rollout = {}
    for r in records:
        by_rollout.setdefault(r["episode"].split("-")[0], set()).add(r["weight_version"])
    assert by_rollout == {"r0": {1}, "r1": {2}}
    assert {r["episode"] for r in records} == {f"r{k}-p{p}-s{s}" for k in (0, 1) for p in (0, 1) for s in (0, 1)}
    assert all(len(r["token_ids"]) == len(r["logprobs"]) == r["completion_tokens"] for r in records)
    train = rows(trainer.config.log_path(), "rollout")
    assert [r["step"] for r in train if "gateway/episodes" in r] == [1, 2]
    assert all(r["gateway/episodes"] == 4 and r["gateway/failed"] == 0 and r["gateway/calls"] >= 4 for r in train
               if "gateway/episodes" in r)
    assert all(r["gateway/rerendered"] == 0 for r in train if "gateway/episodes" in r)


def summarising_agent(client, row):
    """Calls once, then starts over from a summary of what it has (its own history handling): two samples."""
    first = client.chat.completions.create(model=row["model"], messages=row["messages"], max_tokens=16,
                                           seed=row["seed"]).choices[0].message.content
    summary = [{"role": "user", "content": f"{row['messages'][-1]['content']} (a first try said: {first[:20]})"}]
    client.chat.completions.create(model=row["model"], messages=summary, max_tokens=16, seed=row["seed"])


def test_an_agent_that_rewrites_its_history_gives_one_sample_per_history(tmp_path):
    trainer = LocalPPOTrainer(build_config(gateway_config(tmp_path, f"{HERE}:summarising_agent", steps=1)), quiet=True)
    fit_and_shutdown(trainer)
    [rollout] = [r for r in rows(trainer.config.log_path(), "rollout") if "gateway/episodes" in r]
    assert rollout["gateway/samples_per_episode"] == 2 and rollout["gateway/rewritten"] == 4
    assert rollout["num_responses"] == 8
    # 8 samples are two mini-batches of ppo_mini_batch_size x n = 4: the update needs the old log-probs (a batch of
    # the configured 4 would not compute them), and ran.
    [timing] = rows(trainer.config.log_path(), "timing")
    assert timing["old_log_prob"] > 0 and timing["update_actor"] > 0


def reward_agent(client, row):
    """Returns its own reward: 1 when the final answer names the ground truth."""
    reply = client.chat.completions.create(model=row["model"], messages=row["messages"], max_tokens=16,
                                           temperature=1.0, seed=row["seed"])
    return float(row["ground_truth"] in (reply.choices[0].message.content or ""))


def flaky_agent(client, row):
    """Raises on sample 1's episodes, never calls the model on prompt 0's sample 0, outlives its time on prompt 1's
    sample 0; the rest answer and return 0.5."""
    if row["episode_id"].endswith("s1"):
        raise RuntimeError("the agent's own bug")
    if row["episode_id"].endswith("p0-s0"):
        return None
    if row["episode_id"].endswith("p1-s0"):
        time.sleep(4)
    client.chat.completions.create(model=row["model"], messages=row["messages"], max_tokens=8, seed=row["seed"])
    return 0.5


def test_an_agents_reward_is_the_episodes_and_its_failures_are_masked_with_the_reason(tmp_path, capfd):
    config = gateway_config(tmp_path / "reward", f"{HERE}:reward_agent", steps=1)
    trainer = LocalPPOTrainer(build_config(config), quiet=True)
    fit_and_shutdown(trainer)
    [train] = [r for r in rows(trainer.config.log_path(), "rollout") if "gateway/episodes" in r]
    assert train["env/gateway/error_rate"] == 0 and 0 <= train["env/gateway/reward_mean"] <= 1

    config = gateway_config(tmp_path / "flaky", f"{HERE}:flaky_agent", steps=1, episode_timeout_s=2.0)
    config["rollout"]["n"] = 4
    config["reward"] = {"model": {"max_failed_share": 0.9}}
    trainer = LocalPPOTrainer(build_config(config), quiet=True)
    fit_and_shutdown(trainer)
    [train] = [r for r in rows(trainer.config.log_path(), "rollout") if "gateway/episodes" in r]
    # 2 raised + 1 never called the model + 1 past its time = 4 of 8 masked and counted; the others' reward is 0.5.
    assert train["gateway/failed"] == 4 and train["env/gateway/error_rate"] == 0.5
    assert train["env/gateway/reward_mean"] == 0.5
    # One line per kind of failure, with an episode that had it.
    said = [line for line in capfd.readouterr().err.splitlines() if "rollout.gateway" in line]  # uvicorn's log
    assert any("r0-p0-s1: RuntimeError: the agent's own bug" in line for line in said), said
    assert any("made no call to the served model" in line for line in said), said
    assert any("r0-p1-s0: the episode did not end within 2 s" in line for line in said), said



def test_unknown_agents_are_refused_before_training(tmp_path):
    with pytest.raises(ConfigError, match="rollout.gateway.agent 'no_such_module:solve'"):
        LocalPPOTrainer(build_config(gateway_config(tmp_path, "no_such_module:solve")), quiet=True)
    with pytest.raises(ConfigError, match="drop rollout.multi_turn.enable"):
        config = gateway_config(tmp_path, AGENT)
        config["rollout"]["multi_turn"] = {"enable": True, "tools": ["calculator"]}
        build_config(config)


def test_a_command_agent_gets_the_served_policy_in_its_environment(tmp_path):
    script = tmp_path / "agent.py"
    script.write_text(
        "import json, os, sys\n"
        "from openai import OpenAI\n"
        "row = json.load(sys.stdin)\n"
        "client = OpenAI(default_headers={'X-Session-ID': os.environ['VERL_EPISODE_ID']})\n"
        "reply = client.chat.completions.create(model=row['model'], messages=row['messages'], max_tokens=8)\n"
        "print(json.dumps({'said': reply.choices[0].message.content}))\n"
        "print(0.25)\n")
    config = gateway_config(tmp_path, None, steps=1)
    config["rollout"]["gateway"] = {"command": [sys.executable, str(script)], "max_concurrent_episodes": 2}
    trainer = LocalPPOTrainer(build_config(config), quiet=True)
    fit_and_shutdown(trainer)
    [train] = [r for r in rows(trainer.config.log_path(), "rollout") if "gateway/episodes" in r]
    assert train["gateway/failed"] == 0 and train["env/gateway/reward_mean"] == 0.25
    assert json.loads(json.dumps(train["gateway/calls"])) == 4


@pytest.fixture(scope="module")
def calling_agent(tmp_path_factory) -> str:
    """The warm start answers at once at temperature 0 (three quarters of its SFT conversations do); ten `verl sft`
    steps on the SFT conversations that call the calculator give a checkpoint whose greedy answers call it."""
    root = tmp_path_factory.mktemp("calling")
    table = pq.read_table(resolve_builtin("builtin:tool_arithmetic/sft_train")).to_pylist()
    write_parquet([r for r in table if '"tool_calls"' in r["messages"]], root / "calls.parquet")
    settings = copy.deepcopy(AGENT_WARM_START)
    settings["model"]["path"] = "builtin:tiny-agent"
    settings["data"].update(train_files=[str(root / "calls.parquet")], val_files=[])
    settings["optim"] = {"lr": 1e-3}
    settings["trainer"].update(total_steps=10, test_freq=0, output_dir=str(root), experiment_name="calls",
                               logger=["jsonl"])
    return str(SFTTrainer(build_config(settings, schema=SFTConfig), quiet=True).fit())


def greedy_trajectories(tmp_path, model: str, rollout: dict, prompts: int = 16) -> tuple[list, object]:
    """Each prompt's whole token sequence (prompt, then every id of the trajectory), its loss mask and its behaviour
    log-probs, as the trainer built with ``rollout`` generates them at temperature 0."""
    config = gateway_config(tmp_path, AGENT)
    config["model"]["path"] = model
    config["data"].update(max_response_length=128, val_max_samples=prompts)
    config["rollout"] = {"n": 2, **rollout}
    trainer = LocalPPOTrainer(build_config(config), quiet=True)
    try:
        out = trainer.rollout.generate(trainer.val_dataset.collate(list(range(prompts))),
                                       SamplingParams(n=1, temperature=0.0, max_new_tokens=128, logprobs=True))
    finally:
        trainer.shutdown()
    width = out.batch["prompts"].shape[1]
    found = []
    for i in range(len(out)):
        present = out.batch["attention_mask"][i].bool()
        ids = out.batch["input_ids"][i][present].tolist()
        mask = out.batch["response_mask"][i][present[width:]].tolist()
        found.append((ids, mask, out.batch["rollout_log_probs"][i][present[width:]]))
    return found, out


def test_an_agent_that_mirrors_the_built_in_loop_gives_its_trajectories_token_for_token(tmp_path, calling_agent):
    """Issue 64's token identity: examples/openai_agent.py:solve (the openai client's tool loop, the calculator
    run by the agent) through the gateway samples, at temperature 0, the very ids of the built-in multi-turn loop
    (the calculator run by our tool runner): same prompt ids, same calls, same tool-turn ids, same answers, same
    loss mask, and behaviour log-probs equal to float rounding."""
    built_in, ours = greedy_trajectories(
        tmp_path / "built-in", calling_agent,
        {"multi_turn": {"enable": True, "tools": ["calculator"], "max_assistant_turns": 3}})
    gateway, theirs = greedy_trajectories(
        tmp_path / "gateway", calling_agent, {"gateway": {"agent": AGENT, "max_concurrent_episodes": 4}})
    assert list(theirs.non_tensor["episode"]) == [f"r0-p{i}-s0" for i in range(16)]  # one sample per episode
    assert theirs.meta["gateway"]["rerendered"] == 0 and theirs.meta["gateway"]["failed"] == 0
    # Not vacuous: every trajectory called the calculator and answered after its result.
    assert all(ours.non_tensor["num_tool_calls"] >= 1) and set(ours.non_tensor["finish_reason"]) == {"stop"}
    for i, ((ids, mask, logp), (ids_g, mask_g, logp_g)) in enumerate(zip(built_in, gateway, strict=True)):
        assert ids_g == ids, (i, len(ids), len(ids_g))
        assert mask_g == mask and 0 in mask, i  # the tool turn is context (mask 0) in both
        torch.testing.assert_close(logp_g, logp, atol=1e-4, rtol=0)

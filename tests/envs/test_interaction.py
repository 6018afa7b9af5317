"""verl's interaction hooks (``rollout.multi_turn.interaction_config_path``) on a real model: a verl user's
``BaseInteraction`` class answers the turns, its scores are the reward at each turn's end and reach the advantage;
a misbehaving one costs masked, counted samples with their reason, within the timeout."""

from __future__ import annotations

import json
import time

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from verl.algos.advantages import get_adv_estimator
from verl.config import DataConfig, MultiTurnConfig, RewardConfig
from verl.data.builtin import write_parquet
from verl.data.dataset import RLHFDataset
from verl.data.sources import resolve_data_file
from verl.errors import ConfigError
from verl.rollout.agent_loop import AgentRollout
from verl.rollout.base import SamplingParams
from verl.rollout.hf import HFRollout
from verl.tools.templates import ToolPrompting
from verl.workers.reward import RewardManager

WRONG = "Your response is incorrect! Try again."


def interaction_file(path, cls: str = "tests.envs.retry_interaction.RetryInteraction", **config) -> str:
    path.write_text("interaction:\n  - name: retry\n    class_name: " + cls + "\n    config: "
                    + json.dumps(config) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def rows_file(tmp_path_factory):
    """Arithmetic rows as verl's interaction examples write them: extra_info.interaction_kwargs names the
    interaction and carries what it checks against; every other row is marked for the hostile tests."""
    rows = pq.read_table(resolve_data_file("builtin:arithmetic/val")).to_pylist()[:8]
    for i, row in enumerate(rows):
        row["extra_info"] = {"interaction_kwargs": {"name": "retry", "hostile": i % 2 == 1,
                                                    "ground_truth": str(row["reward_model"]["ground_truth"])}}
    return str(write_parquet(rows, tmp_path_factory.mktemp("rows") / "rows.parquet"))


def rollout(model, tokenizer, rows_file, config: MultiTurnConfig, n: int = 2, budget: int = 64):
    prompts = RLHFDataset([rows_file], tokenizer, DataConfig(max_prompt_length=64), "rows",
                          tools=ToolPrompting.from_config(config, tokenizer)).collate(list(range(8)))
    engine = AgentRollout(HFRollout(model, tokenizer), config, max_response_length=budget)
    try:
        return engine.generate(prompts, SamplingParams(n=n, temperature=1.0, max_new_tokens=budget, seed=1,
                                                       logprobs=True))
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def retried(model, tokenizer, rows_file, tmp_path_factory):
    path = interaction_file(tmp_path_factory.mktemp("cfg") / "retry.yaml", wrong_text=WRONG)
    config = MultiTurnConfig(enable=True, interaction_config_path=path, max_assistant_turns=3)
    return rollout(model, tokenizer, rows_file, config, n=4)


def test_the_interaction_answers_each_turn_and_its_scores_sit_at_the_turn_ends(retried, tokenizer):
    non, responses = retried.non_tensor, retried.batch["responses"]
    mask, width = retried.batch["response_mask"], responses.shape[1]
    present = retried.batch["attention_mask"][:, -width:]
    retries = 0
    for i in range(len(responses)):
        rewards = non["turn_rewards"][i]
        assert non["env_error"][i] is None and non["env_name"][i] == "retry"
        # One score per assistant turn that ended in eos, at that eos (a generated id).
        eos = [t for t in range(width) if present[i, t] and mask[i, t] and responses[i, t] == tokenizer.eos_token_id]
        assert [p for p, _ in rewards] == eos[:len(rewards)] and len(rewards) >= 1
        text = tokenizer.decode(responses[i][present[i].bool()])
        # A wrong answer (score 0) is followed by the interaction's reply, as a user turn the loss does not train.
        zeros = sum(1 for _, r in rewards if r == 0.0)
        assert text.count(WRONG) == zeros or (non["finish_reason"][i] == "length" and text.count(WRONG) == zeros - 1)
        assert all(r == 0.0 for _, r in rewards[:-1])  # a right answer ends the conversation
        if rewards[0][1] == 1.0:
            assert non["num_turns"][i] == 1 and non["finish_reason"][i] == "stop"
        else:
            retries += 1
            start = eos[0] + 1
            assert mask[i, start:start + 4].sum() == 0  # the reply's template ids: context, not action
    assert 0 < retries < len(responses)  # the sample mixes both kinds


def test_the_scores_are_the_reward_and_reach_the_advantage_by_hand(retried, tokenizer):
    scores, extras, _ = RewardManager(tokenizer, RewardConfig()).compute(retried)
    turn_rewards = retried.non_tensor["turn_rewards"]
    for i, rewards in enumerate(turn_rewards):
        expected = torch.zeros(scores.shape[1])
        for position, reward in rewards:
            expected[position] += reward
        assert torch.equal(scores[i], expected)
    assert np.allclose(extras["env_reward"], [sum(r for _, r in rows) for rows in turn_rewards])
    # GRPO: (sum of the turns' scores - the group's mean) / (its std + 1e-6), on every generated token.
    group = np.repeat(np.arange(8), 4)
    advantages, _ = get_adv_estimator("grpo")(scores, retried.batch["response_mask"], group)
    total = torch.tensor([sum(r for _, r in rows) for rows in turn_rewards])
    for g in range(8):
        members = total[4 * g:4 * g + 4]
        by_hand = (members - members.mean()) / (members.std() + 1e-6)
        for k in range(4):
            row = 4 * g + k
            generated = retried.batch["response_mask"][row].bool()
            assert torch.allclose(advantages[row][generated], by_hand[k].expand(int(generated.sum())))
    assert advantages.abs().sum() > 0


@pytest.mark.parametrize(("mode", "needle"), [
    ("raises", "ValueError: the checker crashed"),
    ("hangs", "did not answer within 1 s (rollout.multi_turn.env_timeout_s)"),
    ("malformed", "must return (should_terminate, text, score, extra)"),
    ("bad_reward", "could not convert string to float"),
    ("start_raises", "RuntimeError: the environment could not start"),
])
def test_a_hostile_interaction_costs_masked_counted_samples_and_nothing_hangs(model, tokenizer, rows_file, tmp_path,
                                                                              mode, needle):
    path = interaction_file(tmp_path / "hostile.yaml", "tests.envs.hostile_interaction.HostileInteraction",
                            mode=mode, wrong_text=WRONG)
    config = MultiTurnConfig(enable=True, interaction_config_path=path, max_assistant_turns=3, env_timeout_s=1)
    t0 = time.monotonic()
    batch = rollout(model, tokenizer, rows_file, config)
    assert time.monotonic() - t0 < 60
    non = batch.non_tensor
    hostile = np.repeat(np.arange(8) % 2 == 1, 2)
    errors = non["env_error"]
    assert all(needle in errors[i] for i in np.flatnonzero(hostile)), errors
    assert all(errors[i] is None for i in np.flatnonzero(~hostile))
    assert batch.batch["response_mask"][torch.as_tensor(hostile)].sum() == 0  # nothing of a failed sample is learnt
    assert all(non["finish_reason"][i] == "env_error" for i in np.flatnonzero(hostile))
    scores, _, _ = RewardManager(tokenizer, RewardConfig()).compute(batch)
    assert torch.isnan(scores[torch.as_tensor(hostile)]).any(-1).all()  # missing, never 0: the trainer masks them
    assert not torch.isnan(scores[torch.as_tensor(~hostile)]).any()


def test_bad_interaction_files_are_clear_errors(tmp_path, model, tokenizer, rows_file):
    cases = {"interaction: []\n": "needs a list",
             "interaction:\n  - class_name: NoDots\n": "class_name must be a dotted path",
             "interaction:\n  - class_name: tests.envs.nothing.Missing\n": "cannot import tests.envs.nothing.Missing",
             ("interaction:\n  - class_name: tests.envs.retry_interaction.RetryInteraction\n"
              "  - class_name: tests.envs.retry_interaction.RetryInteraction\n"): "the name 'retry' is taken"}
    for number, (text, needle) in enumerate(cases.items()):
        path = tmp_path / f"{number}.yaml"
        path.write_text(text)
        with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
            AgentRollout(HFRollout(model, tokenizer), MultiTurnConfig(enable=True, interaction_config_path=str(path)),
                         max_response_length=8)


def test_a_verl_launch_line_trains_through_the_interaction(tmp_path, rows_file):
    """verl's own keys name the interaction; the run logs its reward per environment and trains on it."""
    from typer.testing import CliRunner

    from verl.cli import app
    from verl.utils.log import read_jsonl

    path = interaction_file(tmp_path / "retry.yaml", wrong_text=WRONG)
    result = CliRunner().invoke(app, [
        "train", "--config", "configs/grpo_tiny.yaml", f"data.train_files={rows_file}",
        f"data.val_files={rows_file}", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8",
        "data.max_response_length=48",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={path}",
        "actor_rollout_ref.rollout.multi_turn.max_user_turns=1", "trainer.total_steps=1", "trainer.test_freq=0",
        f"trainer.output_dir={tmp_path / 'out'}"])
    assert result.exit_code == 0, result.output
    log = next((tmp_path / "out").rglob("verl_logs.jsonl"))
    rollout = next(r for r in read_jsonl(log) if r.get("scope") == "rollout")
    assert rollout["env/retry/error_rate"] == 0.0 and 1.0 <= rollout["env/retry/turns_mean"] <= 2.0
    assert rollout["env/retry/reward_mean"] == pytest.approx(rollout["reward_mean"])  # the interaction's is the reward
    # every trajectory's start and at least one reply (max_user_turns=1) each took some time; length as logged
    assert rollout["env/retry/step_seconds_mean"] > 0
    assert rollout["env/retry/length_mean"] == pytest.approx(rollout["trajectory_length_mean"])

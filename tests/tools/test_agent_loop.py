"""The multi-turn rollout (``verl/rollout/agent_loop.py``) on the shipped tool-using warm start, a real model.

Sampled at temperature 1 the warm start calls the calculator in some trajectories and answers at once in others,
so every check below sees both kinds. What is checked, per trajectory:

- the layout: generated ids (loss mask 1) alternate with tool turns (mask 0, attention 1), each tool turn exactly
  the ids the chat template adds for that tool message, each assistant turn but a cut last one ending in eos;
- token-in, token-out: a fresh forward pass over the recorded ids gives the recorded behaviour log-probs at every
  generated position (the ids the model saw are the ids the trainer trains on: nothing was re-tokenized);
- the limits: ``max_assistant_turns`` and the response budget, with the matching ``finish_reason``;
- determinism: the same seed gives the same trajectories, whatever the tools' timing.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

from tests.model_fixtures import model_fixtures
from tests.tools.trajectories import check_trajectory_layout
from verl.config import DataConfig, MultiTurnConfig
from verl.data.dataset import RLHFDataset
from verl.rollout.agent_loop import AgentRollout
from verl.rollout.base import SamplingParams
from verl.rollout.hf import HFRollout
from verl.tools.templates import ToolPrompting
from verl.workers.reward import RewardManager

MODEL = "builtin:tiny-agent"
TOOLS = MultiTurnConfig(enable=True, tools=["calculator"], max_assistant_turns=3)
tokenizer, model = model_fixtures(MODEL)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    dataset = RLHFDataset(["builtin:tool_arithmetic/val"], tokenizer, DataConfig(max_prompt_length=64), "val",
                          tools=ToolPrompting.from_config(TOOLS, tokenizer))
    return dataset.collate(list(range(12)))


def rollout(model, tokenizer, prompts, config=TOOLS, budget=128, n=4, seed=1, temperature=1.0):
    engine = AgentRollout(HFRollout(model, tokenizer), config, max_response_length=budget)
    try:
        return engine.generate(prompts, SamplingParams(n=n, temperature=temperature, max_new_tokens=budget,
                                                       seed=seed, logprobs=True))
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def batch(model, tokenizer, prompts):
    return rollout(model, tokenizer, prompts)


def test_trajectories_alternate_generated_turns_and_template_tool_turns(batch, tokenizer):
    non = batch.non_tensor
    assert int(np.sum(non["num_tool_calls"] > 0)) >= 4 and int(np.sum(non["num_tool_calls"] == 0)) >= 4
    check_trajectory_layout(batch, tokenizer, TOOLS)


def test_the_recorded_log_probs_are_the_models_on_the_recorded_ids(batch, model):
    """Token-in, token-out: one forward pass over prompt + trajectory reproduces every generated token's
    behaviour log-prob; tool-turn positions carry none."""
    ids, attention = batch.batch["input_ids"], batch.batch["attention_mask"]
    width = batch.batch["responses"].shape[1]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention,
                       position_ids=batch.batch["position_ids"]).logits.float()
    log_probs = torch.log_softmax(logits[:, -width - 1:-1], dim=-1)
    chosen = log_probs.gather(-1, batch.batch["responses"].unsqueeze(-1)).squeeze(-1)
    mask = batch.batch["response_mask"].bool()
    recorded = batch.batch["rollout_log_probs"]
    assert torch.allclose(chosen[mask], recorded[mask], atol=2e-4), (chosen[mask] - recorded[mask]).abs().max()
    assert torch.all(recorded[~mask] == 0)


def test_the_reward_scores_the_whole_trajectory_at_its_last_generated_token(batch, tokenizer):
    token_scores, extras, texts = RewardManager(tokenizer).compute(batch)
    mask = batch.batch["response_mask"]
    for i in range(len(batch)):
        last = int(torch.nonzero(mask[i]).max())
        assert torch.count_nonzero(token_scores[i]) <= 1 and token_scores[i, last] == token_scores[i].sum()
        for call in batch.non_tensor["tool_trace"][i]:
            if batch.non_tensor["finish_reason"][i] != "length" and call["result"] is not None:
                assert call["result"] in texts[i]  # the text the reward reads includes the tool results
    # Trajectories that called the tool and answered with its result are the correct ones.
    correct = extras["acc"] > 0
    assert np.all(batch.non_tensor["num_tool_calls"][correct] > 0)


def test_max_assistant_turns_and_the_budget_end_trajectories(model, tokenizer, prompts):
    one_turn = rollout(model, tokenizer, prompts, MultiTurnConfig(enable=True, tools=["calculator"],
                                                                  max_assistant_turns=1))
    assert np.all(one_turn.non_tensor["num_turns"] == 1)
    # A call in the last allowed turn ends the trajectory there: counted, but nothing runs, no tool turn follows.
    ended = one_turn.non_tensor["finish_reason"] == "turns"
    assert ended.any() and np.all(one_turn.non_tensor["num_tool_calls"][ended] >= 1)
    assert all(call["result"] is None and call["error"].startswith("not run")
               for trace in one_turn.non_tensor["tool_trace"] for call in trace)
    texts = tokenizer.batch_decode(one_turn.batch["responses"], skip_special_tokens=True)
    assert all("<tool_call>" in texts[i] for i in np.flatnonzero(ended))
    assert torch.all(one_turn.batch["response_mask"] == one_turn.batch["attention_mask"][:, -one_turn.batch[
        "responses"].shape[1]:])  # no tool turn was appended
    short = rollout(model, tokenizer, prompts, budget=24)
    width = short.batch["responses"].shape[1]
    lengths = short.batch["attention_mask"][:, -width:].sum(-1)
    assert width <= 24 and torch.all(lengths <= 24)
    cut = lengths == 24
    assert cut.any() and set(short.non_tensor["finish_reason"][cut.numpy()]) == {"length"}


def test_the_same_seed_gives_the_same_trajectories(model, tokenizer, prompts, batch):
    again = rollout(model, tokenizer, prompts)
    assert torch.equal(again.batch["responses"], batch.batch["responses"])
    assert list(again.non_tensor["finish_reason"]) == list(batch.non_tensor["finish_reason"])
    other = rollout(model, tokenizer, prompts, seed=2)
    assert not torch.equal(other.batch["responses"][:, :8], batch.batch["responses"][:, :8])


AGENT = {
    "model": {"path": MODEL},
    "data": {"train_files": ["builtin:tool_arithmetic/train"], "val_files": ["builtin:tool_arithmetic/val"],
             "max_prompt_length": 64, "max_response_length": 96, "train_batch_size": 4, "val_max_samples": 8},
    "rollout": {"n": 4, "multi_turn": {"enable": True, "tools": ["calculator"], "max_assistant_turns": 3}},
    "actor": {"ppo_mini_batch_size": 4},
    "trainer": {"total_steps": 1, "test_freq": 1, "val_before_train": False, "save_freq": 0, "logger": ["jsonl"],
                "num_samples_to_log": 1, "evaluators": ["accuracy", "tools"]},
}


def agent_config(tmp_path, **sections) -> dict:
    import copy

    cfg = copy.deepcopy(AGENT)
    cfg["trainer"].update(output_dir=str(tmp_path), experiment_name="agent")
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


def logged(trainer, scope: str) -> list[dict]:
    import json

    return [r for r in map(json.loads, trainer.config.log_path().read_text().splitlines()) if r["scope"] == scope]


@pytest.mark.e2e
@pytest.mark.parametrize(("name", "sections"), [
    ("grpo", {}),
    ("rloo", {"algorithm": {"adv_estimator": "rloo"}}),
    ("reinforce++", {"algorithm": {"adv_estimator": "reinforce_plus_plus"}}),
    ("gae", {"algorithm": {"adv_estimator": "gae"}}),
    ("lora", {"model": {"path": MODEL, "lora": {"rank": 8}}}),
    ("one-step-off-policy", {"trainer": {"one_step_off_policy": True, "total_steps": 2}}),
])
def test_a_training_step_on_agent_trajectories(tmp_path, name, sections):
    from verl.trainer.local import LocalPPOTrainer

    cfg = agent_config(tmp_path, **sections)
    trainer = LocalPPOTrainer(cfg, quiet=True)
    trainer.fit()
    rollout_row = logged(trainer, "rollout")[-1]
    assert 0 <= rollout_row["tool_call_rate"] <= 1 and rollout_row["turns_mean"] >= 1
    ppo = logged(trainer, "ppo")[-1]
    assert np.isfinite(ppo["policy_loss"]) and np.isfinite(ppo["entropy"])
    evaluation = logged(trainer, "eval")[-1]
    assert {"accuracy", "tool_call_rate", "turns_mean"} <= set(evaluation)


SLOW_CALCULATOR = '''
import time

from verl.tools.calculator import calculator as exact


def calculator(expression):
    time.sleep(0.2)
    return exact(expression)
'''


def test_max_num_seqs_bounds_the_decode_width_and_fills_tool_waits(model, tokenizer, prompts, batch, tmp_path):
    """vLLM's ``max_num_seqs``: no forward runs more than that many rows; queued trajectories take the slots of
    trajectories waiting on a slow (200 ms) tool, so fresh ones start while calls are in flight; and each
    trajectory is the one the unbounded batch samples (its own sampling stream, whatever its neighbours)."""
    from verl.tools.calculator import SCHEMA

    (tmp_path / "slow.py").write_text(SLOW_CALCULATOR)
    (tmp_path / "tools.yaml").write_text(json.dumps({"tools": [{"function": f"{tmp_path}/slow.py:calculator",
                                                                "tool_schema": SCHEMA, "pure": True}]}))
    config = MultiTurnConfig(enable=True, tool_config_path=str(tmp_path / "tools.yaml"), max_assistant_turns=3)
    engine = AgentRollout(HFRollout(model, tokenizer, max_num_seqs=8), config, max_response_length=128)
    widths, prefills, calls = [], [], []
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[0]), with_kwargs=True)
    prefill, submit = engine.loop._prefill, engine.runner.submit

    def timed_prefill(rows, device):
        prefills.append(time.monotonic())
        return prefill(rows, device)

    def timed_submit(*args, **kwargs):
        start, future = time.monotonic(), submit(*args, **kwargs)
        future.add_done_callback(lambda _: calls.append((start, time.monotonic())))
        return future

    engine.loop._prefill, engine.runner.submit = timed_prefill, timed_submit
    try:
        bounded = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=128, seed=1,
                                                          logprobs=True))
    finally:
        hook.remove()
        engine.shutdown()
    assert max(widths) == 8 and len(prefills) >= 48 // 8  # 48 trajectories through 8 slots
    assert any(start < when < end for when in prefills for start, end in calls), "no trajectory started while " \
        "another waited for its tool"
    assert torch.equal(bounded.batch["responses"], batch.batch["responses"])
    assert list(bounded.non_tensor["num_tool_calls"]) == list(batch.non_tensor["num_tool_calls"])


def test_rows_back_from_their_tools_extend_in_groups_of_like_lengths(model, tokenizer):
    """A tool turn with a long result (an error message) must not pad every row extended beside it: the padding
    would stay inside those rows' caches for the rest of their trajectories. Rows back from their tools extend in
    groups whose new ids differ by at most ``EXTEND_SPREAD``; fresh rows prefill together, first."""
    import collections

    from verl.rollout.agent_loop import Trajectory

    engine = AgentRollout(HFRollout(model, tokenizer, max_num_seqs=16), TOOLS, max_response_length=128)
    loop = engine.loop
    try:
        def back(pending: int) -> Trajectory:
            row = Trajectory([1] * 20, ["calculator"], {}, None, ids=[5] * 30)
            row.cache_slot, row.cached = 0, 50 - pending  # waiting: its slot holds all but its last ``pending`` ids
            return row

        fresh = Trajectory([1] * 20, ["calculator"], {}, None)
        rows = [back(9), back(104), fresh, back(12), back(10), back(17), back(110)]
        groups = loop._admit(collections.deque(rows), decoding=0)
        lengths = [[loop._pending_length(row) for row in group] if group[0].cache_slot is not None else "fresh"
                   for group in groups]
        assert lengths == ["fresh", [9, 10, 12, 17], [104, 110]]
    finally:
        engine.shutdown()


def test_a_trajectory_keeps_its_slot_from_prefill_to_end(model, tokenizer, prompts, batch, monkeypatch):
    """The slot cache: each prompt is prefilled once, into the store (its samples copy that slot); rows back from
    their tools extend in the slot they left (no cache is copied out or back); every slot is free when the rollout
    ends, and the store serves the next rollout. The trajectories are the ones the fixture's rollout sampled."""
    from verl.models.slot_cache import SlotCache

    prefilled, extended = [], []
    step = SlotCache.step

    def counting_step(self, slots, new_mask=None):
        if new_mask is not None:  # a prefill (fresh slots) or an extend (slots holding a conversation)
            (extended if self.lengths[slots].min() > 0 else prefilled).extend(slots.tolist())
        return step(self, slots, new_mask)

    monkeypatch.setattr(SlotCache, "step", counting_step)
    engine = AgentRollout(HFRollout(model, tokenizer, max_num_seqs=16), TOOLS, max_response_length=128)
    try:
        params = SamplingParams(n=4, temperature=1.0, max_new_tokens=128, seed=1, logprobs=True)
        out = engine.generate(prompts, params)
        store = engine.loop._store
        # A prompt's samples admitted together share one prefill (copied into their slots); 16 at a time here.
        assert len(prompts) <= len(prefilled) < len(out) and len(store.free) == store.capacity[0]
        assert extended
        assert sum(out.non_tensor["num_turns"] - 1) <= len(extended)  # every later turn extended in its slot
        again = engine.generate(prompts, params)
        assert engine.loop._store is store and torch.equal(again.batch["responses"], out.batch["responses"])
    finally:
        engine.shutdown()
    assert torch.equal(out.batch["responses"], batch.batch["responses"])

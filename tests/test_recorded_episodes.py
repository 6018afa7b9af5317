"""Training samples from recorded gateway calls (verl/rollout/recorded_episodes.py), on hand-written records whose
answers are known: extension into one multi-turn sample, a rewritten history, a re-rendered answer, a failed call."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verl.batch import TrainBatch
from verl.rollout.recorded_episodes import episode_rows, episode_samples, samples_batch


def call(id_: str, prompt: list[int], ids: list[int], at: float, version: int = 0, **extra) -> dict:
    return {"kind": "request", "episode": extra.pop("episode", "e1"), "id": id_, "index": 0, "arrival": at,
            "time": at + 0.5, "prompt_ids": prompt, "token_ids": ids,
            "logprobs": [-0.1 * (k + 1) for k in range(len(ids))], "weight_version": version,
            "finish_reason": "stop", **extra}


def test_a_call_that_extends_the_last_continues_its_sample_with_the_added_ids_masked():
    first = call("c1", [1, 2, 3], [10, 11, 99], 0.0, tool_calls=[{"function": {"name": "calculator"}}])
    # The second prompt: the first's prompt + answer, then 3 ids of tool turn, then the answer's prompt.
    second = call("c2", [1, 2, 3, 10, 11, 99, 5, 6, 7], [20, 99], 1.0, version=1)
    [samples] = episode_rows([second, first]).values()  # out of order in the file: arrival orders them
    out = episode_samples("e1", samples)
    assert (out.calls, out.extended, out.rewritten, out.rerendered) == (2, 1, 0, 0)
    [t] = out.trajectories
    assert t.prompt_ids == [1, 2, 3]
    assert t.ids == [10, 11, 99, 5, 6, 7, 20, 99]
    assert t.mask == [1, 1, 1, 0, 0, 0, 1, 1]
    assert t.log_probs == pytest.approx([-0.1, -0.2, -0.3, 0, 0, 0, -0.1, -0.2])
    assert out.versions == [[0, 0, 0, 1, 1, 1, 1, 1]]
    assert (t.turns, t.calls) == (2, 1)


def test_a_rewritten_history_starts_a_sample_and_a_rerendered_answer_is_reported():
    first = call("c1", [1, 2, 3], [10, 11, 99], 0.0)
    # The agent summarised: a new system turn, nothing of the first prompt kept past id 1.
    summary = call("c2", [1, 7, 7, 8], [30, 99], 1.0)
    # Another call keeps c1's prompt but renders its answer as [10, 12, 99]: a re-rendering.
    rerender = call("c3", [1, 2, 3, 10, 12, 99, 5], [40, 99], 2.0)
    out = episode_samples("e1", [first, summary, rerender])
    assert (out.extended, out.rewritten, out.rerendered) == (0, 1, 1)
    assert out.first_difference == {"call": "c3", "answer_of": "c1", "position": 1, "sampled": 11, "rendered": 12}
    assert [t.prompt_ids for t in out.trajectories] == [[1, 2, 3], [1, 7, 7, 8], [1, 2, 3, 10, 12, 99, 5]]
    assert [t.ids for t in out.trajectories] == [[10, 11, 99], [30, 99], [40, 99]]  # never stitched together
    # A retry of the same prompt departs at the answer's start but renders nothing else: a restart, not a re-render.
    retry = episode_samples("e1", [first, call("c4", [1, 2, 3], [10, 13, 99], 3.0)])
    assert (retry.rewritten, retry.rerendered, len(retry.trajectories)) == (1, 0, 2)


def test_a_call_extends_the_longest_sample_it_continues():
    a = call("a", [1, 2], [3, 99], 0.0)
    b = call("b", [1, 2, 3, 99, 4], [5, 99], 1.0)
    branch = call("c", [1, 2, 3, 99, 6], [7, 99], 2.0)  # continues a's sample before b, not b's: a new sample
    d = call("d", [1, 2, 3, 99, 4, 5, 99, 8], [9, 99], 3.0)  # continues b's
    out = episode_samples("e1", [a, b, branch, d])
    assert out.extended == 2 and len(out.trajectories) == 2
    assert out.trajectories[0].ids == [3, 99, 4, 5, 99, 8, 9, 99]


def test_a_failed_call_masks_its_episode_and_a_batch_maps_rows_back_to_episodes():
    ok = [call("c1", [1, 2, 3], [10, 99], 0.0, episode="good"), call("c2", [1, 2, 3, 10, 99, 4], [11, 99], 1.0,
                                                                          episode="good", version=2)]
    bad = [call("c3", [5, 6], [12], 0.0, episode="bad", error="aborted")]
    episodes = [episode_samples(name, rows) for name, rows in episode_rows(ok + bad).items()]
    assert episodes[1].error == "call c3: aborted"
    batch = samples_batch(episodes, pad_id=0)
    assert list(batch.non_tensor["episode"]) == ["good", "bad"] and list(batch.non_tensor["sample"]) == [0, 0]
    assert batch.batch["prompts"].tolist() == [[1, 2, 3], [0, 5, 6]]  # left-padded
    assert batch.batch["responses"].tolist() == [[10, 99, 4, 11, 99], [12, 0, 0, 0, 0]]
    assert batch.batch["response_mask"].tolist() == [[1, 1, 0, 1, 1], [0, 0, 0, 0, 0]]  # the failed one masked
    assert batch.batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0, 0, 0]]
    assert torch.allclose(batch.batch["rollout_log_probs"][0], torch.tensor([-0.1, -0.2, 0, -0.1, -0.2]))
    assert batch.batch["weight_version"].tolist()[0] == [0, 0, 2, 2, 2]
    typed = TrainBatch.from_proto(batch)  # the trainer's batch keeps the recorded versions
    assert typed.weight_version.tolist()[0] == [0, 0, 2, 2, 2]


def test_rows_without_training_ids_are_not_episodes_and_bad_rows_are_named():
    rows = [{"kind": "request", "episode": None, "time": 0.0}, {"kind": "reward", "episode": "e", "time": 0.0},
            {"kind": "request", "episode": "e", "prompt_ids": None, "time": 0.0}]
    assert episode_rows(rows) == {}
    with pytest.raises(ValueError, match="record c1: 2 token_ids but 1 logprobs"):
        episode_samples("e", [{**call("c1", [1], [2, 3], 0.0), "logprobs": [-0.5]}])
    with pytest.raises(ValueError, match="no samples"):
        samples_batch([], pad_id=0)


def test_samples_of_one_episode_share_its_final_samples_outcome_and_validation_scores_episodes_once():
    """Episode a gave two samples (a rewritten history), b one: a's first sample takes its last one's score and
    extras; validation keeps each episode's last sample."""
    from verl.protocol import DataProto
    from verl.trainer.validation import final_samples
    from verl.workers.reward import episode_outcomes

    episodes = np.array(["a", "a", "b"], dtype=object)
    extras = {"acc": np.array([0.0, 1.0, 0.0]), "pred": np.array(["", "42", "7"], dtype=object)}
    scores = episode_outcomes(torch.tensor([0.0, 1.0, 0.5]), extras, episodes)
    assert scores.tolist() == [1.0, 1.0, 0.5] and extras["acc"].tolist() == [1.0, 1.0, 0.0]
    assert extras["pred"].tolist() == ["42", "42", "7"]
    batch = DataProto.from_dict(tensors={"responses": torch.tensor([[1], [2], [3]])},
                                non_tensors={"episode": episodes})
    assert final_samples(batch).batch["responses"].tolist() == [[2], [3]]
    single = DataProto.from_dict(tensors={"responses": torch.tensor([[1]])}, non_tensors={})
    assert final_samples(single) is single

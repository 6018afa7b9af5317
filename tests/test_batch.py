"""The typed batch (verl/batch.py): a real rollout's identity and versions, the wire format both ways, rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.test_trainer import tiny_config
from verl.batch import Anchor, TrainBatch, concat, content_ids
from verl.protocol import DataProto
from verl.trainer.local import LocalPPOTrainer


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    """A real rollout of the tiny default: prompts 0, 1, 2 of builtin:arithmetic/train, n = 2."""
    trainer = LocalPPOTrainer(tiny_config(tmp_path_factory.mktemp("batch"), rollout={"n": 2}), quiet=True)
    prompts = trainer.train_dataset.collate([2, 0, 1])
    generated = trainer.roles.generate(prompts, trainer.rollout_stage.train_sampling(1))
    yield trainer, generated
    trainer.shutdown()


def test_a_rollout_knows_each_sample_by_source_content_row_and_number(rollout):
    trainer, generated = rollout
    batch = TrainBatch.from_proto(generated, version=3)
    dataset = trainer.train_dataset
    keys = content_ids([row[dataset.config.prompt_key] for row in dataset.rows])  # the raw prompts, untemplated
    assert batch.ids.tuples() == [("builtin:arithmetic/train", keys[i], i, k) for i in (2, 0, 1) for k in (0, 1)]
    assert batch.group.tolist() == [2, 2, 0, 0, 1, 1]
    assert batch.weight_version.shape == batch.responses.shape and bool((batch.weight_version == 3).all())
    assert batch.anchor is Anchor.CURRENT and batch.old_log_probs is None and batch.advantages is None


def test_the_wire_format_keeps_verl_names_and_comes_back_equal(rollout):
    _, generated = rollout
    batch = TrainBatch.from_proto(generated, version=1)
    batch.anchor, batch.old_log_probs = Anchor.ROLLOUT, torch.zeros(batch.responses.shape)
    batch.update_mask = batch.response_mask.clone()
    wire = batch.to_proto()
    assert {"responses", "old_log_probs", "rollout_rs_mask", "weight_version"} <= set(wire.batch)
    assert {"uid", "sample_source", "sample_key", "sample_index", "sample", "ground_truth"} <= set(wire.non_tensor)
    back = TrainBatch.from_proto(wire)
    assert back.anchor is Anchor.ROLLOUT and back.ids.tuples() == batch.ids.tuples()
    assert torch.equal(back.update_mask, batch.update_mask) and torch.equal(back.weight_version, batch.weight_version)
    # A verl DataProto without our fields: old_log_probs present means the trainer's, samples numbered by group.
    plain = DataProto(dict(generated.batch) | {"old_log_probs": torch.zeros(batch.responses.shape)},
                      {"uid": np.array([7, 7, 8, 8, 9, 9])})
    typed = TrainBatch.from_proto(plain)
    assert typed.anchor is Anchor.TRAINER and typed.ids.sample.tolist() == [0, 1, 0, 1, 0, 1]


def test_a_batch_refuses_what_its_fields_cannot_say(rollout):
    _, generated = rollout
    batch = TrainBatch.from_proto(generated)
    with pytest.raises(ValueError, match="tensors no stage reads: \\['mystery'\\]"):
        TrainBatch.from_proto(DataProto(dict(generated.batch) | {"mystery": batch.responses}))
    with pytest.raises(ValueError, match="must carry old_log_probs exactly when it is not on-policy"):
        TrainBatch.from_proto(DataProto(dict(generated.batch), meta={"anchor": "trainer"}))


def test_rows_index_split_and_concat_keep_every_field_together(rollout):
    _, generated = rollout
    batch = TrainBatch.from_proto(generated)
    batch.texts = [f"t{i}" for i in range(len(batch))]
    batch.reward_extras = {"acc": np.arange(len(batch), dtype=float)}
    picked = batch.index(np.array([4, 5, 0]))
    assert picked.ids.index.tolist() == [1, 1, 2] and picked.texts == ["t4", "t5", "t0"]
    assert picked.reward_extras["acc"].tolist() == [4.0, 5.0, 0.0]
    assert torch.equal(picked.responses, batch.responses[[4, 5, 0]])
    assert [len(p) for p in batch.split(4)] == [4, 2] and [len(p) for p in batch.chunk(3)] == [2, 2, 2]
    # Parts of different widths are padded to the widest, the padding masked.
    narrow = batch.index(np.array([0, 1]))
    narrow.responses, narrow.response_mask = narrow.responses[:, :1], narrow.response_mask[:, :1]
    width = narrow.prompts.shape[1] + 1
    narrow.input_ids, narrow.attention_mask = narrow.input_ids[:, :width], narrow.attention_mask[:, :width]
    narrow.position_ids, narrow.weight_version = narrow.position_ids[:, :width], narrow.weight_version[:, :1]
    joined = concat([narrow, batch.index(np.array([2, 3]))], pad_id=0)
    assert joined.responses.shape == (4, batch.responses.shape[1]) and joined.texts == ["t0", "t1", "t2", "t3"]
    assert int(joined.response_mask[:2, 1:].sum()) == 0 and joined.ids.index.tolist() == [2, 2, 0, 0]

"""DataProto: combination operations and the strict shape/dtype checks (VERL_STRICT_DATA_CHECK=1)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verl.errors import DataProtoValidationError
from verl.protocol import DataProto


@pytest.fixture(autouse=True)
def _lenient_by_default(monkeypatch):
    monkeypatch.delenv("VERL_STRICT_DATA_CHECK", raising=False)


def make(n: int = 4, offset: int = 0) -> DataProto:
    rows = torch.arange(offset, offset + n)
    return DataProto.from_dict(
        tensors={"ids": rows.unsqueeze(-1) * 10 + torch.arange(3), "score": rows.float()},
        non_tensors={"uid": [f"u{i}" for i in rows.tolist()]},
        meta={"temperature": 1.0},
    )


def col(data: DataProto) -> list[int]:
    return data.batch["score"].long().tolist()


# ----------------------------------------------------------------------------------------------- basics


def test_len_contains_getitem_keys():
    data = make()
    assert len(data) == 4
    assert "ids" in data and "uid" in data and "nope" not in data
    assert data["uid"].tolist() == ["u0", "u1", "u2", "u3"]
    assert data["uid"].dtype == object
    assert data.keys() == ["ids", "score", "uid"]
    with pytest.raises(KeyError, match="nope.*ids"):
        data["nope"]


def test_union_adds_fields_and_meta_in_place():
    data = make()
    extra = DataProto.from_dict({"values": torch.ones(4, 2)}, {"gt": ["1", "2", "3", "4"]}, {"step": 7})
    out = data.union(extra)
    assert out is data
    assert set(data.keys()) == {"ids", "score", "uid", "values", "gt"}
    assert data.meta == {"temperature": 1.0, "step": 7}


def test_union_accepts_equal_shared_fields_and_rejects_conflicts():
    data = make()
    data.union(DataProto.from_dict({"score": torch.arange(4).float()}, {"uid": ["u0", "u1", "u2", "u3"]}))
    with pytest.raises(DataProtoValidationError, match="union conflict on 'score'.*source: critic"):
        data.union(DataProto.from_dict({"score": torch.zeros(4)}, stage="critic"))
    with pytest.raises(DataProtoValidationError, match="union conflict on 'uid'"):
        data.union(DataProto.from_dict(non_tensors={"uid": ["x", "u1", "u2", "u3"]}))


def test_union_rejects_a_different_batch_size():
    with pytest.raises(DataProtoValidationError, match="size 4 and 3"):
        make(4).union(make(3))


def test_select_keeps_named_fields_and_shares_tensors():
    data = make()
    sub = data.select(["ids"], ["uid"])
    assert sub.keys() == ["ids", "uid"]
    assert sub.batch["ids"] is data.batch["ids"]
    assert sub.meta == data.meta and sub.meta is not data.meta
    # None keeps every field of that kind (as in verl).
    assert data.select(["score"]).keys() == ["score", "uid"]
    assert data.select(non_tensor_keys=[]).keys() == ["ids", "score"]


def test_index_by_list_tensor_slice_and_boolean_mask():
    data = make(5)
    assert col(data.index([4, 0, 0])) == [4, 0, 0]
    assert data.index([4, 0, 0])["uid"].tolist() == ["u4", "u0", "u0"]
    assert col(data.index(torch.tensor([1, 3]))) == [1, 3]
    assert col(data.index(np.array([2]))) == [2]
    assert col(data.index(slice(1, 4))) == [1, 2, 3]
    picked = data.index(torch.tensor([True, False, True, False, True]))
    assert col(picked) == [0, 2, 4] and picked["uid"].tolist() == ["u0", "u2", "u4"]
    assert col(data.index(np.array([False, True, False, False, False]))) == [1]
    torch.testing.assert_close(data.index([3]).batch["ids"], torch.tensor([[30, 31, 32]]))


def test_chunk_and_split():
    data = make(6)
    chunks = data.chunk(3)
    assert [col(c) for c in chunks] == [[0, 1], [2, 3], [4, 5]]
    assert [c["uid"].tolist() for c in chunks][2] == ["u4", "u5"]
    with pytest.raises(DataProtoValidationError, match="6 into 4"):
        data.chunk(4)
    assert [col(p) for p in make(5).split(2)] == [[0, 1], [2, 3], [4]]


def test_concat_restores_the_batch_and_checks_fields():
    data = make(5)
    again = DataProto.concat(data.split(2))
    assert torch.equal(again.batch["ids"], data.batch["ids"])
    assert again["uid"].tolist() == data["uid"].tolist()
    assert len(DataProto.concat([])) == 0
    other = make(2)
    other.batch.pop("score")
    with pytest.raises(DataProtoValidationError, match="different fields"):
        DataProto.concat([make(2), other])


def test_repeat_interleaved_and_tiled():
    data = make(2)
    data.non_tensor["pair"] = np.array([[1, 2], [3, 4]])  # a 2-D non-tensor field repeats along rows only
    inter = data.repeat(3, interleave=True)
    assert col(inter) == [0, 0, 0, 1, 1, 1]
    assert inter["uid"].tolist() == ["u0", "u0", "u0", "u1", "u1", "u1"]
    assert inter.batch["ids"].shape == (6, 3)
    assert inter["pair"].tolist() == [[1, 2]] * 3 + [[3, 4]] * 3
    tiled = data.repeat(2, interleave=False)
    assert col(tiled) == [0, 1, 0, 1]
    assert tiled["uid"].tolist() == ["u0", "u1", "u0", "u1"]
    assert tiled.batch["ids"][2].tolist() == [0, 1, 2]
    assert tiled["pair"].tolist() == [[1, 2], [3, 4], [1, 2], [3, 4]]


def test_pop_removes_from_the_source():
    data = make()
    popped = data.pop(["score"])
    assert popped.keys() == ["score"] and col(popped) == [0, 1, 2, 3]
    assert data.keys() == ["ids", "uid"]


# ----------------------------------------------------------------------------------------------- strict checks


def rollout_like(n: int = 2, resp: int = 5, prompt: int = 3) -> dict[str, torch.Tensor]:
    return {
        "responses": torch.zeros(n, resp, dtype=torch.long),
        "response_mask": torch.ones(n, resp, dtype=torch.long),
        "input_ids": torch.zeros(n, prompt + resp, dtype=torch.long),
        "attention_mask": torch.ones(n, prompt + resp, dtype=torch.long),
    }


def test_strict_mode_off_by_default_lets_bad_shapes_through():
    bad = DataProto.from_dict({**rollout_like(), "old_log_probs": torch.zeros(2, 4)}, stage="actor")
    assert bad.batch["old_log_probs"].shape == (2, 4)


def test_strict_mode_names_field_expected_actual_and_stage(monkeypatch):
    monkeypatch.setenv("VERL_STRICT_DATA_CHECK", "1")
    DataProto.from_dict({**rollout_like(), "old_log_probs": torch.zeros(2, 5)}, stage="actor")  # fine
    with pytest.raises(DataProtoValidationError) as err:
        DataProto.from_dict({**rollout_like(), "old_log_probs": torch.zeros(2, 4)}, stage="actor")
    message = str(err.value)
    assert "'old_log_probs'" in message and "(2, 5)" in message and "(2, 4)" in message and "actor" in message


def test_strict_union_reports_the_producing_stage(monkeypatch):
    monkeypatch.setenv("VERL_STRICT_DATA_CHECK", "1")
    batch = DataProto.from_dict(rollout_like(), stage="rollout")
    with pytest.raises(DataProtoValidationError, match=r"'values'.*\(2, 5\).*\(2, 6\).*source: critic"):
        batch.union(DataProto.from_dict({"values": torch.zeros(2, 6)}, stage="critic"))


def test_strict_checks_batch_dim_sequence_fields_and_dtypes(monkeypatch):
    monkeypatch.setenv("VERL_STRICT_DATA_CHECK", "1")
    with pytest.raises(DataProtoValidationError, match=r"'uid'.*batch size 2.*\(3,\).*source: rollout"):
        DataProto.from_dict(rollout_like(), {"uid": ["a", "b", "c"]}, stage="rollout")
    with pytest.raises(DataProtoValidationError, match=r"'position_ids'.*\(2, 8\).*\(2, 7\)"):
        DataProto.from_dict({**rollout_like(), "position_ids": torch.zeros(2, 7, dtype=torch.long)}, stage="rollout")
    with pytest.raises(DataProtoValidationError, match=r"'advantages'.*floating.*int64.*source: adv"):
        DataProto.from_dict({**rollout_like(), "advantages": torch.zeros(2, 5, dtype=torch.long)}, stage="adv")


def test_strict_flag_values(monkeypatch):
    bad = {**rollout_like(), "returns": torch.zeros(2, 1)}
    for off in ("0", "", "false"):
        monkeypatch.setenv("VERL_STRICT_DATA_CHECK", off)
        DataProto.from_dict(bad)
    monkeypatch.setenv("VERL_STRICT_DATA_CHECK", "true")
    with pytest.raises(DataProtoValidationError, match="'returns'"):
        DataProto.from_dict(bad)

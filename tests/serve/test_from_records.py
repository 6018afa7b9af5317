"""`verl data from-records` (serve/from_records.py): a service's records into training files — what is never
exported, late rewards joined by completion id with one source, duplicates and near duplicates, the split by user,
preference pairs — on records written by hand (every count known) and on a real service's records."""

from __future__ import annotations

import json

import httpx
import pyarrow.parquet as pq
import pytest

from serve.from_records import RecordFilters, export_records
from tests.serve.helpers import run_server
from tests.trainer_utils import run_cli
from verl.data.dataset import RLHFDataset
from verl.errors import ConfigError
from verl.models.loader import load_tokenizer

LONG = "Please add thirty and twelve, then write the result after >> as the answer, thanks."


def request(i: int, question: str, answer: str, user: str, **fields) -> dict:
    return {"kind": "request", "id": f"cmpl-{i}", "index": 0, "time": 1000.0 + i, "model": fields.pop("model", "a"),
            "route": fields.pop("route", "default"), "e2e_s": 0.1, "error": None, "finish_reason": "stop",
            "user": user, "prompt": [{"role": "user", "content": question}], "answer": answer, "run": "grpo-a",
            "step": 5, "weights": "abc", "reward": None, **fields}


def feedback(i: int, score: float, source: str = "feedback") -> dict:
    return {"kind": "reward", "id": f"cmpl-{i}", "index": 0, "time": 2000.0 + i, "reward": score,
            "reward_source": source, "model": "a"}


def records_file(tmp_path, rows: list[dict]):
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read(path) -> list[dict]:
    return pq.read_table(path).to_pylist() if path.is_file() else []


def test_what_is_never_exported_and_how_answers_pool_into_prompts_and_pairs(tmp_path):
    rows = [
        request(0, "What is 12+7?", ">> 19", "u1"), feedback(0, 1.0),
        request(1, "what is  12+7?", ">> 18", "u1"), feedback(1, 0.0),  # the same prompt (case, spaces): pooled
        request(2, "What is 3*4?", ">> 12", "u2", not_for_training=True), feedback(2, 1.0),  # never exported
        request(3, "What is 5-2?", ">> 3", "u3", error="engine died"),
        request(4, "What is 6+6?", ">> 12", "u4", finish_reason="abort"),
        {**request(5, "What is 9+1?", ">> 10", "u5"), "prompt": None, "answer": None}, feedback(5, 1.0),  # no texts
        request(6, "What is 8+8?", ">> 16", "u6", route="other"), feedback(6, 1.0),
        request(7, "What is 21+21?", ">> 42", "u7"),  # no reward: dropped with --min-rewards 1
        request(8, LONG, ">> 42", "u8"), feedback(8, 0.5),
        request(9, LONG.replace("thanks", "thank you"), ">> 41", "u9"), feedback(9, 0.0),  # a near duplicate of 8
    ]
    summary = export_records([str(records_file(tmp_path, rows))], tmp_path / "out",
                             RecordFilters(routes=["default"]), val_fraction=0.0)
    c = summary["counts"]
    assert (c["requests"], c["not_for_training"], c["failed"], c["no_text"], c["filtered_route"]) == (10, 1, 2, 1, 1)
    assert (c["prompts"], c["exact_duplicates"], c["too_few_rewards"], c["near_duplicates"]) == (4, 1, 1, 1)
    train = read(tmp_path / "out" / "train.parquet")
    assert [r["prompt"][0]["content"] for r in train] == ["What is 12+7?", LONG]
    pooled = train[0]["extra_info"]
    assert sorted(pooled["rewards"]) == [0.0, 1.0] and pooled["completion_ids"] == ["cmpl-0", "cmpl-1"]
    assert pooled["reward_source"] == "feedback" and pooled["models"] == ["a"]
    assert json.loads(pooled["lineage"]) == {"run": "grpo-a", "step": 5, "weights": "abc"}
    exported = json.dumps(train) + json.dumps(read(tmp_path / "out" / "pairs" / "train.parquet"))
    assert "cmpl-2" not in exported and "3*4" not in exported  # not for training: nowhere
    (pair,) = read(tmp_path / "out" / "pairs" / "train.parquet")
    assert (pair["chosen"], pair["rejected"]) == (">> 19", ">> 18")
    assert (pair["extra_info"]["chosen_score"], pair["extra_info"]["rejected_score"]) == (1.0, 0.0)
    # The trainer reads the file as it is (no ground truth: for a reward model or a judge, not a rule).
    dataset = RLHFDataset(str(tmp_path / "out" / "train.parquet"), load_tokenizer("builtin:tiny-arith"),
                          {"max_prompt_length": 256}, require_ground_truth=False)
    assert len(dataset) == 2 and "What is 12+7?" in dataset.rows[0]["__prompt_text__"]
    saved = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert saved["counts"] == summary["counts"] and saved["time_window"] == [1000.0, 1009.0]


def test_the_split_keeps_every_user_and_every_prompt_on_one_side(tmp_path):
    # 60 prompts; users ask 3 prompts each and some prompts are asked by two users: those users go together.
    rows, i = [], 0
    for p in range(60):
        askers = [f"u{p // 3}"] + ([f"u{(p // 3 + 7) % 20}"] if p % 5 == 0 else [])
        for user in askers:
            rows += [request(i, f"Question number {p} about {p * 7919 % 1000}?", f">> {p}", user),
                     feedback(i, float(p % 2))]
            i += 1
    summary = export_records([str(records_file(tmp_path, rows))], tmp_path / "out", val_fraction=0.3, seed=3,
                             near_dup_threshold=1.0)
    train, val = read(tmp_path / "out" / "train.parquet"), read(tmp_path / "out" / "val.parquet")
    assert len(train) + len(val) == 60 and train and val
    users = {r["id"]: r["user"] for r in rows if r["kind"] == "request"}

    def people(part):
        return {users[c] for r in part for c in r["extra_info"]["completion_ids"]}

    assert not people(train) & people(val)
    assert not {r["prompt"][0]["content"] for r in train} & {r["prompt"][0]["content"] for r in val}
    assert summary["written"]["val.parquet"] == len(val)
    kept = sum(len(r["extra_info"]["completion_ids"]) for r in train + val)
    moved = summary["counts"]["answers_of_the_other_split"]
    assert kept + moved == i and moved > 0  # shared prompts: the later asker on the other side is left out


def test_sources_are_never_mixed_and_bad_input_is_one_line(tmp_path):
    rows = [request(0, "What is 1+1?", ">> 2", "u1"), feedback(0, 1.0),
            request(1, "What is 2+2?", ">> 4", "u2"), feedback(1, 0.9, "rm:judge")]
    path = records_file(tmp_path, rows)
    with pytest.raises(ConfigError, match=r"rewards from 2 sources \(feedback, rm:judge\).*--reward-source"):
        export_records([str(path)], tmp_path / "out")
    summary = export_records([str(path)], tmp_path / "out", RecordFilters(reward_source="rm:judge"))
    assert summary["counts"]["too_few_rewards"] == 1 and summary["written"]["train.parquet"] + \
        summary["written"]["val.parquet"] == 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"kind": "request"}\n')
    done = run_cli(["data", "from-records", str(bad), "--out", str(tmp_path / "o2")])
    assert done.returncode == 1 and "line 1: not a service record" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.e2e
def test_a_real_services_records_and_the_clients_not_for_training_flag(tmp_path):
    records = tmp_path / "records.jsonl"
    with run_server(record_texts=True, records_path=str(records), admin_api_key="k") as srv:
        ids = {}
        for k, question in enumerate(["What is 12+7?", "What is 3*4?", "What is 20-6?", "What is 9+9?"]):
            body = {"messages": [{"role": "user", "content": question}], "max_tokens": 6, "temperature": 0,
                    "user": f"user-{k}"}
            if k == 1:
                body["verl"] = {"not_for_training": True}
            reply = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60).json()
            ids[question] = reply["id"]
            httpx.post(srv.url + "/v1/feedback", json={"id": reply["id"], "thumbs": "up" if k % 2 else "down"},
                       timeout=30)
        # The service itself as the source (docs/flywheel.md), filtered: its /admin/records (one model, no route).
        live = run_cli(["data", "from-records", srv.url, "--admin-key", "k", "--out", str(tmp_path / "live"),
                        "--model", "tiny-arith", "--since", "1790000000", "--val-fraction", "0"])
        assert live.returncode == 0, live.stderr
        unauthorised = run_cli(["data", "from-records", srv.url, "--out", str(tmp_path / "no-key")])
        assert unauthorised.returncode == 1 and "needs the admin key: --admin-key" in unauthorised.stderr
    done = run_cli(["data", "from-records", str(records), "--out", str(tmp_path / "out"), "--val-fraction", "0"])
    assert done.returncode == 0, done.stderr
    said = " ".join(done.stderr.split())
    assert "4 requests -> 3 prompts" in said and "1 not for training" in said and "rewards: feedback" in said
    train = read(tmp_path / "out" / "train.parquet")
    exported = {c for r in train for c in r["extra_info"]["completion_ids"]}
    assert exported == {ids[q] for q in ids if q != "What is 3*4?"}
    live_train = read(tmp_path / "live" / "train.parquet")
    assert {c for r in live_train for c in r["extra_info"]["completion_ids"]} == exported

    # A fleet: each replica ships its new rows to the control plane (serve.fleet), which merges them into the one
    # records file. The flag travels with the row: the merged log exports the same three prompts.
    import asyncio

    from serve.fleet import ControlPlane

    rows = [json.loads(line) for line in records.read_text().splitlines()]
    plane = ControlPlane({"models": [], "routes": {}}, records_path=str(tmp_path / "fleet.jsonl"))

    async def ship() -> None:
        for replica, part in (("r1", rows[::2]), ("r2", rows[1::2])):
            await plane.report(replica, active=1, prepared=1, error=None, records=part)

    asyncio.run(ship())
    merged = export_records([str(tmp_path / "fleet.jsonl")], tmp_path / "fleet", val_fraction=0.0)
    assert merged["counts"]["not_for_training"] == 1 and merged["written"]["train.parquet"] == 3
    fleet_train = read(tmp_path / "fleet" / "train.parquet")
    assert {c for r in fleet_train for c in r["extra_info"]["completion_ids"]} == exported


def test_one_file_holds_one_kind_of_prompt(tmp_path):
    rows = [request(0, "What is 1+1?", ">> 2", "u1"), feedback(0, 1.0),
            {**request(1, "", ">> 4", "u2"), "prompt": "2+2="}, feedback(1, 0.0)]
    path = records_file(tmp_path, rows)
    chat = export_records([str(path)], tmp_path / "chat", val_fraction=0.0)
    completion = export_records([str(path)], tmp_path / "completion", RecordFilters(prompts="completion"),
                                val_fraction=0.0)
    assert chat["counts"]["other_prompt_kind"] == completion["counts"]["other_prompt_kind"] == 1
    assert read(tmp_path / "completion" / "train.parquet")[0]["prompt"] == "2+2="
    assert read(tmp_path / "chat" / "train.parquet")[0]["prompt"] == [{"role": "user", "content": "What is 1+1?"}]


def test_verl_train_and_verl_rm_read_an_export_and_the_run_keeps_its_traffic(tmp_path):
    """The export directory is the trainer's data as it is: prompts for `verl train` (scored at train time, here by a
    custom reward function: the rows carry no answer), pairs for `verl rm`; the run and its export keep which
    records it learned from."""
    from serve.export import run_export
    from tests.test_trainer import tiny_config
    from verl.config import RMConfig
    from verl.trainer.local import LocalPPOTrainer
    from verl.trainer.rm import PairData

    rows = []
    for i in range(12):
        rows += [request(2 * i, f"What is {i}+{i}?", f">> {2 * i}", f"u{i}"), feedback(2 * i, 1.0),
                 request(2 * i + 1, f"What is {i}+{i}?", f">> {2 * i + 1}", f"u{i}"), feedback(2 * i + 1, 0.0)]
    summary = export_records([str(records_file(tmp_path, rows))], tmp_path / "traffic", val_fraction=0.25, seed=1)
    written = summary["written"]
    assert written["train.parquet"] and written["val.parquet"] and written["pairs/train.parquet"]
    reward = tmp_path / "reward.py"
    reward.write_text("def fmt(data_source, solution_str, ground_truth, extra_info=None, **kw):\n"
                      "    return float('>>' in solution_str)\n")
    traffic = str(tmp_path / "traffic")
    trainer = LocalPPOTrainer(tiny_config(tmp_path, data={"train_files": [traffic], "val_files": [traffic],
                                                           "train_batch_size": 4},
                                          reward={"custom_reward": {"path": str(reward), "name": "fmt"}},
                                          trainer={"save_freq": 1}), quiet=True)
    assert (len(trainer.train_dataset), len(trainer.val_dataset)) == (written["train.parquet"],
                                                                      written["val.parquet"])
    trainer.fit()
    kept = json.loads((trainer.run_dir / "data_lineage.json").read_text())["records"]
    assert len(kept) == 1  # train_files and val_files name the same export: one entry
    assert kept[0]["time_window"] == summary["time_window"] and kept[0]["requests"] == 24
    assert kept[0]["written"] == written and kept[0]["sources"] == summary["sources"]
    exported, _ = run_export(tmp_path / "export", run=trainer.run_dir, select="latest", verify=False)
    assert json.loads((exported / "export.json").read_text())["data"]["records"] == kept
    tokenizer = load_tokenizer("builtin:tiny-arith")
    pairs = PairData([traffic], "data.train_files", tokenizer, RMConfig())
    assert len(pairs.pairs) == written["pairs/train.parquet"]


def test_an_export_without_the_split_a_key_reads_is_one_clear_line(tmp_path):
    summary = export_records([str(records_file(tmp_path, [request(0, "What is 1+1?", ">> 2", "u0"),
                                                          feedback(0, 1.0)]))], tmp_path / "traffic",
                             val_fraction=0.0)
    assert summary["written"]["val.parquet"] == 0
    tokenizer = load_tokenizer("builtin:tiny-arith")
    with pytest.raises(Exception, match=r"data.val_files: the export .*traffic' wrote no val.parquet \(0 rows"):
        RLHFDataset([str(tmp_path / "traffic")], tokenizer, {}, "data.val_files", require_ground_truth=False)
    (tmp_path / "plain").mkdir()
    with pytest.raises(Exception, match=r"data.train_files: '.*plain' is a directory without train.parquet"):
        RLHFDataset([str(tmp_path / "plain")], tokenizer, {}, "data.train_files", require_ground_truth=False)

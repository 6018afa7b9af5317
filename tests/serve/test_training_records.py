"""Training traffic through the OpenAI API (issue 64, item 1): a call with the training key and an episode id is
recorded token-exact — the prompt's ids as rendered, the sampled ids, their log-probs, the weight version and the
tool calls parsed — streamed or not; user traffic beside it is recorded as before, and holds its share of slots."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.serve.helpers import run_server
from tests.serve.test_tool_calling import CALCULATOR, QUESTION, sse_chunks

KEY = "train-key"
TRAINING = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    records = tmp_path_factory.mktemp("records") / "records.jsonl"
    # 4 slots (2 batch + 2 queue); training traffic holds at most half of them.
    with run_server(model="builtin:tiny-agent", max_output_tokens=128, max_n=8, max_batch_size=2, max_queue_size=2,
                    training_api_key=KEY, records_path=str(records)) as srv:
        yield srv, records


def rows(records: Path, episode: str | None = None, wait: float = 10.0) -> list[dict]:
    """The records file's request rows (of ``episode``), waiting for at least one to be written."""
    deadline = time.monotonic() + wait
    while True:
        found = [json.loads(line) for line in records.read_text().splitlines()] if records.exists() else []
        found = [r for r in found if r.get("kind") == "request" and (episode is None or r.get("episode") == episode)]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def test_a_training_call_is_recorded_token_exact(gateway):
    srv, records = gateway
    body = {"model": "tiny-agent", "messages": QUESTION, "tools": [CALCULATOR], "tool_choice": "required",
            "temperature": 1.0, "seed": 7, "max_tokens": 96, "return_token_ids": True, "logprobs": True}
    answer = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60,
                        headers={**TRAINING, "X-Session-ID": "episode-1"}).json()
    [row] = rows(records, "episode-1")
    choice = answer["choices"][0]
    assert row["prompt_ids"] == answer["prompt_token_ids"] and row["token_ids"] == choice["token_ids"]
    assert row["logprobs"] == [c["logprob"] for c in choice["logprobs"]["content"]]
    assert len(row["token_ids"]) == row["completion_tokens"] and row["weight_version"] == 0
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in row["tool_calls"]] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]]


def test_streamed_training_calls_are_recorded_and_keep_the_response_as_asked(gateway):
    srv, records = gateway
    body = {"model": "tiny-agent", "messages": QUESTION, "temperature": 1.0, "seed": 9, "max_tokens": 32,
            "stream": True, "return_token_ids": True, "verl": {"episode_id": "episode-2"}}
    with httpx.Client(base_url=srv.url, timeout=60, headers=TRAINING) as http:
        chunks = sse_chunks(http, "/v1/chat/completions", body)
    [row] = rows(records, "episode-2")
    assert row["token_ids"] == [t for c in chunks if c["choices"] for t in c["choices"][0].get("token_ids", [])]
    assert len(row["logprobs"]) == len(row["token_ids"]) and all(lp <= 0 for lp in row["logprobs"])
    assert row["prompt_ids"] == chunks[0]["prompt_token_ids"] and row["tool_calls"] is None  # no tools: no parse
    assert all(c["choices"][0]["logprobs"] is None for c in chunks if c["choices"])  # recorded, not shown


def test_user_traffic_and_wrong_training_inputs(gateway):
    srv, records = gateway
    body = {"model": "tiny-agent", "messages": QUESTION, "max_tokens": 8, "temperature": 0}
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        user = http.post("/v1/chat/completions", json={**body, "user": "u-1"}, headers={"X-Session-ID": "s-1"})
        unkeyed = http.post("/v1/chat/completions", json={**body, "verl": {"episode_id": "e"}})
        no_episode = http.post("/v1/chat/completions", json=body, headers=TRAINING)
        wide = http.post("/v1/chat/completions", json={**body, "n": 3}, headers={**TRAINING, "X-Session-ID": "e3"})
        wide_user = http.post("/v1/chat/completions", json={**body, "n": 3})
    assert user.status_code == 200 and wide_user.status_code == 200
    user_rows = [r for r in rows(records) if r["episode"] is None]
    assert user_rows and all(r["token_ids"] is None and r["prompt_ids"] is None for r in user_rows)
    assert (unkeyed.status_code, unkeyed.json()["error"]["code"]) == (403, "training_key_required")
    assert (no_episode.status_code, no_episode.json()["error"]["code"]) == (400, "episode_id_required")
    # 3 training sequences exceed training's 2 of the 4 slots; the same 3 as user traffic are served.
    assert (wide.status_code, wide.json()["error"]["code"]) == (429, "training_share_full")


def test_user_requests_never_wait_for_a_row_behind_training_traffic(gateway):
    """Both at once: two long training episodes' calls (120 tokens each, streamed) and a user's short requests one
    after another. Training holds at most its share (here 1 of the 2 decode rows, training_max_slots_share 0.5): the
    second training call waits for the first, and every user request is admitted into the other row at once — all
    of them are answered while the first training call is still decoding. Without the row share both training calls
    take both rows and the first user request waits until one of them ends."""
    srv, _ = gateway
    engine = srv.service.lifecycle.engine
    body = {"model": "tiny-agent", "messages": QUESTION, "max_tokens": 120, "temperature": 1.0, "ignore_eos": True,
            "stream": True}
    finished: list[tuple[str, float]] = []
    training_rows: list[int] = []

    def train(episode: str) -> None:
        with httpx.Client(base_url=srv.url, timeout=120, headers={**TRAINING, "X-Session-ID": episode}) as http:
            chunks = sse_chunks(http, "/v1/chat/completions", body)
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        finished.append((episode, time.perf_counter()))

    threads = [threading.Thread(target=train, args=(f"long-{i}",)) for i in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while not any(row.request.training for row in engine.steps.batch.rows) and time.monotonic() < deadline:
        time.sleep(0.005)
    users = []
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        for k in range(6):
            training_rows.append(sum(row.request.training for row in engine.steps.batch.rows))
            answer = http.post("/v1/chat/completions", json={"model": "tiny-agent", "messages": QUESTION,
                                                             "max_tokens": 4, "user": f"u-{k}"})
            assert answer.status_code == 200, answer.text
            users.append(time.perf_counter())
    for t in threads:
        t.join(120)
    assert len(finished) == 2, finished
    assert max(training_rows) == 1 and min(training_rows) == 1  # training decoding all along, in one row
    assert max(users) < min(at for _, at in finished), (users, finished)

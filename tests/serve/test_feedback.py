"""Users' feedback (``POST /v1/feedback``) and what records keep (issue 43 items 0 and 5), over real HTTP: feedback
lands beside its request as a reward row of source ``feedback`` and in /metrics, once per answer and source; bad
input gets a 4xx that says what is wrong; ids past the retention get 410, unknown ones 404; a restarted service
still knows the answers in its records file; prompts and answers are kept only when the service is told to, cut at
the cap; the not-for-training flag comes from the client or the service."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.serve.helpers import run_server
from verl.data.records import join_rewards

pytestmark = pytest.mark.e2e  # real servers

KEY = {"Authorization": "Bearer user-key"}


def chat(url: str, **verl) -> dict:
    body = {"messages": [{"role": "user", "content": "12+7="}], "max_tokens": 6, "temperature": 0}
    if verl:
        body["verl"] = verl
    response = httpx.post(url + "/v1/chat/completions", headers=KEY, json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def feedback(url: str, body: dict | str, headers: dict | None = None) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(url + "/v1/feedback", headers={"Content-Type": "application/json", **(KEY if headers is None
                                                     else headers)}, content=content, timeout=30)


def test_feedback_is_recorded_once_per_answer_and_source_and_bad_input_is_refused(tmp_path) -> None:
    with run_server(api_key="user-key", records_path=str(tmp_path / "records.jsonl"),
                    feedback_max_comment_chars=100) as srv:
        answer = chat(srv.url)
        cid = answer["id"]
        first = feedback(srv.url, {"id": cid, "thumbs": "down", "comment": "wrong sum"})
        assert first.status_code == 200 and first.json() == {
            "object": "feedback", "id": cid, "index": 0, "source": "user", "score": 0.0, "model": answer["model"],
            "duplicate": False}
        again = feedback(srv.url, {"id": cid, "thumbs": "down"})  # a retry: nothing new recorded
        assert again.status_code == 200 and again.json()["duplicate"] is True
        changed = feedback(srv.url, {"id": cid, "score": 0.9})
        assert changed.status_code == 409 and "already gave" in changed.json()["error"]["message"]
        other = feedback(srv.url, {"id": cid, "score": 0.75, "source": "labeller-7"})  # a second opinion
        assert other.status_code == 200 and other.json()["score"] == 0.75

        # What is wrong, and where: 4xx with the field named; nothing recorded.
        cases = [
            ({"id": "chatcmpl-nope", "score": 1.0}, 404, "id", "no answer with id 'chatcmpl-nope'"),
            ({"id": cid, "score": 1.5}, 400, "score", "less than or equal to 1"),
            ({"id": cid, "score": -0.1}, 400, "score", "greater than or equal to 0"),
            ({"id": cid, "score": "good"}, 400, "score", "valid number"),
            ({"id": cid, "thumbs": "sideways"}, 400, "thumbs", "'up' or 'down'"),
            ({"id": cid}, 400, "body", "exactly one of them"),
            ({"id": cid, "score": 1.0, "thumbs": "up"}, 400, "body", "exactly one of them"),
            ({"id": cid, "index": 3, "score": 1.0}, 400, "index", "has 1 choice(s)"),
            ({"id": cid, "score": 1.0, "comment": "x" * 101}, 400, "comment", "at most 100"),
            ({"id": cid, "score": 1.0, "source": "a b"}, 400, "source", "pattern"),
            ({"id": cid, "score": 1.0, "extra": 1}, 400, "extra", "Extra inputs"),
            ({"score": 1.0}, 400, "id", "Field required"),
        ]
        for body, status, param, says in cases:
            response = feedback(srv.url, body)
            error = response.json()["error"]
            assert response.status_code == status and error["param"] == param and says in error["message"], \
                (body, response.text)
        assert feedback(srv.url, "{not json").status_code == 400
        no_key = feedback(srv.url, {"id": cid, "score": 1.0}, headers={})
        assert no_key.status_code == 401 and "API key" in no_key.json()["error"]["message"]

        rows = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
        late = [r for r in rows if r["kind"] == "reward"]
        assert [(r["reward"], r["feedback_source"], r["reward_source"]) for r in late] == [
            (0.0, "user", "feedback"), (0.75, "labeller-7", "feedback")]
        assert late[0]["comment"] == "wrong sum" and late[0]["model"] == answer["model"] and late[0]["weights"]
        joined = join_rewards(rows, "feedback")
        assert [(r["id"], r["reward"], r["reward_source"]) for r in joined] == [(cid, 0.75, "feedback")]
        assert join_rewards(rows, "rule")[0]["reward"] is None  # sources are not mixed

        metrics = httpx.get(srv.url + "/metrics", headers=KEY).text
        model = answer["model"]
        counted = [(model, "recorded", 2), (model, "duplicate", 1), (model, "conflict", 1), (model, "invalid", 1),
                   ("unknown", "unknown_id", 1), ("unknown", "invalid", 1)]  # a bad index; a long comment
        for name, outcome, count in counted:
            assert f'verl:feedback_total{{model_name="{name}",outcome="{outcome}"}} {count}.0' in metrics
        assert f'verl:feedback_score_count{{model_name="{model}"}} 2.0' in metrics

    # A restart on the same records file: the answer is still known (feedback can come days later).
    with run_server(api_key="user-key", records_path=str(tmp_path / "records.jsonl")) as srv:
        late = feedback(srv.url, {"id": cid, "thumbs": "up", "source": "after-restart"})
        assert late.status_code == 200 and late.json()["model"] == answer["model"]
        assert feedback(srv.url, {"id": cid, "thumbs": "down"}).json()["duplicate"] is True


def test_feedback_past_the_retention_is_refused_with_410_and_the_rate_is_limited(tmp_path) -> None:
    records = tmp_path / "records.jsonl"
    old = {"kind": "request", "id": "chatcmpl-old", "index": 0, "time": time.time() - 7200, "model": "m"}
    records.write_text(json.dumps(old) + "\n")
    with run_server(records_path=str(records), records_retention_s=1.0, records_max_completions=2,
                    feedback_rate_limit=0.5, feedback_burst=2) as srv:
        assert "chatcmpl-old" not in records.read_text()  # rows past the retention are dropped at start
        first, second, third = (chat(srv.url)["id"] for _ in range(3))
        evicted = feedback(srv.url, {"id": first, "score": 1.0})  # the index holds 2: the oldest was forgotten
        assert evicted.status_code == 410 and "no longer accepted" in evicted.json()["error"]["message"]
        time.sleep(1.2)
        expired = feedback(srv.url, {"id": third, "score": 1.0})
        assert expired.status_code == 410 and "retention (1 s)" in expired.json()["error"]["message"]
        limited = feedback(srv.url, {"id": second, "score": 1.0})  # the third call: burst 2, 0.5 per second
        assert limited.status_code == 429 and limited.headers["Retry-After"] and "per second" in limited.text


def test_records_keep_texts_only_when_told_and_carry_the_not_for_training_flag(tmp_path) -> None:
    long_system = {"role": "system", "content": "You answer sums. " * 8}
    with run_server(record_texts=True, record_texts_max_chars=120) as srv:
        answer = chat(srv.url, not_for_training=True)
        cut = httpx.post(srv.url + "/v1/chat/completions", json={
            "messages": [long_system, {"role": "user", "content": "3+4="}], "max_tokens": 4}, timeout=60).json()
        plain = httpx.post(srv.url + "/v1/completions", json={"prompt": "2+2=", "max_tokens": 4, "temperature": 0,
                           "verl": {"ground_truth": "4", "reward": "arithmetic"}}, timeout=60).json()
        rows = {r["id"]: r for r in srv.app.state.service.records.snapshot()}
    row = rows[answer["id"]]
    assert row["prompt"] == [{"role": "user", "content": "12+7="}] and row["not_for_training"] is True
    assert row["answer"] == answer["choices"][0]["message"]["content"] and not row["texts_truncated"]
    assert row["reward"] is None and row["reward_expected"] is False  # no answer given: no rule reward
    kept = rows[cut["id"]]
    assert kept["texts_truncated"] and kept["prompt"][-1] == {"role": "user", "content": "3+4="}
    assert len(json.dumps(kept["prompt"])) <= 120 and kept["prompt"][0]["content"].endswith("You answer sums. ")
    ruled = rows[plain["id"]]
    assert ruled["prompt"] == "2+2=" and ruled["reward_source"] == "rule:arithmetic" and ruled["scorer_version"]
    assert ruled["not_for_training"] is False
    with run_server(records_not_for_training=True) as srv:  # default: no texts; the service marks everything
        answer = chat(srv.url)
        row = srv.app.state.service.records.snapshot()[-1]
    assert row["id"] == answer["id"] and row["prompt"] is None and row["answer"] is None and row["not_for_training"]

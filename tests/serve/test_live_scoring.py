"""Scoring live traffic (``score_traffic``, issue 43 item 6) over real HTTP: a reward model served beside the chat
model scores the answers in the background, each score a reward row of source ``rm:NAME`` equal to what /classify
gives for the same text (the prompt as the policy saw it, then the answer); a sample and a route filter are
honoured; a scorer behind a URL gives the same rows, and one that is down costs the scores (counted), never a
user's answer and never a 0."""

from __future__ import annotations

import re
import time

import httpx
import numpy as np
import pytest

from tests.ports import free_port
from tests.serve.helpers import run_server
from tests.serve.test_reward_serving import reward_model  # noqa: F401  (the module's RM fixture)
from tests.test_judge import between, judge_server, said, solve
from verl.data.records import join_rewards

pytestmark = pytest.mark.e2e  # real servers

PROMPTS = ["12+7=", "3*4=", "20-6=", "9+9=", "5*5=", "7-2="]


def chat(url: str, content: str, model: str | None = None) -> dict:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 6, "temperature": 0}
    if model is not None:
        body["model"] = model
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def rewards(service, wanted: int, timeout: float = 30.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = [r for r in service.records.snapshot() if r["kind"] == "reward"]
        if len(rows) >= wanted:
            return rows
        time.sleep(0.1)
    return [r for r in service.records.snapshot() if r["kind"] == "reward"]


def policy_text(service, content: str, answer: str) -> str:
    """What the trainer sends a reward model: the prompt through the policy's chat template, then the answer."""
    tokenizer = service.lifecycle.registry.models["chat"].engine.tokenizer
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                           add_generation_prompt=True)
    return prompt + answer


MODELS = lambda path: [{"name": "chat", "path": "builtin:tiny-arith"},  # noqa: E731
                       {"name": "judge", "path": str(path), "kind": "reward"}]


def test_a_served_reward_model_scores_the_answers_as_classify_would(reward_model) -> None:  # noqa: F811
    path, _ = reward_model
    with run_server(models=MODELS(path), routes={"default": {"chat": 1.0}}, record_texts=True,
                    score_traffic={"scorer": "judge", "routes": ["default"]}) as srv:
        service = srv.app.state.service
        answers = {chat(srv.url, p)["id"]: p for p in PROMPTS}
        direct = chat(srv.url, "1+1=", model="chat")  # not through the route: not scored
        rows = rewards(service, len(PROMPTS))
        assert sorted(r["id"] for r in rows) == sorted(answers) and direct["id"] not in {r["id"] for r in rows}
        requests = {r["id"]: r for r in service.records.snapshot() if r["kind"] == "request"}
        texts = [policy_text(service, prompt, requests[i]["answer"]) for i, prompt in answers.items()]
        expected = {}
        classified = httpx.post(srv.url + "/classify", json={"model": "judge", "input": texts,
                                                             "add_special_tokens": False}, timeout=60).json()
        for (completion_id, _), item in zip(answers.items(), classified["data"], strict=True):
            expected[completion_id] = item["probs"][0]
        for row in rows:
            assert row["reward_source"] == "rm:judge" and row["model"] == "chat" and row["route"] == "default"
            assert row["scorer_version"] and 0.0 <= row["reward"] <= 1.0
            assert row["reward"] == pytest.approx(expected[row["id"]], abs=1e-5)
            assert requests[row["id"]]["reward"] is None  # the request row itself carries no reward
        joined = {r["id"]: r for r in join_rewards(service.records.snapshot(), "rm:judge")}
        assert all(joined[i]["reward"] == pytest.approx(expected[i], abs=1e-5) for i in answers)
        assert all(joined[i]["reward"] is None for i in joined if i not in answers)
        metrics = httpx.get(srv.url + "/metrics").text
        assert f'verl:live_scores_total{{model_name="chat",outcome="scored"}} {len(PROMPTS)}.0' in metrics


def test_a_remote_scorer_and_one_that_is_down(reward_model) -> None:  # noqa: F811
    path, _ = reward_model
    with run_server(models=[{"name": "judge", "path": str(path), "kind": "reward"}]) as rm:
        with run_server(score_traffic={"scorer": f"{rm.url}#judge", "fraction": 1.0}) as srv:
            ids = {chat(srv.url, p)["id"] for p in PROMPTS[:3]}
            rows = rewards(srv.app.state.service, 3)
        assert {r["id"] for r in rows} == ids and {r["reward_source"] for r in rows} == {"rm:judge"}
        assert all(0.0 <= r["reward"] <= 1.0 and r["scorer_version"] == f"{rm.url}#judge" for r in rows)
    down = f"http://127.0.0.1:{free_port()}#judge"
    with run_server(score_traffic={"scorer": down, "timeout_s": 2.0}) as srv:
        for p in PROMPTS[:2]:
            chat(srv.url, p)  # the users' answers are not held up
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            metrics = httpx.get(srv.url + "/metrics").text
            if 'outcome="failed"} 2.0' in metrics:
                break
            time.sleep(0.5)
        assert 'verl:live_scores_total{model_name="tiny-arith",outcome="failed"} 2.0' in metrics
        assert not [r for r in srv.app.state.service.records.snapshot() if r["kind"] == "reward"]


def test_a_scorer_that_is_not_a_served_reward_model_is_refused_at_start() -> None:
    from serve.settings import load_settings
    from verl.errors import ConfigError

    with pytest.raises(ConfigError, match="score_traffic.scorer: 'nope' is not a reward model served here"):
        load_settings(models=[{"name": "chat", "path": "builtin:tiny-arith"}], score_traffic={"scorer": "nope"})


def test_a_chat_judge_behind_a_url_scores_the_answers_by_its_rubric(tmp_path) -> None:
    """`scorer: judge:URL#NAME`: the judge (a stub that follows the rubric's protocol: 10 for a right sum, 1 for a
    wrong one) reads the question and the answer between the markers; its score on 1..10 lands as a reward row of
    source judge:NAME, 1.0 for the right answers and 0.0 for the wrong ones, and the online A/B report reads it."""
    from eval.online import compare_online

    records = tmp_path / "records.jsonl"
    models = [{"name": "a", "path": "builtin:tiny-arith"}, {"name": "b", "path": "builtin:tiny-arith"}]
    with judge_server() as (judge_url, seen), run_server(
            models=models, routes={"default": {"a": 0.5, "b": 0.5}}, record_texts=True, records_path=str(records),
            score_traffic={"scorer": f"judge:{judge_url}#judge", "batch_size": 4}) as srv:
        answers = {chat(srv.url, p)["id"]: p for p in PROMPTS * 2}
        rows = rewards(srv.app.state.service, len(answers))
        requests = {r["id"]: r for r in srv.app.state.service.records.snapshot() if r["kind"] == "request"}
        metrics = httpx.get(srv.url + "/metrics").text
    assert sorted(r["id"] for r in rows) == sorted(answers)
    for row in rows:
        right = said(requests[row["id"]]["answer"]) == solve(answers[row["id"]])
        assert row["reward_source"] == "judge:judge" and row["reward"] == (1.0 if right else 0.0)
        assert row["scorer_version"].startswith(f"{judge_url}#judge rubric ")
    report = compare_online(str(records), reward_source="judge:judge")
    assert report["reward_source"] == "judge:judge"
    for name, summary in report["models"].items():
        judged = [r["reward"] for r in rows if r["model"] == name]
        assert summary["rewarded"] == len(judged) and summary["reward_mean"] == pytest.approx(np.mean(judged))
    asked = [body for body in seen if "messages" in body]
    assert len(asked) == len(answers) and all(b["model"] == "judge" for b in asked)
    recorded = {requests[i]["answer"] for i in answers}
    for body in asked:  # the conversation (as text) is the question; the answer alone lies between the markers
        question, answer = body["messages"][1]["content"].split("[Answer]")
        assert any(p in question for p in PROMPTS) and "<|" not in question
        assert between(answer, body["messages"][0]["content"]).strip("\n") in recorded
    scored = re.findall(r'verl:live_scores_total\{model_name="[ab]",outcome="scored"\} (\d+)', metrics)
    assert sum(int(float(n)) for n in scored) == len(answers)


def test_a_chat_judge_must_be_behind_a_url_and_its_rubric_must_exist(tmp_path) -> None:
    from serve.settings import load_settings
    from verl.errors import ConfigError

    with pytest.raises(ConfigError, match="a chat judge generates.*judge:http://host:port#NAME"):
        load_settings(score_traffic={"scorer": "judge:chat"})
    with pytest.raises(ConfigError, match="score_traffic.rubric: .*nope.txt is not a file"):
        load_settings(score_traffic={"scorer": "judge:http://127.0.0.1:1#j", "rubric": str(tmp_path / "nope.txt")})

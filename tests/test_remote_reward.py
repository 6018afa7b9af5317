"""The remote reward-model client against a real HTTP server that misbehaves on purpose: timeouts, 500s, 429s,
garbage, short answers and refusals. A reward that could not be obtained is NaN (missing) and counted, never 0; a
transient failure is retried; a 4xx that retrying cannot fix raises with the server's words."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from tests.http_stub import StubHandler, running
from tests.test_judge import judge_server
from tests.test_trainer import tiny_config
from verl.batch import TrainBatch
from verl.errors import ConfigError, VerlError
from verl.rewards.remote import RateLimiter, RemoteRewardModel, RemoteRewardRefused
from verl.trainer.local import LocalPPOTrainer
from verl.trainer.stages import mask_missing


class Behaviour:
    """What the fake reward server does with its k-th request (k from 0), and what it saw."""

    def __init__(self, plan):
        self.plan, self.seen, self.times, self.lock = plan, [], [], threading.Lock()

    def next(self, body: dict) -> str:
        with self.lock:
            k = len(self.seen)
            self.seen.append(body)
            self.times.append(time.monotonic())
        return self.plan(k, body)


@contextmanager
def reward_server(plan) -> Iterator[tuple[str, Behaviour]]:
    behaviour = Behaviour(plan)

    class Handler(StubHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = self.body()
            action = behaviour.next(body)
            if action == "sleep":
                time.sleep(1.0)
                action = "ok"
            status, payload = 200, None
            texts = body["input"]
            if action == "ok":  # the score is the text's length, so each text's answer is checkable
                payload = {"object": "list", "data": [{"index": i, "label": "LABEL_0", "probs": [len(t) / 100],
                                                       "num_classes": 1} for i, t in enumerate(texts)]}
            elif action == "garbage":
                payload = "<html>proxy error</html>"
            elif action == "short":
                payload = {"data": [{"index": 0, "probs": [0.5]}]}
            elif action == "nan":
                payload = {"data": [{"index": i, "probs": [float("nan")]} for i in range(len(texts))]}
            else:
                status, payload = int(action), {"error": {"message": f"status {action} on purpose"}}
            self.send(payload, status)

    with running(Handler) as url:
        yield url, behaviour


def client(url: str, **kwargs) -> RemoteRewardModel:
    return RemoteRewardModel(url, **{"batch_size": 2, "max_concurrency": 2, "timeout_s": 0.5, "max_retries": 2,
                                     "backoff_s": 0.01, **kwargs})


TEXTS = ["a", "bb", "ccc", "dddd", "eeeee"]


def test_answers_land_on_their_texts_in_order_across_concurrent_batches():
    with reward_server(lambda k, body: "ok") as (url, seen):
        scores, stats = client(url, model="judge").score(TEXTS)
    np.testing.assert_allclose(scores, [0.01, 0.02, 0.03, 0.04, 0.05])
    assert stats.requests == 3 and stats.failed_texts == 0 and stats.retries == 0
    assert all(b["model"] == "judge" and b["add_special_tokens"] is False and b["use_activation"] is True
               for b in seen.seen)


@pytest.mark.parametrize("first", ["sleep", "500", "503", "429", "garbage", "short", "nan"])
def test_a_transient_failure_is_retried(first):
    with reward_server(lambda k, body: first if k == 0 else "ok") as (url, _):
        scores, stats = client(url, max_concurrency=1).score(TEXTS)
    np.testing.assert_allclose(scores, [0.01, 0.02, 0.03, 0.04, 0.05])
    assert stats.retries == 1 and stats.failed_texts == 0


@pytest.mark.parametrize("always", ["500", "garbage", "sleep"])
def test_a_batch_that_keeps_failing_is_missing_never_zero(always):
    def plan(k, body):
        return always if body["input"][0] == "ccc" else "ok"  # the second batch fails every time

    with reward_server(plan) as (url, seen):
        scores, stats = client(url).score(TEXTS)
    assert np.isnan(scores[2:4]).all() and not np.isnan(scores[[0, 1, 4]]).any()
    assert stats.failed_batches == 1 and stats.failed_texts == 2 and stats.reasons
    assert sum(b["input"][0] == "ccc" for b in seen.seen) == 3  # the first try and two retries


@pytest.mark.parametrize("status", ["400", "401", "404"])
def test_a_refusal_raises_with_the_servers_words(status):
    with reward_server(lambda k, body: status) as (url, seen), pytest.raises(RemoteRewardRefused) as info:
        client(url).score(TEXTS)
    assert f"HTTP {status}" in str(info.value) and "on purpose" in str(info.value)
    assert len(seen.seen) <= 3  # no retries of a refusal (one per batch already in flight)


def test_logits_on_request_and_the_url_may_name_the_endpoint():
    with reward_server(lambda k, body: "ok") as (url, seen):
        client(f"{url}/classify", score="logit").score(["a"])
    assert seen.seen[0]["use_activation"] is False


def test_the_rate_limit_spaces_requests():
    with reward_server(lambda k, body: "ok") as (url, seen):
        client(url, batch_size=1, max_concurrency=4, rate_limit=20.0).score(TEXTS)
    # 20 requests/s: the 5th request may leave 4 x 50 ms after the 1st (threads may arrive out of order, so the span)
    assert len(seen.times) == 5 and max(seen.times) - min(seen.times) >= 0.2 * 0.75


def test_rate_limiter_unlimited_does_not_wait():
    limiter = RateLimiter(0)
    for _ in range(1000):
        limiter.acquire()
    assert limiter.next_free == 0.0


# ---------------------------------------------------------------- in training


def remote_trainer(tmp_path, url, **model):
    settings = {"url": url, "micro_batch_size": 2, "max_concurrency": 1, "timeout_s": 0.5, "max_retries": 0,
                "backoff_s": 0.0, **model}
    return LocalPPOTrainer(tiny_config(tmp_path, reward={"model": settings}), quiet=True)


def test_a_step_with_a_flaky_remote_rm_masks_the_failed_groups_and_counts_them(tmp_path):
    # 4 prompts x 2 answers, 2 texts per request: the second request (one whole group) fails.
    with reward_server(lambda k, body: "500" if k == 1 else "ok") as (url, _):
        trainer = remote_trainer(tmp_path, url)
        prompts = trainer.train_dataset.collate([0, 1, 2, 3])
        batch = trainer.roles.generate(prompts, trainer.rollout_stage.train_sampling(1))
        batch.non_tensor["uid"] = batch.non_tensor["index"]
        scores, extras, texts = trainer.roles.compute_reward(batch)
        assert np.isnan(scores[2:4].sum(-1)).all() and not np.isnan(scores[[0, 1, 4, 5, 6, 7]].sum(-1)).any()
        assert {"rm_score", "acc"} <= set(extras)  # the reward model's score beside the rule's accuracy
        typed = TrainBatch.from_proto(batch)
        typed.token_level_scores = scores
        typed, dropped = mask_missing(typed, trainer.config.reward, trainer.config.algorithm.adv_estimator)
        assert typed.response_mask[2:4].sum() == 0 and typed.response_mask[[0, 4]].sum() > 0
        assert (dropped.failed, dropped.dropped) == (2, 2) and not torch.isnan(typed.token_level_scores).any()
    with reward_server(lambda k, body: "500" if k % 4 == 1 else "ok") as (url, _):
        trainer = remote_trainer(tmp_path / "fit", url, max_failed_share=0.3)
        trainer.fit()  # a whole step: the update runs on what is left
    reward_rows = [json.loads(line) for line in trainer.config.log_path().read_text().splitlines()]
    reward_rows = [r for r in reward_rows if r["scope"] == "reward"]
    assert reward_rows and reward_rows[-1]["failed"] == 2.0 and reward_rows[-1]["dropped"] == 2.0
    assert reward_rows[-1]["failed_batches"] == 1 and reward_rows[-1]["requests"] == 4


def test_a_remote_rm_that_keeps_failing_stops_the_step_with_one_line(tmp_path):
    with reward_server(lambda k, body: "garbage") as (url, _):
        trainer = remote_trainer(tmp_path, url)
        with pytest.raises(VerlError, match=r"8 of 8 samples \(100%\) got no reward") as info:
            trainer.fit()
    assert url in str(info.value) and "\n" not in str(info.value)


def test_a_chat_judge_behind_a_url_is_the_reward_and_a_silent_one_stops_the_step(tmp_path):
    """reward.model.kind=judge: a chat model scores each answer by the rubric (the stub judge: 10 for a right sum, 1
    for a wrong one), so the reward is the rule's accuracy, 1.0 or 0.0; a judge that never gives a score costs no
    silent rewards: the step stops with one line naming the judge."""
    with judge_server() as (url, seen):
        trainer = remote_trainer(tmp_path, url, kind="judge", name="judge", timeout_s=30.0)
        prompts = trainer.train_dataset.collate([0, 1, 2, 3])
        batch = trainer.roles.generate(prompts, trainer.rollout_stage.train_sampling(1))
        scores, extras, texts = trainer.roles.compute_reward(batch)
        assert extras["rm_score"].tolist() == extras["acc"].tolist() == scores.sum(-1).tolist()
        assert len([b for b in seen if "messages" in b]) == len(texts) == 8
    with judge_server(silent=True) as (url, _):
        trainer = remote_trainer(tmp_path / "silent", url, kind="judge", name="judge", timeout_s=30.0)
        with pytest.raises(VerlError, match=r"8 of 8 samples \(100%\) got no reward") as info:
            trainer.fit()
    assert f"judge {url}" in str(info.value) and "\n" not in str(info.value)


def test_a_judge_reward_needs_a_url_and_an_existing_rubric(tmp_path):
    from verl.config import build_config

    with pytest.raises(ConfigError, match="reward.model.kind=judge needs reward.model.url"):
        build_config({"reward": {"model": {"kind": "judge"}}})
    with pytest.raises(ConfigError, match="reward.model.rubric: .*missing.txt is not a file"):
        build_config({"reward": {"model": {"kind": "judge", "url": "http://127.0.0.1:1",
                                           "rubric": str(tmp_path / "missing.txt")}}})

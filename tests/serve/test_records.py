"""Online records as ``verl ship``'s canary reads them (issue 41 items 3, 4, 8): each row names the completion id,
the hashed user, the config version and share it was routed under; failures the service knows of (engine errors,
injected faults, 429 at capacity, timeouts) are error rows; rewards that arrive later are rows of their own, joined
by completion id."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

from tests.serve.helpers import make_lora_adapters, run_server
from verl.data.records import join_rewards, reward_row, user_hash

pytestmark = pytest.mark.e2e  # real servers

ADMIN = {"Authorization": "Bearer admin-key"}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, str]:
    return make_lora_adapters(tmp_path_factory.mktemp("adapters"))


def records(url: str) -> list[dict]:
    return httpx.get(url + "/admin/records", headers=ADMIN, timeout=30).json()["records"]


def ask(url: str, user: str | None = None, **extra) -> httpx.Response:
    body = {"model": "default", "prompt": "12+7=", "max_tokens": 4, "temperature": 0,
            "verl": {"ground_truth": "19", "reward": "arithmetic"}, **extra}
    if user is not None:
        body["user"] = user
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def test_rows_name_completion_user_version_share_and_failures(adapters) -> None:
    models = [{"name": "tiny", "path": "builtin:tiny-arith"}, {"name": "a", "adapter": adapters["a"]}]
    with run_server(models=models, routes={"default": {"tiny": 0.75, "a": 0.25}}, admin_api_key="admin-key",
                    fault_error_rate={"a": 1.0}) as srv:
        version = httpx.get(srv.url + "/admin/state", headers=ADMIN).json()["version"]
        answers = {}
        for i in range(24):
            r = ask(srv.url, user=f"user-{i}")
            answers[f"user-{i}"] = r
        ok = [r for r in answers.values() if r.status_code == 200]
        failed = [r for r in answers.values() if r.status_code != 200]
        assert ok and failed and all(r.status_code == 500 and "injected fault" in r.text for r in failed)
        rows = records(srv.url)
        by_id = {r["id"]: r for r in rows}
        for user, response in answers.items():
            if response.status_code != 200:
                continue
            row = by_id[response.json()["id"]]  # the id the client saw
            assert row["kind"] == "request" and row["index"] == 0 and row["user"] == user_hash(user) != user
            assert row["config_version"] == version and row["route_share"] == 0.75 and row["model"] == "tiny"
            assert row["arrival"] <= row["time"] and row["reward_expected"] and row["reward_source"] == \
                "rule:arithmetic" and row["reward"] in (0.0, 1.0) and row["error"] is None
        errors = [r for r in rows if r["error"]]
        assert len(errors) == len(failed) and {r["model"] for r in errors} == {"a"}
        assert all("injected fault" in r["error"] and r["route_share"] == 0.25 and r["reward"] is None for r in errors)

        # A route change: later rows carry the new version and share.
        state = httpx.put(srv.url + "/admin/routes/default", headers=ADMIN,
                          json={"weights": {"tiny": 0.5, "a": 0.5}}).json()
        assert state["version"] == version + 1
        ask(srv.url, user="user-0")
        assert records(srv.url)[-1]["config_version"] == version + 1

        # A reward that arrives later: its own row, with the request's model and route, folded in by id.
        rid = ok[0].json()["id"]
        posted = httpx.post(srv.url + "/admin/records/rewards", headers=ADMIN, json={"rewards": [
            {"id": rid, "index": 0, "reward": 0.25, "source": "judge:test"},
            {"id": "cmpl-unknown", "reward": 1.0, "source": "judge:test"}]})
        assert posted.status_code == 200 and posted.json() == {"recorded": 2, "not_in_memory": ["cmpl-unknown"]}
        late = [r for r in records(srv.url) if r["kind"] == "reward"]
        assert late[0]["id"] == rid and late[0]["model"] == "tiny" and late[0]["route"] == "default"
        for bad, where in (('{"id": "x", "reward": NaN, "source": "s"}', "reward"),
                           ('{"id": "", "reward": 1.0, "source": "s"}', "id"),
                           ('{"id": "x", "reward": 1.0}', "source")):
            r = httpx.post(srv.url + "/admin/records/rewards", content=f'{{"rewards": [{bad}]}}',
                           headers={**ADMIN, "Content-Type": "application/json"})
            assert r.status_code == 400 and where in r.text, r.text
        assert httpx.post(srv.url + "/admin/records/rewards", json={"rewards": []}).status_code == 401


def test_refusals_at_capacity_and_timeouts_are_error_rows() -> None:
    with run_server(admin_api_key="admin-key", max_batch_size=1, max_queue_size=0, request_timeout_s=30) as srv:
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(ask, srv.url, model=None, max_tokens=64, ignore_eos=True) for _ in range(6)]
            codes = [f.result().status_code for f in futures]
        assert 429 in codes and 200 in codes
        refused = [r for r in records(srv.url) if r["error"] and r["error"].startswith("queue_full")]
        assert len(refused) == codes.count(429) and all(r["finish_reason"] == "abort" for r in refused)
    with run_server(admin_api_key="admin-key", request_timeout_s=0.05) as srv:
        r = ask(srv.url, model=None, max_tokens=128, ignore_eos=True)
        assert r.status_code == 504
        deadline = time.monotonic() + 10
        while not any(row["error"] for row in records(srv.url)) and time.monotonic() < deadline:
            time.sleep(0.05)
        [row] = records(srv.url)
        assert row["error"].startswith("timeout") and row["finish_reason"] == "abort"


def test_join_rewards_folds_late_rewards_into_their_requests() -> None:
    rows = [{"kind": "request", "id": "c1", "index": 0, "model": "a", "reward": None, "e2e_s": 0.1},
            {"kind": "request", "id": "c1", "index": 1, "model": "a", "reward": 1.0, "e2e_s": 0.1},
            {"id": None, "model": "b", "reward": None, "e2e_s": 0.1},  # a row written before rows had ids
            reward_row("c1", 0, 0.5, "judge:x", at=1.0), reward_row("c9", 0, 1.0, "judge:x", at=1.0)]
    joined = join_rewards(rows)
    assert [r["reward"] for r in joined] == [0.5, 1.0, None]
    assert joined[0]["reward_source"] == "judge:x" and len(joined) == 3

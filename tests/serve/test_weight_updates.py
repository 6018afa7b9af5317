"""Weights into a running server under vLLM's names (issue 64, item 4): /pause (abort, wait, keep), /resume,
/update_weights (full safetensors or a LoRA adapter), /sleep and /wake_up, /v1/load_lora_adapter; behind the admin
key; the version that sampled each token in the headers and the records. Real uvicorn, the real tiny model."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.serve.helpers import make_lora_adapters, metric_value, run_server
from verl.models.loader import resolve_model_path

ADMIN = {"Authorization": "Bearer admin-key"}
BASE = resolve_model_path("builtin:tiny-arith")
PROMPT = "12+7="
LONG = 120  # tokens per request where a pause must find requests in flight (ignore_eos: every one runs to length)


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> dict[str, str]:
    """The base weights, a perturbed copy, two files that do not fit, and two LoRA adapters."""
    root = tmp_path_factory.mktemp("weights")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(BASE)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(root / "perturbed")
    from safetensors.torch import load_file, save_file

    state = load_file(str(root / "perturbed" / "model.safetensors"))
    (root / "partial").mkdir()
    save_file(dict(list(state.items())[: len(state) // 2]), str(root / "partial" / "model.safetensors"))
    (root / "renamed").mkdir()
    save_file({("x." + k if i == 0 else k): v for i, (k, v) in enumerate(state.items())},
              str(root / "renamed" / "model.safetensors"))
    return {"base": BASE, "perturbed": str(root / "perturbed"), "partial": str(root / "partial"),
            "renamed": str(root / "renamed"), **make_lora_adapters(root / "lora")}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    records = tmp_path_factory.mktemp("records") / "records.jsonl"
    with run_server(admin_api_key="admin-key", records_path=str(records), max_batch_size=8, max_queue_size=16) as srv:
        yield srv, records


def complete(url: str, model: str = "tiny-arith", **extra) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 0,
            "return_token_ids": True, **extra}
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def answer(url: str, model: str = "tiny-arith") -> tuple[list[int], list[float]]:
    choice = complete(url, model).json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def hf_logprobs(path: str, prompt_ids: list[int], ids: list[int]) -> list[float]:
    """Each of ``ids``' log-probs after ``prompt_ids`` under the weights at ``path``, by a plain HF forward."""
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + ids])).logits[0, len(prompt_ids) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0].tolist()


def post(url: str, path: str, **kw) -> httpx.Response:
    return httpx.post(url + path, headers=ADMIN, timeout=60, **kw)


def records(path: Path) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("kind") == "request"]


class Streams:
    """``n`` streamed completions of ``LONG`` tokens in threads: the chunks each received, and its finish reason."""

    def __init__(self, url: str, n: int, **extra):
        self.chunks = [0] * n
        self.finish: list[str | None] = [None] * n
        self.started = [threading.Event() for _ in range(n)]
        body = {"model": "tiny-arith", "prompt": PROMPT, "max_tokens": LONG, "temperature": 1.0, "seed": 1,
                "ignore_eos": True, "stream": True, **extra}
        self.threads = [threading.Thread(target=self._run, args=(i, url, {**body, "seed": i}), daemon=True)
                        for i in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, i: int, url: str, body: dict) -> None:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    self.chunks[i] += 1
                    self.started[i].set()
                    self.finish[i] = choice.get("finish_reason") or self.finish[i]

    def wait_started(self) -> None:
        for event in self.started:
            assert event.wait(60)

    def join(self) -> None:
        for t in self.threads:
            t.join(120)
            assert not t.is_alive()


def test_the_endpoints_need_the_admin_key(server):
    srv, _ = server
    for method, path in [("POST", "/pause"), ("POST", "/resume"), ("GET", "/is_paused"), ("POST", "/update_weights"),
                         ("POST", "/sleep"), ("POST", "/v1/load_lora_adapter")]:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            got = httpx.request(method, srv.url + path, headers=headers, json={}, timeout=30)
            assert got.status_code == 401, (path, got.text)
    assert httpx.get(srv.url + "/is_paused", headers=ADMIN, timeout=30).json() == {"is_paused": False}


def test_update_weights_in_place_and_back(server, weights):
    srv, records_path = server
    before_ids, before_lp = answer(srv.url)
    got = post(srv.url, "/update_weights", json={"update_info": {"path": weights["perturbed"]}})
    assert got.status_code == 200 and got.json()["weight_version"] == 1, got.text
    served = complete(srv.url)
    assert served.headers["X-Verl-Weight-Version"] == "1"
    choice = served.json()["choices"][0]
    # The served log-probs are the new weights' (a plain HF forward of the saved directory), not the old ones'.
    expected = hf_logprobs(weights["perturbed"], choice["prompt_token_ids"], choice["token_ids"])
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(expected, abs=2e-4)
    assert (choice["token_ids"], choice["logprobs"]["token_logprobs"]) != (before_ids, before_lp)
    # Back to the base weights under an explicit version: the first answer again, to rounding.
    back = post(srv.url, "/update_weights", json={"update_info": {"path": weights["base"], "version": 7}})
    assert back.json()["weight_version"] == 7
    ids, lp = answer(srv.url)
    assert ids == before_ids and lp == pytest.approx(before_lp, abs=1e-5)
    time.sleep(0.3)
    versions = [r["weight_version"] for r in records(records_path)]
    assert versions[:1] == [0] and 1 in versions and versions[-1] == 7


def test_an_update_that_does_not_fit_is_refused_and_changes_nothing(server, weights):
    srv, _ = server
    before = answer(srv.url)
    for name, words in [("partial", "do not cover"), ("renamed", "does not have (first: x.")]:
        got = post(srv.url, "/update_weights", json={"update_info": {"path": weights[name]}})
        assert got.status_code == 400 and words in got.json()["error"]["message"], got.text
    for info, words in [({"path": "/nonexistent"}, "is not a directory"), ({"pat": "x"}, "update_info.pat"),
                        ({"names": ["w"], "dtype_names": ["f32"], "shapes": [[1]]}, "NCCL"),
                        ({"path": weights["base"], "model": "nope"}, "no model named 'nope'")]:
        got = post(srv.url, "/update_weights", json={"update_info": info})
        assert got.status_code in (400, 404) and words in got.json()["error"]["message"], (info, got.text)
    assert answer(srv.url) == before
    assert complete(srv.url).headers["X-Verl-Weight-Version"] == "7"


def test_pause_keep_update_resume_loses_no_request_and_records_the_switch(server, weights):
    srv, records_path = server
    seen = len(records(records_path))
    streams = Streams(srv.url, 6)
    streams.wait_started()
    assert post(srv.url, "/pause", params={"mode": "keep"}).json() == {"status": "paused"}
    time.sleep(0.3)  # chunks sampled before the pause may still be on their way to the clients
    frozen = list(streams.chunks)
    running = [i for i, f in enumerate(streams.finish) if f is None]
    # The kept rows hold their prompt and all but their newest token (the next step's input) in the KV cache:
    # the usage gauge is that over the 8 rows x max_model_len positions, under both names.
    engine = srv.service.lifecycle.engine
    cached = sum(len(seq.request.prompt_token_ids) + len(seq.generated) - 1 for seq in engine.steps.batch.rows)
    page = httpx.get(srv.url + "/metrics").text
    assert cached > 0
    for name in ("verl:kv_cache_usage_perc", "vllm:kv_cache_usage_perc"):
        assert metric_value(page, name, model_name="tiny-arith") == pytest.approx(cached / (8 * engine.max_model_len))
    queued = Streams(srv.url, 2)  # arrives while paused: waits
    time.sleep(0.5)
    assert streams.chunks == frozen and queued.chunks == [0, 0]  # nothing moves while paused
    assert httpx.get(srv.url + "/is_paused", headers=ADMIN).json() == {"is_paused": True}
    assert post(srv.url, "/update_weights", json={"update_info": {"path": weights["perturbed"], "version": 8}}
                ).status_code == 200
    assert post(srv.url, "/resume").json() == {"status": "resumed"}
    streams.join()
    queued.join()
    assert streams.finish == ["length"] * 6 and queued.finish == ["length"] * 2
    assert running, "no request was in flight at the pause (the test needs longer requests)"
    time.sleep(0.3)
    rows = records(records_path)[seen:]
    assert len(rows) == 8 and all(r["error"] is None and r["completion_tokens"] == LONG for r in rows)
    switched = [r["weight_versions"] for r in rows if r["weight_versions"] is not None]
    # Requests frozen mid-answer carry both versions, in order: old tokens 7, the rest 8.
    assert len(switched) == len(running)
    for versions in switched:
        cut = versions.index(8)
        assert len(versions) == LONG and set(versions[:cut]) == {7} and set(versions[cut:]) == {8}
    assert sorted(r["weight_version"] for r in rows if r["weight_versions"] is None) == [8] * (8 - len(running))
    post(srv.url, "/update_weights", json={"update_info": {"path": weights["base"], "version": 9}})


def test_pause_abort_ends_requests_and_wait_lets_them_finish(server):
    srv, _ = server
    streams = Streams(srv.url, 3)
    streams.wait_started()
    post(srv.url, "/pause", params={"mode": "abort"})
    streams.join()
    assert set(streams.finish) <= {"abort", "length"} and "abort" in streams.finish
    waiting = Streams(srv.url, 1)
    time.sleep(0.4)
    assert waiting.chunks == [0]
    post(srv.url, "/resume")
    waiting.join()
    assert waiting.finish == ["length"]

    streams = Streams(srv.url, 3)
    streams.wait_started()
    assert post(srv.url, "/pause", params={"mode": "wait"}).json() == {"status": "paused"}
    engine = srv.service.lifecycle.engine
    assert engine.num_running == 0  # wait returns once the running sequences are done
    post(srv.url, "/resume")
    streams.join()
    assert streams.finish == ["length"] * 3


def test_sleep_and_wake_up(server):
    srv, _ = server
    before = answer(srv.url)
    assert post(srv.url, "/sleep", params={"level": 1}).json() == {"status": "sleeping", "level": 1}
    assert httpx.get(srv.url + "/is_sleeping", headers=ADMIN).json() == {"is_sleeping": True}
    assert "wake_up" in post(srv.url, "/resume").json()["error"]["message"]
    late = Streams(srv.url, 1)
    time.sleep(0.3)
    assert late.chunks == [0]
    assert post(srv.url, "/wake_up").json() == {"status": "awake"}
    late.join()
    assert late.finish == ["length"] and answer(srv.url) == before
    refused = post(srv.url, "/sleep", params={"level": 2})
    assert refused.status_code == 400 and "level 2" in refused.json()["error"]["message"]
    assert post(srv.url, "/reset_prefix_cache").status_code == 200


def test_lora_adapters_load_in_place_and_as_the_policy(server, weights):
    srv, _ = server
    base = answer(srv.url)
    for name in ("a", "b"):
        got = post(srv.url, "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": weights[name]})
        assert got.status_code == 200 and got.text == f"Success: LoRA adapter '{name}' added successfully."
    assert {"a", "b"} <= {m["id"] for m in httpx.get(srv.url + "/v1/models").json()["data"]}
    a, b = answer(srv.url, "a"), answer(srv.url, "b")
    assert a != base and b != base and a != b
    assert post(srv.url, "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": weights["b"]}).status_code == 409
    # In place: adapter a now holds b's factors (one engine, no restart): its answers are b's.
    inplace = post(srv.url, "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": weights["b"],
                                                           "load_inplace": True})
    assert inplace.status_code == 200 and answer(srv.url, "a") == b
    assert complete(srv.url, "a").headers["X-Verl-Weight-Version"] == "1"
    # A LoRA directory sent for the full model becomes its policy (base + adapter, unmerged): b's answers.
    post(srv.url, "/update_weights", json={"update_info": {"path": weights["b"], "version": 10}})
    assert answer(srv.url) == b and answer(srv.url, "b") == b
    post(srv.url, "/update_weights", json={"update_info": {"path": weights["a"], "version": 11}})
    assert answer(srv.url) == a
    # Full weights replace the policy adapter: the base answers again.
    post(srv.url, "/update_weights", json={"update_info": {"path": weights["base"], "version": 12}})
    assert answer(srv.url) == base
    for name in ("a", "b"):
        got = post(srv.url, "/v1/unload_lora_adapter", json={"lora_name": name})
        assert got.status_code == 200 and got.text == f"Success: LoRA adapter '{name}' removed successfully."
    assert complete(srv.url, "a").status_code == 404

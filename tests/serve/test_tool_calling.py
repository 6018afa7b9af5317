"""OpenAI tool calling and structured output over real HTTP (uvicorn), driven by the official ``openai`` client.

The served model is ``builtin:tiny-agent``, the shipped tool-using warm start. What constrained decoding
guarantees (``tool_choice`` required / named, ``response_format``) is checked on sampled outputs (temperature 1,
many seeds), on tools the model never saw, where only the grammar can make the output valid.
"""

from __future__ import annotations

import json

import httpx
import pytest
from jsonschema import Draft202012Validator
from openai import OpenAI

from tests.serve.helpers import run_server
from tests.serve.test_openai_schemas import sse_chunks, validate
from verl.tools.calculator import calculator

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
# Never seen in training: the model can fill it in validly only because decoding is constrained.
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lima", "Oslo"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
QUESTION = [{"role": "user", "content": "What is 37*412?"}]


@pytest.fixture(scope="module")
def agent():
    with run_server(model="builtin:tiny-agent", max_output_tokens=256, max_n=16, max_batch_size=16) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(agent):
    return OpenAI(base_url=agent.url + "/v1", api_key="unused", max_retries=0)


def arguments_fit(call, tools: list[dict]) -> dict:
    """The call's arguments, parsed, after checking they fit the named tool's schema."""
    schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == call.function.name)
    arguments = json.loads(call.function.arguments)
    errors = list(Draft202012Validator(schema).iter_errors(arguments))
    assert not errors, f"{call.function.arguments}: {errors[0].message}"
    return arguments


def test_required_gives_valid_calls_on_every_sample(client):
    tools = [CALCULATOR, WEATHER]
    response = client.chat.completions.create(model="tiny-agent", messages=QUESTION, tools=tools,
                                              tool_choice="required", n=8, temperature=1.0, seed=7, max_tokens=96)
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.tool_calls, choice
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            arguments_fit(call, tools)
    validate(response.model_dump(exclude_unset=True), "CreateChatCompletionResponse")


def test_a_named_function_is_called_exactly_once_with_schema_valid_arguments(client):
    for seed in range(6):
        response = client.chat.completions.create(
            model="tiny-agent", messages=[{"role": "user", "content": "Weather?"}], tools=[CALCULATOR, WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=1.0, seed=seed,
            max_tokens=96)
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        arguments = arguments_fit(call, [WEATHER])
        assert arguments["city"] in ("Paris", "Lima", "Oslo") and 1 <= arguments["days"] <= 7


def test_parallel_tool_calls_false_means_one_call(client):
    response = client.chat.completions.create(model="tiny-agent", messages=QUESTION, tools=[CALCULATOR],
                                              tool_choice="required", parallel_tool_calls=False, n=6,
                                              temperature=1.0, seed=3, max_tokens=96)
    assert [len(c.message.tool_calls) for c in response.choices] == [1] * 6


def test_auto_lets_the_model_choose_and_none_never_parses_calls(client):
    auto = client.chat.completions.create(model="tiny-agent", messages=QUESTION, tools=[CALCULATOR], n=16,
                                          temperature=1.0, seed=11, max_tokens=96)
    called = [c for c in auto.choices if c.message.tool_calls]
    answered = [c for c in auto.choices if not c.message.tool_calls]
    assert called and answered  # the warm start calls the tool sometimes: both paths show up
    assert all(c.finish_reason == "tool_calls" and c.message.content is None for c in called)
    assert all(c.finish_reason in ("stop", "length") and c.message.content for c in answered)
    none = client.chat.completions.create(model="tiny-agent", messages=QUESTION, tools=[CALCULATOR], n=16,
                                          tool_choice="none", temperature=1.0, seed=11, max_tokens=96)
    assert all(c.message.tool_calls is None and c.finish_reason != "tool_calls" for c in none.choices)
    # Same seed, same samples: what auto returned as calls, none returns as the text the model wrote.
    for a, n in zip(auto.choices, none.choices, strict=True):
        if a.message.tool_calls:
            assert "<tool_call>" in n.message.content and a.message.tool_calls[0].function.name in n.message.content


def test_the_openai_client_tool_loop(client):
    """The client runs the tool the model calls and sends the result back; the model answers with it."""
    messages = list(QUESTION)
    first = client.chat.completions.create(model="tiny-agent", messages=messages, tools=[CALCULATOR],
                                           tool_choice="required", temperature=0, max_tokens=96)
    call = first.choices[0].message.tool_calls[0]
    result = calculator(**json.loads(call.function.arguments))  # the client runs the tool, not the service
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": result}]
    second = client.chat.completions.create(model="tiny-agent", messages=messages, tools=[CALCULATOR],
                                            temperature=0, max_tokens=32)
    assert second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.tool_calls is None
    assert result in second.choices[0].message.content  # the warm start copies the tool's result into its answer


def test_streamed_calls_equal_the_non_streamed_ones(agent, client):
    body = {"model": "tiny-agent", "messages": QUESTION, "tools": [CALCULATOR, WEATHER], "tool_choice": "required",
            "temperature": 1.0, "seed": 5, "max_tokens": 96}
    whole = client.chat.completions.create(**body)
    with httpx.Client(base_url=agent.url, timeout=60) as http:
        chunks = sse_chunks(http, "/v1/chat/completions", {**body, "stream": True})
    for chunk in chunks:
        validate(chunk, "CreateChatCompletionStreamResponse")
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    streamed = [call for d in deltas for call in d.get("tool_calls", [])]
    expected = whole.choices[0].message.tool_calls
    assert [(c["index"], c["function"]["name"], c["function"]["arguments"]) for c in streamed] == [
        (i, c.function.name, c.function.arguments) for i, c in enumerate(expected)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


BOUNDED = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
    "type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 999999},
                                     "unit": {"enum": ["kg", "m"]}},
    "required": ["answer", "unit"], "additionalProperties": False}}}


def test_a_json_schema_response_format_gives_json_that_fits(client):
    """Every sample (temperature 1) is a JSON object of exactly that shape: the grammar leaves no other path."""
    response = client.chat.completions.create(model="tiny-agent", messages=QUESTION, n=8, temperature=1.0, seed=2,
                                              max_tokens=64, response_format=BOUNDED)
    for choice in response.choices:
        assert choice.finish_reason == "stop", choice.message.content
        Draft202012Validator(BOUNDED["json_schema"]["schema"]).validate(json.loads(choice.message.content))


def test_json_object_output_is_json_whenever_it_ends(client):
    """`json_object` bounds nothing (a 1M-parameter model may write digits until max_tokens), but what ends is an
    object, and what is cut is a prefix of one (it starts with '{' and never breaks the grammar before the cut)."""
    response = client.chat.completions.create(model="tiny-agent", messages=QUESTION, n=8, temperature=1.0, seed=2,
                                              max_tokens=64, response_format={"type": "json_object"})
    finished = [c for c in response.choices if c.finish_reason == "stop"]
    assert finished
    for choice in finished:
        assert isinstance(json.loads(choice.message.content), dict)
    for choice in response.choices:
        assert choice.message.content.startswith("{")


def nested(depth: int) -> dict:
    """An object schema ``depth`` levels deep (issue 42: 200 levels ended in a RecursionError, a 500)."""
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


HISTORY = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "37*412"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "15244"}]


@pytest.mark.parametrize(("change", "param", "message"), [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "wrong"}}}]},
     "tools[0].function.parameters", "not a valid JSON Schema"),
    ({"tools": [CALCULATOR, CALCULATOR]}, "tools[1].function.name", "names must be unique"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, None, "name"),
    ({"tools": [CALCULATOR], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not among the tools"),
    ({"tool_choice": "required"}, "tool_choice", "only allowed when 'tools'"),
    ({"tools": [CALCULATOR], "tool_choice": "sometimes"}, None, "tool_choice"),
    ({"messages": [*QUESTION, {"role": "tool", "tool_call_id": "call_9", "content": "1"}]},
     "messages[1].tool_call_id", "answers no tool call"),
    ({"messages": [*QUESTION, {"role": "tool", "content": "1"}]}, "messages[1].tool_call_id", "without"),
    # OpenAI's rule (issue 64): every call is answered before the next user or assistant message, or at the end.
    ({"messages": [*HISTORY[:2], *QUESTION]}, "messages[1].tool_calls",
     "'call_1' had no answer before messages[2]"),
    ({"messages": HISTORY[:2]}, "messages[1].tool_calls", "'call_1' had no answer before the end of the messages"),
    ({"messages": [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "calculator", "arguments": "{}"}},
        {"id": "b", "type": "function", "function": {"name": "calculator", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "a", "content": "1"}, {"role": "assistant", "content": "2"}]},
     "messages[1].tool_calls", "'b' had no answer before messages[3]"),
    ({"messages": [*QUESTION, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "calculator", "arguments": "{not json"}}]}]}, "messages[1].tool_calls[0].function.arguments",
     "not valid JSON"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "response_format.json_schema.schema", "not a valid JSON Schema"),
    ({"response_format": {"type": "yaml"}}, None, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": nested(200)}}]},
     "tools[0].function.parameters", "nested more than 32 levels deep"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": nested(200)}}},
     "response_format.json_schema.schema", "nested more than 32 levels deep"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(6000)}}}}},
     "response_format.json_schema.schema", "more than 10000 values"),
])
def test_bad_tool_requests_are_400_in_openai_shape(agent, change, param, message):
    body = {"model": "tiny-agent", "messages": QUESTION, "max_tokens": 8, **change}
    response = httpx.post(agent.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    validate(response.json(), "ErrorResponse")
    error = response.json()["error"]
    assert message in error["message"]
    if param is not None:
        assert error["param"] == param


def test_a_history_with_calls_renders_through_the_tool_template(agent):
    tokens = httpx.post(agent.url + "/tokenize", json={"messages": HISTORY}, timeout=30).json()["tokens"]
    text = httpx.post(agent.url + "/detokenize", json={"tokens": tokens}, timeout=30).json()["prompt"]
    assert '<tool_call>\n{"name": "calculator", "arguments": {"expression": "37*412"}}\n</tool_call>' in text
    assert text.endswith("<|tool|>15244\n<|assistant|>")
    # A finished turn that ends on its calls renders (nothing is to answer them yet); a prompt to answer does not.
    turn = {"messages": HISTORY[:2], "add_generation_prompt": False}
    assert httpx.post(agent.url + "/tokenize", json=turn, timeout=30).status_code == 200
    assert httpx.post(agent.url + "/tokenize", json={**turn, "add_generation_prompt": True}, timeout=30).status_code \
        == 400


def test_a_model_whose_template_renders_no_tools_says_so(server):
    """The arithmetic warm start's template has no tools and its vocabulary no ChatML: 400, naming what to do."""
    response = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "messages": QUESTION, "tools": [CALCULATOR], "max_tokens": 4})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "tools"
    assert "renders no tools" in response.json()["error"]["message"]


def test_the_default_service_answers_tool_calls_with_the_tool_model(monkeypatch):
    """`uvicorn serve.api:app` with nothing configured serves tiny-arith and, beside it, tiny-agent: a chat with
    tools that names no model is answered by the model whose template renders them."""
    from serve.api import create_app
    from serve.settings import load_settings

    monkeypatch.delenv("VERL_SERVE_MODEL", raising=False)
    settings = load_settings(max_output_tokens=128)
    assert settings.model_source == "default"
    assert [e.name for e in settings.model_entries()] == ["tiny-arith", "tiny-agent"]
    import threading

    import uvicorn

    from tests.ports import free_port
    from tests.serve.helpers import wait_healthy

    app, port = create_app(settings), free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url)
        models = [m["id"] for m in httpx.get(url + "/v1/models", timeout=30).json()["data"]]
        assert models == ["tiny-arith", "tiny-agent"]
        reply = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "messages": QUESTION, "tools": [CALCULATOR], "tool_choice": "required", "max_tokens": 96})
        assert reply.status_code == 200, reply.text
        assert reply.json()["model"] == "tiny-agent" and reply.json()["choices"][0]["message"]["tool_calls"]
        plain = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "12+30"}], "max_tokens": 8})
        assert plain.json()["model"] == "tiny-arith"  # everything else stays with the default model
    finally:
        server.should_exit = True
        thread.join(30)


def test_return_token_ids_gives_the_ids_as_rendered_and_as_sampled(agent):
    """vLLM's ``return_token_ids``: the chat's rendered prompt ids and each choice's sampled ids (the stop token
    included), the same streamed and not; decoded, the sampled ids are the answer with its tool-call block."""
    body = {"model": "tiny-agent", "messages": QUESTION, "tools": [CALCULATOR], "tool_choice": "required",
            "temperature": 1.0, "seed": 11, "max_tokens": 96, "return_token_ids": True}
    with httpx.Client(base_url=agent.url, timeout=60) as http:
        whole = http.post("/v1/chat/completions", json=body).json()
        chunks = sse_chunks(http, "/v1/chat/completions", {**body, "stream": True})
        plain = http.post("/v1/chat/completions", json={**body, "return_token_ids": False}).json()
        prompt_text = http.post("/detokenize", json={"tokens": whole["prompt_token_ids"]}).json()["prompt"]
        answer_text = http.post("/detokenize", json={"tokens": whole["choices"][0]["token_ids"]}).json()["prompt"]
        completion = http.post("/v1/completions", json={"model": "tiny-agent", "prompt": prompt_text, "seed": 11,
                                                        "max_tokens": 96, "return_token_ids": True}).json()
        tokenized = http.post("/tokenize", json={"prompt": prompt_text}).json()["tokens"]
    validate(whole, "CreateChatCompletionResponse")
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
    ids = whole["choices"][0]["token_ids"]
    assert len(ids) == whole["usage"]["completion_tokens"] and whole["usage"]["prompt_tokens"] == len(
        whole["prompt_token_ids"])
    assert prompt_text.endswith("<|assistant|>") and QUESTION[0]["content"] in prompt_text
    assert "<tool_call>" in answer_text and whole["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert [t for c in chunks if c["choices"] for t in c["choices"][0].get("token_ids", [])] == ids
    # /v1/completions on the rendered text: the ids it reports are its tokenization, and it samples the same ids.
    assert completion["choices"][0]["prompt_token_ids"] == tokenized
    assert completion["choices"][0]["token_ids"] == ids


def test_inference_generate_is_token_in_token_out(agent):
    """vLLM's ``/inference/v1/generate``: the rendered chat's ids in, the same ids and log-probs out as the chat
    completion sampled (same seed); bad sampling params are 400s naming ``sampling_params.<field>``."""
    body = {"model": "tiny-agent", "messages": QUESTION, "tools": [CALCULATOR], "temperature": 1.0, "seed": 3,
            "max_tokens": 64, "return_token_ids": True, "logprobs": True}
    with httpx.Client(base_url=agent.url, timeout=60) as http:
        chat = http.post("/v1/chat/completions", json=body).json()
        params = {"max_tokens": 64, "temperature": 1.0, "seed": 3, "logprobs": 0}
        out = http.post("/inference/v1/generate", json={"model": "tiny-agent", "token_ids": chat["prompt_token_ids"],
                                                        "sampling_params": params, "request_id": "r1"})
        bad = [http.post("/inference/v1/generate", json={"token_ids": [1, 2], **change}) for change in (
            {"sampling_params": {"temperature": 9}}, {"sampling_params": {"best_of": 2}}, {"stream": True})]
    assert out.status_code == 200, out.text
    answer = out.json()
    assert answer["request_id"] == "r1" and answer["usage"]["prompt_tokens"] == len(chat["prompt_token_ids"])
    [choice] = answer["choices"]
    assert choice["token_ids"] == chat["choices"][0]["token_ids"]
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert [c["logprob"] for c in content] == [c["logprob"] for c in chat["choices"][0]["logprobs"]["content"]]
    assert [r.status_code for r in bad] == [400, 400, 400]
    assert [r.json()["error"]["param"] for r in bad] == ["sampling_params.temperature", "sampling_params.best_of",
                                                          "stream"]

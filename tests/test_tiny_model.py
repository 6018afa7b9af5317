"""The built-in tiny model: character tokenizer, chat template, HF save/load round trip, builtin resolution."""

from __future__ import annotations

import string

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from verl.errors import ModelError
from verl.models.loader import builtin_names, load_causal_lm, load_tokenizer, resolve_model_path
from verl.models.tiny import (
    BOS,
    CHARACTERS,
    EOS,
    PAD,
    ROLE_TOKENS,
    TinySpec,
    build_char_tokenizer,
    build_tiny_model,
    count_parameters,
)

SMALL = TinySpec(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                 intermediate_size=64, max_position_embeddings=64)


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tokenizer):
    """A small model + tokenizer written with save_pretrained."""
    out = tmp_path_factory.mktemp("tiny")
    model = build_tiny_model(tokenizer, SMALL, seed=0)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out, model


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# ----------------------------------------------------------------------------------------------- tokenizer


def test_every_printable_character_round_trips_one_token_each(tokenizer):
    text = "".join(c for c in string.printable if c not in "\r\x0b\x0c")
    assert {"#", ">", "$", "\n", "\t", " "} <= set(text)
    encoded = ids(tokenizer, text)
    assert len(encoded) == len(text)
    assert tokenizer.unk_token_id not in encoded
    assert len(set(encoded)) == len(text)  # distinct characters, distinct ids
    assert tokenizer.decode(encoded) == text
    for char in "#>$ ":
        assert len(ids(tokenizer, char)) == 1 and tokenizer.decode(ids(tokenizer, char)) == char


@pytest.mark.parametrize("text", ["#### 1,234", ">> 357", "The answer is $72.", "What is 47+385?", "  a  b  "])
def test_task_strings_round_trip(tokenizer, text):
    assert tokenizer.decode(ids(tokenizer, text)) == text
    assert len(ids(tokenizer, text)) == len(text)


def test_special_tokens(tokenizer):
    assert tokenizer.pad_token == PAD and tokenizer.bos_token == BOS and tokenizer.eos_token == EOS
    special = {tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id}
    assert len(special) == 4
    assert tokenizer.padding_side == "left"
    assert len(tokenizer) == 4 + len(ROLE_TOKENS) + len(CHARACTERS)
    for token in [BOS, EOS, PAD, *ROLE_TOKENS]:
        assert len(ids(tokenizer, token)) == 1  # matched whole, never spelled out
    encoded = ids(tokenizer, "<|user|>hi</s>")
    assert encoded == [tokenizer.convert_tokens_to_ids("<|user|>"), *ids(tokenizer, "hi"), tokenizer.eos_token_id]
    assert tokenizer.decode(encoded, skip_special_tokens=True) == "hi"
    assert tokenizer.unk_token_id in ids(tokenizer, "é")  # outside the vocabulary


def test_chat_template(tokenizer):
    messages = [{"role": "user", "content": "What is 1+2?"}]
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == (
        "<s><|user|>What is 1+2?\n<|assistant|>"
    )
    conversation = [{"role": "system", "content": "Be brief."}, *messages, {"role": "assistant", "content": ">> 3"}]
    assert tokenizer.apply_chat_template(conversation, tokenize=False) == (
        "<s><|system|>Be brief.\n<|user|>What is 1+2?\n<|assistant|>>> 3</s>"
    )
    prompt_ids = ids(tokenizer, "<s><|user|>What is 1+2?\n<|assistant|>")
    assert prompt_ids[:2] == [tokenizer.bos_token_id, tokenizer.convert_tokens_to_ids("<|user|>")]
    assert len(prompt_ids) == len("What is 1+2?\n") + 3


# ----------------------------------------------------------------------------------------------- model


def test_tiny_model_matches_the_tokenizer_and_is_seeded(tokenizer):
    model = build_tiny_model(tokenizer, SMALL, seed=0)
    assert isinstance(model, LlamaForCausalLM)
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.bos_token_id == tokenizer.bos_token_id
    assert model.config.eos_token_id == tokenizer.eos_token_id
    assert model.config.pad_token_id == tokenizer.pad_token_id
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    same = build_tiny_model(tokenizer, SMALL, seed=0)
    other = build_tiny_model(tokenizer, SMALL, seed=1)
    for (name, p), q in zip(model.named_parameters(), same.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert not all(torch.equal(p, r) for p, r in zip(model.parameters(), other.parameters(), strict=True))
    # Building a model must not disturb the global RNG.
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(tokenizer, SMALL, seed=5)
    assert torch.equal(torch.rand(3), expected)
    # Embedding + lm_head, each vocab x hidden, dominate at this size.
    assert count_parameters(model) > 2 * len(tokenizer) * SMALL.hidden_size


def test_save_pretrained_and_auto_classes_round_trip(saved, tokenizer):
    out, model = saved
    assert (out / "chat_template.jinja").is_file() and (out / "model.safetensors").is_file()
    loaded_tok = AutoTokenizer.from_pretrained(out)
    text = "#### $1,234. >> 72"
    assert loaded_tok(text, add_special_tokens=False)["input_ids"] == ids(tokenizer, text)
    messages = [{"role": "user", "content": "What is 3+4?"}]
    assert loaded_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == (
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    )
    assert (loaded_tok.bos_token_id, loaded_tok.eos_token_id, loaded_tok.pad_token_id) == (
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
    )

    loaded = AutoModelForCausalLM.from_pretrained(out)
    batch = torch.tensor([ids(tokenizer, "<s><|user|>What is 3+4?\n<|assistant|>")])
    with torch.no_grad():
        torch.testing.assert_close(loaded(batch).logits, model(batch).logits, atol=0, rtol=0)
        generated = loaded.generate(batch, max_new_tokens=5, do_sample=False)
    assert generated.shape[0] == 1 and batch.shape[1] < generated.shape[1] <= batch.shape[1] + 5
    assert torch.equal(generated[:, : batch.shape[1]], batch)


def test_loader_functions_on_a_local_dir(saved):
    out, _ = saved
    assert resolve_model_path(str(out)) == str(out)
    tok = load_tokenizer(str(out))
    assert tok.padding_side == "left" and tok.pad_token_id is not None
    model = load_causal_lm(str(out), dtype="bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16


# ----------------------------------------------------------------------------------------------- builtin names


def test_unknown_builtin_lists_the_names():
    with pytest.raises(ModelError) as err:
        resolve_model_path("builtin:tiny-arithm")
    message = str(err.value)
    assert "unknown built-in model 'builtin:tiny-arithm'" in message
    for name in ("builtin:tiny-arith", "builtin:tiny-arith-base", "builtin:small-arith-base"):
        assert name in message
    assert builtin_names() == sorted(builtin_names()) and "tiny-arith" in builtin_names()


def test_bad_local_paths(tmp_path):
    with pytest.raises(ModelError, match="has no config.json"):
        resolve_model_path(str(tmp_path))
    with pytest.raises(ModelError, match="no such directory"):
        resolve_model_path(str(tmp_path / "missing"))
    with pytest.raises(ModelError, match="no such directory"):
        resolve_model_path("./no/such/model")


def test_builtin_base_is_built_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VERL_CACHE_DIR", str(tmp_path))
    path = resolve_model_path("builtin:tiny-arith-base")
    assert path == str(tmp_path / "models" / "tiny-arith-base")
    weights = tmp_path / "models" / "tiny-arith-base" / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert resolve_model_path("builtin:tiny-arith-base") == path
    assert weights.stat().st_mtime_ns == stamp  # reused, not rewritten
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.vocab_size == len(tok) and model.config.hidden_size == 128
    assert model.config.num_hidden_layers == 4


def test_shipped_warm_start_resolves_to_the_asset(warm_start_dir):
    assert warm_start_dir.endswith("tiny-arith")
    tok = AutoTokenizer.from_pretrained(warm_start_dir)
    assert tok.decode(tok("#### >> $", add_special_tokens=False)["input_ids"]) == "#### >> $"

"""Grouped-query models on the transformers engine: verl's CPU attention (``verl.models.attention``) gives
the same logits as transformers' ``sdpa`` and the engine's batched greedy decode the same tokens as ``generate``."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from serve.engines import create_engine
from serve.engines.base import EngineRequest, SamplingOptions
from serve.settings import load_settings
from verl.models.attention import NAME, use_cpu_attention
from verl.models.loader import load_tokenizer, resolve_model_path


@pytest.fixture(scope="module")
def gqa_model_dir(tmp_path_factory) -> Path:
    """A small random Llama with 4 query heads over 2 K/V heads, and the tiny model's tokenizer."""
    out = tmp_path_factory.mktemp("gqa")
    tokenizer = load_tokenizer(resolve_model_path("builtin:tiny-arith"))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_gqa_attention_is_identical_to_sdpa_with_padding(gqa_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(gqa_model_dir).eval()
    ids = torch.randint(3, 40, (4, 12))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[3, :7] = 0
    with torch.inference_mode():
        reference = model(input_ids=ids, attention_mask=mask).logits
        assert use_cpu_attention(model) and model.config._attn_implementation == NAME
        assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, reference)
    tiny = AutoModelForCausalLM.from_pretrained(resolve_model_path("builtin:tiny-arith")).eval()
    reference = tiny(input_ids=ids, attention_mask=mask).logits
    assert use_cpu_attention(tiny)  # no grouped heads: sdpa's own path (the decode kernel aside), the same logits
    assert torch.equal(tiny(input_ids=ids, attention_mask=mask).logits, reference)


def test_engine_greedy_on_a_gqa_model_matches_generate(gqa_model_dir: Path) -> None:
    settings = load_settings(model=str(gqa_model_dir), engine="transformers", max_batch_size=3)
    engine = create_engine(settings)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(engine.start())
    try:
        assert engine.model.config._attn_implementation == NAME
        prompts = [engine.tokenizer(p)["input_ids"] for p in ["12+30=", "7*", "abc def ghi", "1", "999+1="]]

        async def one(i: int, ids: list[int]) -> list[int]:
            await asyncio.sleep(0.01 * i)  # rows join a running batch of different lengths (a real padding mask)
            tokens = []
            async for out in engine.generate(EngineRequest(f"r{i}", ids, SamplingOptions(max_tokens=10,
                                                                                          temperature=0.0))):
                tokens += out.token_ids
            return tokens

        async def run_all():
            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

        results = loop.run_until_complete(run_all())
    finally:
        loop.run_until_complete(engine.shutdown(5))
        loop.close()
    reference = AutoModelForCausalLM.from_pretrained(gqa_model_dir).eval()  # plain transformers sdpa
    for ids, tokens in zip(prompts, results, strict=True):
        with torch.inference_mode():
            out = reference.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False,
                                     eos_token_id=engine.tokenizer.eos_token_id,
                                     pad_token_id=engine.tokenizer.pad_token_id)
        assert tokens == out[0, len(ids):].tolist()


def test_training_through_gqa_attention_matches_sdpa(gqa_model_dir: Path) -> None:
    """Loaded through load_causal_lm (trainer, eval, serving) on CPU, a GQA model uses the copy-free attention;
    the loss is identical to sdpa's and the gradients agree to float rounding."""
    from verl.models.loader import load_causal_lm

    ids = torch.randint(3, 40, (4, 12))
    mask = torch.ones_like(ids)
    mask[2, :5] = 0

    def loss_and_grads(model) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, attention_mask=mask).logits.logsumexp(-1).mean()
        loss.backward()
        return loss.detach(), [p.grad for p in model.parameters() if p.grad is not None]

    ours = load_causal_lm(str(gqa_model_dir))
    assert ours.config._attn_implementation == NAME
    reference = AutoModelForCausalLM.from_pretrained(gqa_model_dir)
    assert reference.config._attn_implementation == "sdpa"
    loss_a, grads_a = loss_and_grads(ours)
    loss_b, grads_b = loss_and_grads(reference)
    assert torch.equal(loss_a, loss_b)
    assert len(grads_a) == len(grads_b) and all(torch.allclose(a, b, atol=1e-6, rtol=1e-5)
                                                for a, b in zip(grads_a, grads_b, strict=True))

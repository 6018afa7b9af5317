"""The transformers rollout engine and the shared-prefix forward: exactness against the plain paths."""

from __future__ import annotations

import pytest
import torch

from verl.data.dataset import RLHFDataset
from verl.models.loader import load_causal_lm, load_tokenizer
from verl.rollout.base import SamplingParams
from verl.rollout.hf import HFRollout
from verl.workers.forward import response_log_probs, shared_prefix_group_size


@pytest.fixture(scope="module")
def parts():
    tokenizer = load_tokenizer("builtin:tiny-arith")
    model = load_causal_lm("builtin:tiny-arith")
    dataset = RLHFDataset(["builtin:arithmetic/val"], tokenizer)
    return model, tokenizer, dataset


def test_greedy_shared_prefill_equals_transformers_generate(parts):
    model, tokenizer, dataset = parts
    prompts = dataset.collate(list(range(32)))
    params = SamplingParams(n=3, temperature=0.0, max_new_tokens=16)
    ours = HFRollout(model, tokenizer, shared_prefill=True).generate(prompts, params)
    reference = HFRollout(model, tokenizer, shared_prefill=False).generate(prompts, params)
    assert torch.equal(ours.batch["responses"], reference.batch["responses"])
    assert torch.equal(ours.batch["response_mask"], reference.batch["response_mask"])


def test_sampling_is_seeded_and_leaves_global_rng_alone(parts):
    model, tokenizer, dataset = parts
    engine = HFRollout(model, tokenizer)
    prompts = dataset.collate(list(range(8)))
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=16, seed=7)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    first = engine.generate(prompts, params)
    assert torch.equal(torch.get_rng_state(), before)
    second = engine.generate(prompts, params)
    assert torch.equal(first.batch["responses"], second.batch["responses"])
    other = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=16, seed=8))
    assert not torch.equal(first.batch["responses"], other.batch["responses"])


def test_max_num_seqs_caps_the_rows_of_every_forward(parts):
    """``rollout.max_num_seqs`` (vLLM's decode width) on the single-turn engine: generate() calls of at most that
    many sequences (a prompt's n samples stay together), greedy tokens as one wide call gives them."""
    model, tokenizer, dataset = parts
    prompts = dataset.collate(list(range(8)))
    params = SamplingParams(n=3, temperature=0.0, max_new_tokens=12)
    rows = []
    hook = model.register_forward_pre_hook(lambda module, args, kwargs: rows.append(kwargs["input_ids"].shape[0]),
                                           with_kwargs=True)
    try:
        capped = HFRollout(model, tokenizer, max_num_seqs=7).generate(prompts, params)
    finally:
        hook.remove()
    wide = HFRollout(model, tokenizer).generate(prompts, params)
    assert max(rows) == 6 and len(capped) == 24  # two prompts x 3 samples per call: 7 would split a group
    assert torch.equal(capped.batch["responses"], wide.batch["responses"])


def test_top_k_one_sampling_is_greedy(parts):
    model, tokenizer, dataset = parts
    engine = HFRollout(model, tokenizer)
    prompts = dataset.collate(list(range(16)))
    greedy = engine.generate(prompts, SamplingParams(n=2, temperature=0.0, max_new_tokens=16))
    top1 = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, top_k=1, max_new_tokens=16, seed=1))
    assert torch.equal(greedy.batch["responses"], top1.batch["responses"])


def test_response_mask_stops_at_eos_and_layout(parts):
    model, tokenizer, dataset = parts
    out = HFRollout(model, tokenizer).generate(dataset.collate([0, 1, 2]), SamplingParams(n=2, max_new_tokens=16,
                                                                                       seed=0))
    responses, mask = out.batch["responses"], out.batch["response_mask"]
    assert len(out) == 6 and list(out.non_tensor["index"]) == [0, 0, 1, 1, 2, 2]
    for row, row_mask in zip(responses, mask, strict=True):
        length = int(row_mask.sum())
        eos_positions = (row == tokenizer.eos_token_id).nonzero().flatten().tolist()
        if eos_positions:  # stopped: the mask keeps everything up to and including the first eos
            assert length == eos_positions[0] + 1
        assert torch.all(row[length:] == tokenizer.pad_token_id)
    prompt_len = out.batch["prompts"].shape[1]
    assert torch.equal(out.batch["input_ids"][:, prompt_len:], responses)
    assert torch.equal(out.batch["attention_mask"][:, prompt_len:], mask)


def test_shared_prefix_forward_equals_plain_forward_and_gradients(parts):
    model, tokenizer, dataset = parts
    out = HFRollout(model, tokenizer).generate(dataset.collate(list(range(6))), SamplingParams(n=4, seed=3))
    batch = dict(out.batch)
    assert shared_prefix_group_size(batch, 4) == 4
    mask = batch["response_mask"].float()
    grads = []
    values = []
    for group in (1, 4):
        model.zero_grad()
        log_probs, entropy = response_log_probs(model, batch, temperature=0.7, with_entropy=True, group_size=group)
        (log_probs * mask).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        values.append((log_probs.detach(), entropy.detach()))
    model.zero_grad()
    torch.testing.assert_close(values[0][0] * mask, values[1][0] * mask, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(values[0][1] * mask, values[1][1] * mask, atol=1e-5, rtol=1e-5)
    for plain, shared in zip(*grads, strict=True):
        torch.testing.assert_close(plain, shared, atol=1e-4, rtol=1e-4)


def test_shared_prefix_falls_back_for_ungrouped_batches(parts):
    model, tokenizer, dataset = parts
    out = HFRollout(model, tokenizer).generate(dataset.collate(list(range(4))), SamplingParams(n=2, seed=3))
    batch = dict(out.batch)
    shuffled = {k: v[torch.tensor([0, 2, 1, 3, 4, 6, 5, 7])] for k, v in batch.items()}
    assert shared_prefix_group_size(shuffled, 2) == 1
    assert shared_prefix_group_size(batch, 3) == 1  # 8 rows do not split into groups of 3


def test_draw_categorical_samples_the_distribution_and_never_a_zero():
    from verl.rollout.sampler import draw_categorical

    probs = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0]]).repeat(40_000, 1) * 3.0  # unnormalised on purpose
    drawn = draw_categorical(probs, torch.Generator().manual_seed(0))
    counts = torch.bincount(drawn, minlength=6).double() / len(drawn)
    assert counts[[0, 2, 5]].sum() == 0
    # Each frequency within 4 standard errors of its probability (sd <= 0.0025 at 40,000 draws).
    torch.testing.assert_close(counts[[1, 3, 4]], torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64), atol=0.01,
                               rtol=0)
    again = draw_categorical(probs[:50], torch.Generator().manual_seed(0))
    assert torch.equal(again, drawn[:50])  # the same generator state, the same draws
    one_hot = torch.zeros(3, 49_152)
    one_hot[torch.arange(3), torch.tensor([0, 7, 49_151])] = 1.0  # the first and last entries are reachable
    assert draw_categorical(one_hot).tolist() == [0, 7, 49_151]
    with pytest.raises(ValueError, match="probability"):
        draw_categorical(torch.tensor([[float("nan"), 1.0]]))
    with pytest.raises(ValueError, match="probability"):
        draw_categorical(torch.zeros(1, 4))


@pytest.mark.parametrize("params", [SamplingParams(n=4, temperature=1.0, max_new_tokens=16, seed=5),
                                    SamplingParams(n=2, temperature=0.0, max_new_tokens=16)])
def test_dropping_finished_rows_changes_no_token(parts, monkeypatch, params):
    """Rows that reached eos leave the batch (and its KV cache); every row's draw is still taken, so the rollout is
    the one the full batch gives, log-probs included."""
    import verl.rollout.sampler as sampler

    model, tokenizer, dataset = parts
    prompts = dataset.collate(list(range(24)))
    params = SamplingParams(**{**params.__dict__, "logprobs": True})
    dropped = HFRollout(model, tokenizer).generate(prompts, params)
    lengths = dropped.batch["response_mask"].sum(-1)
    assert int(lengths.min()) < int(lengths.max())  # ragged: rows did leave early
    monkeypatch.setattr(sampler, "DROP_FINISHED_ROWS", False)
    kept = HFRollout(model, tokenizer).generate(prompts, params)
    assert torch.equal(dropped.batch["responses"], kept.batch["responses"])
    torch.testing.assert_close(dropped.batch["rollout_log_probs"], kept.batch["rollout_log_probs"], atol=1e-5,
                               rtol=1e-5)

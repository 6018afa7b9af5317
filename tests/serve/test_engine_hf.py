"""The transformers engine's continuous batching: same tokens as ``model.generate``, per-request stops and seeds."""

from __future__ import annotations

import asyncio

import pytest
import torch

from serve.engines import create_engine
from serve.engines.base import EngineRequest, SamplingOptions, StopChecker
from serve.settings import load_settings

PROMPTS = ["<|user|>What is 12+30?\n<|assistant|>", "7*", "<|user|>What is 999+1?\n<|assistant|>",
           "abc def", "<|user|>1+1\n<|assistant|>"]


@pytest.fixture(scope="module")
def engine_and_loop():
    """One started engine (batch of 3, so five prompts force queueing and rows joining a running batch)."""
    settings = load_settings(model="builtin:tiny-arith", engine="transformers", max_batch_size=3)
    engine = create_engine(settings)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(engine.start())
    yield engine, loop
    loop.run_until_complete(engine.shutdown(5))
    loop.close()


async def _collect(engine, rid: str, ids: list[int], sampling: SamplingOptions, delay: float = 0.0) -> dict:
    await asyncio.sleep(delay)
    text, tokens, last = [], [], None
    async for out in engine.generate(EngineRequest(rid, ids, sampling)):
        text.append(out.text)
        tokens += out.token_ids
        last = out
    return {"text": "".join(text), "tokens": tokens, "finish": last.finish_reason, "stop": last.stop_reason}


def generated_alone(engine, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """``model.generate``'s greedy ids for this prompt alone: what every batched answer must equal."""
    with torch.inference_mode():
        ref = engine.model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                    eos_token_id=engine.tokenizer.eos_token_id,
                                    pad_token_id=engine.tokenizer.pad_token_id)
    return ref[0, len(prompt_ids):].tolist()


def _run_all(engine, loop, prompts: list[list[int]], samplings: list[SamplingOptions], stagger: float = 0.0):
    async def main():
        return await asyncio.gather(*[_collect(engine, f"r{i}", p, s, i * stagger)
                                      for i, (p, s) in enumerate(zip(prompts, samplings, strict=True))])

    return loop.run_until_complete(main())


def test_greedy_batched_outputs_match_generate_one_by_one(engine_and_loop):
    engine, loop = engine_and_loop
    ids = [engine.tokenizer(p)["input_ids"] for p in PROMPTS]
    results = _run_all(engine, loop, ids, [SamplingOptions(max_tokens=12, temperature=0.0)] * len(ids), stagger=0.01)
    for prompt_ids, result in zip(ids, results, strict=True):
        expected = generated_alone(engine, prompt_ids, 12)
        assert result["tokens"] == expected
        assert result["text"] == engine.tokenizer.decode(expected, skip_special_tokens=True)
        assert result["finish"] == ("stop" if expected[-1] == engine.tokenizer.eos_token_id else "length")
    assert engine.num_running == 0 and engine.num_waiting == 0


def test_prompts_sharing_a_preamble_prefill_it_once_with_the_same_tokens(engine_and_loop):
    """Prompts starting with the same tokens (a chat template's system prompt) compute them once per prefill
    (``shared_prefix_tokens``); each row's greedy tokens are still ``generate``'s for that prompt alone."""
    engine, loop = engine_and_loop
    preamble = "<|user|>Add the two numbers and answer with digits only. "
    prompts = [f"{preamble}What is {a}+{b}?\n<|assistant|>" for a, b in ((12, 30), (7, 5), (999, 1))]
    ids = [engine.tokenizer(p)["input_ids"] for p in prompts]
    before = engine.shared_prefix_tokens
    results = _run_all(engine, loop, ids, [SamplingOptions(max_tokens=10, temperature=0.0)] * len(ids))
    shared = len(engine.tokenizer(preamble)["input_ids"])
    assert engine.shared_prefix_tokens - before >= shared  # at least two of them were prefilled together
    for prompt_ids, result in zip(ids, results, strict=True):
        assert result["tokens"] == generated_alone(engine, prompt_ids, 10)


def test_a_preamble_seen_before_is_not_computed_again_and_the_tokens_do_not_change(engine_and_loop):
    """Across prefills (``prefix_cache_entries``): prompts sent one after another, each prefilled alone, keep the
    preamble two of them shared and reuse it (the counter grows by the preamble per prompt after the second); each
    greedy answer is still ``generate``'s for that prompt alone, and control work (a weight update) empties it."""
    engine, loop = engine_and_loop
    preamble = "<|user|>Subtract the second number from the first and answer with digits only, please. "
    prompts = [f"{preamble}What is {a}-{b}?\n<|assistant|>" for a, b in ((50, 8), (71, 70), (300, 1), (9, 9))]
    ids = [engine.tokenizer(p)["input_ids"] for p in prompts]
    shared = len(engine.tokenizer(preamble)["input_ids"])
    engine.steps.prefixes.clear()
    counts, results = [], []
    for prompt_ids in ids:  # one at a time: no two in a prefill
        counts.append(engine.shared_prefix_tokens)
        results += _run_all(engine, loop, [prompt_ids], [SamplingOptions(max_tokens=10, temperature=0.0)])
    counts.append(engine.shared_prefix_tokens)
    grown = [b - a for a, b in zip(counts, counts[1:], strict=False)]
    assert grown[0] == grown[1] == 0 and all(g >= shared for g in grown[2:]), grown  # kept at the second, reused after
    assert len(engine.steps.prefixes.kept) == 1
    for prompt_ids, result in zip(ids, results, strict=True):
        assert result["tokens"] == generated_alone(engine, prompt_ids, 10)
    loop.run_until_complete(engine.resume())  # any control work (here: resume) clears what was kept
    assert not engine.steps.prefixes.kept


def test_seeded_sampling_is_reproducible_whatever_the_batch(engine_and_loop):
    engine, loop = engine_and_loop
    prompt = engine.tokenizer("abc")["input_ids"]
    seeded = SamplingOptions(max_tokens=20, temperature=1.0, seed=1234, ignore_eos=True)
    alone = _run_all(engine, loop, [prompt], [seeded])[0]
    crowd = _run_all(engine, loop, [prompt] * 3,
                     [SamplingOptions(max_tokens=20, temperature=1.0, ignore_eos=True), seeded,
                      SamplingOptions(max_tokens=5, temperature=0.7, top_p=0.5, ignore_eos=True)])
    assert crowd[1]["tokens"] == alone["tokens"]
    others = [_run_all(engine, loop, [prompt], [SamplingOptions(max_tokens=20, temperature=1.0, seed=s,
                                                                ignore_eos=True)])[0]["tokens"] for s in (1, 2, 3)]
    assert any(o != alone["tokens"] for o in others)  # different seeds explore different text


def test_top_k_one_and_vanishing_top_p_equal_greedy(engine_and_loop):
    engine, loop = engine_and_loop
    prompt = engine.tokenizer(PROMPTS[0])["input_ids"]
    # top_p=5e-324 was found by the schema fuzzer: it rounds to 0 in float32 and once made every probability NaN.
    greedy, top1, tiny_p = _run_all(engine, loop, [prompt] * 3,
                                    [SamplingOptions(max_tokens=10, temperature=0.0),
                                     SamplingOptions(max_tokens=10, temperature=1.5, top_k=1, seed=5),
                                     SamplingOptions(max_tokens=10, temperature=1.0, top_p=5e-324)])
    assert top1["tokens"] == greedy["tokens"] == tiny_p["tokens"]


def test_stop_strings_and_stop_token_ids(engine_and_loop):
    engine, loop = engine_and_loop
    prompt = engine.tokenizer("<|user|>What is 123+456?\n<|assistant|>")["input_ids"]
    full = _run_all(engine, loop, [prompt], [SamplingOptions(max_tokens=12, temperature=0.0, ignore_eos=True)])[0]
    text = full["text"]
    assert len(text) >= 3
    stop = text[1:3]
    by_string, by_token = _run_all(engine, loop, [prompt, prompt], [
        SamplingOptions(max_tokens=12, temperature=0.0, stop=[stop, "never-there"], ignore_eos=True),
        SamplingOptions(max_tokens=12, temperature=0.0, stop_token_ids=[full["tokens"][2]], ignore_eos=True),
    ])
    assert by_string["text"] == text[: text.index(stop)]
    assert (by_string["finish"], by_string["stop"]) == ("stop", stop)
    assert by_token["finish"] == "stop" and by_token["stop"] == full["tokens"][2]
    assert by_token["tokens"] == full["tokens"][: full["tokens"].index(full["tokens"][2]) + 1]


def test_closing_a_stream_aborts_the_sequence(engine_and_loop):
    engine, loop = engine_and_loop
    prompt = engine.tokenizer("abc")["input_ids"]

    async def main():
        stream = engine.generate(EngineRequest("gone", prompt, SamplingOptions(max_tokens=200, ignore_eos=True,
                                                                                temperature=0.0)))
        first = await stream.__anext__()
        await stream.aclose()
        for _ in range(200):
            if engine.num_running == 0:
                break
            await asyncio.sleep(0.01)
        return first

    first = loop.run_until_complete(main())
    assert first.num_generated_tokens == 1 and first.scheduled_time is not None
    assert engine.num_running == 0


def test_stop_checker_holds_back_partial_matches():
    decode = "".join
    checker = StopChecker(decode, ["END"])
    # The last len("END") - 1 characters are held back: they could be the start of a stop string.
    assert checker.update(list("abcE"), final=False) == ("ab", None)
    assert checker.update(list("abcEN"), final=False) == ("c", None)
    assert checker.update(list("abcENX"), final=False) == ("E", None)
    assert checker.update(list("abcENXEND!"), final=False) == ("NX", "END")
    plain = StopChecker(decode, [])
    assert plain.update(list("ab"), final=False) == ("ab", None)
    assert plain.update(list("ab\ufffd"), final=False) == ("", None)  # an incomplete UTF-8 character waits
    assert plain.update(list("abc"), final=True) == ("c", None)


def test_growing_cache_layer_matches_dynamic_layer_past_its_headroom():
    from transformers.cache_utils import DynamicLayer

    from verl.models.kv_cache import GrowingLayer as _GrowingLayer

    gen = torch.Generator().manual_seed(0)
    ours, ref = _GrowingLayer(), DynamicLayer()
    prefill = (torch.randn(3, 2, 5, 4, generator=gen), torch.randn(3, 2, 5, 4, generator=gen))
    for layer in (ours, ref):
        layer.update(*prefill)
    rows = 3
    for step in range(2 * _GrowingLayer.HEADROOM + 7):  # forces two reallocations
        kv = (torch.randn(rows, 2, 1, 4, generator=gen), torch.randn(rows, 2, 1, 4, generator=gen))
        got, want = ours.update(*kv), ref.update(*kv)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        if step == 30:  # rows leaving mid-way (what the batch does when a request finishes)
            index = torch.tensor([0, 2])
            ours.batch_select_indices(index)
            ref.batch_select_indices(index)
            rows = 2
    assert ours.get_seq_length() == ref.get_seq_length() == 5 + 2 * _GrowingLayer.HEADROOM + 7


def _collect_outputs(engine, loop, rid: str, ids: list[int], sampling: SamplingOptions, stream: bool) -> list:
    async def main():
        return [out async for out in engine.generate(EngineRequest(rid, ids, sampling, stream=stream))]

    return loop.run_until_complete(main())


@pytest.mark.parametrize("stream", [True, False])
def test_logprobs_equal_a_plain_forward_pass(engine_and_loop, stream):
    """Each generated token's log-prob and top-3, and the prompt's log-probs, against one full forward of
    prompt + response through the model (log_softmax of the raw logits, as vLLM's default reports them)."""
    engine, loop = engine_and_loop
    ids = engine.tokenizer(PROMPTS[2])["input_ids"]
    sampling = SamplingOptions(max_tokens=6, temperature=1.0, seed=5, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    outs = _collect_outputs(engine, loop, f"lp{stream}", ids, sampling, stream)
    generated = [t for out in outs for t in out.token_ids]
    entries = [e for out in outs for e in (out.logprobs or [])]
    assert len(generated) == len(entries) == 6 and [e.token_id for e in entries] == generated
    prompt_entries = outs[0].prompt_logprobs
    assert prompt_entries[0] is None and len(prompt_entries) == len(ids)
    assert all(out.prompt_logprobs is None for out in outs[1:])
    with torch.inference_mode():
        logits = engine.model(torch.tensor([ids + generated])).logits[0].float()
    expected = torch.log_softmax(logits, -1)
    for pos, entry in enumerate([*prompt_entries[1:], *entries]):  # position pos predicts token pos + 1
        row = expected[pos]
        assert entry.logprob == pytest.approx(row[entry.token_id].item(), abs=1e-4)
        want = len(entry.top)
        assert want == (2 if pos < len(ids) - 1 else 3)
        assert [i for i, _ in entry.top] == row.topk(want).indices.tolist()
        assert [v for _, v in entry.top] == pytest.approx(row.topk(want).values.tolist(), abs=1e-4)


def test_penalties_follow_their_definitions():
    from serve.engines.rows import apply_penalties as _apply_penalties

    row = torch.tensor([2.0, -1.0, 0.5, 3.0, 1.0])
    sampling = SamplingOptions(max_tokens=1, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    _apply_penalties(row, prompt=[0], generated=[2, 2, 3], sampling=sampling)
    # repetition over {0, 2, 3} (prompt + output): 2/2, 0.5/2, 3/2; token 1 unseen stays -1 (a negative logit of
    # a seen token would be multiplied); then output counts [0, 0, 2, 1, 0]: -0.5*count - 0.25*(count > 0).
    assert row.tolist() == pytest.approx([1.0, -1.0, 0.25 - 1.0 - 0.25, 1.5 - 0.5 - 0.25, 1.0])
    negative = torch.tensor([-2.0, 4.0])
    _apply_penalties(negative, prompt=[0, 1], generated=[], sampling=SamplingOptions(1, repetition_penalty=2.0))
    assert negative.tolist() == [-4.0, 2.0]


def test_penalized_greedy_decoding_equals_a_reference_loop(engine_and_loop):
    """Greedy with penalties through the batched engine == a step-by-step loop over full forwards applying the
    penalties written out here independently; and the penalties change the output."""
    engine, loop = engine_and_loop
    prompt = engine.tokenizer(PROMPTS[3])["input_ids"]
    options = {"repetition_penalty": 1.5, "frequency_penalty": 0.7, "presence_penalty": 0.3}
    sampling = SamplingOptions(max_tokens=10, temperature=0.0, ignore_eos=True, **options)
    [result] = _run_all(engine, loop, [prompt], [sampling])
    tokens: list[int] = []
    with torch.inference_mode():
        for _ in range(10):
            logits = engine.model(torch.tensor([prompt + tokens])).logits[0, -1].float().tolist()
            for t in set(prompt + tokens):
                logits[t] = logits[t] / 1.5 if logits[t] > 0 else logits[t] * 1.5
            for t in set(tokens):
                logits[t] -= 0.7 * tokens.count(t) + 0.3
            tokens.append(max(range(len(logits)), key=logits.__getitem__))
    assert result["tokens"] == tokens
    [plain] = _run_all(engine, loop, [prompt], [SamplingOptions(max_tokens=10, temperature=0.0, ignore_eos=True)])
    assert plain["tokens"] != tokens


def test_row_batch_rebuild_drops_and_joins_rows_in_one_pass():
    """``RowBatch.rebuild`` = keep some rows, then add new ones (a subset of a prefill), right-aligned, trimmed:
    each row's real columns land at the right end with their mask, padding is zero (finite) and masked."""
    from transformers import LlamaConfig

    from verl.models.kv_cache import Joining, RowBatch, new_growing_cache

    gen = torch.Generator().manual_seed(0)

    def cache_of(rows: int, width: int):
        cache = new_growing_cache(LlamaConfig(num_hidden_layers=2))
        for layer in cache.layers:
            keys, values = (torch.randn(rows, 2, width, 4, generator=gen) for _ in range(2))
            layer.set_state(keys, values)
        return cache

    batch = RowBatch()
    first, first_mask = cache_of(3, 6), torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6, [0, 0, 0, 0, 1, 1]])
    batch.add(["a", "b", "c"], first, first_mask, torch.tensor([7, 8, 9]))
    before = [(layer.keys.clone(), layer.values.clone()) for layer in batch.cache.layers]
    joining, joining_mask = cache_of(3, 8), torch.tensor([[1] * 8, [0, 0, 0, 1, 1, 1, 1, 1], [0] * 7 + [1]])
    new_keys = [layer.keys.clone() for layer in joining.layers]
    # Row "b" (the longest) leaves, so two columns become padding for every kept row and are trimmed; of the
    # prefill's three rows, only rows 1 and 2 join.
    batch.rebuild([0, 2], [Joining(["y", "z"], joining, joining_mask, torch.tensor([4, 5, 6]), [1, 2])])
    assert batch.rows == ["a", "c", "y", "z"] and batch.next_tokens.tolist() == [7, 9, 5, 6]
    assert batch.mask.tolist() == [[0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 1, 1],
                                   [0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0, 1]]
    for number, layer in enumerate(batch.cache.layers):
        assert layer.keys.shape == (4, 2, 8, 4)
        assert torch.equal(layer.keys[0, :, 4:], before[number][0][0, :, 2:])  # its 4 real columns, right-aligned
        assert torch.equal(layer.values[1, :, 4:], before[number][1][2, :, 2:])
        assert torch.equal(layer.keys[2:], new_keys[number][1:])
        assert torch.count_nonzero(layer.keys[:2, :, :2]) == 0  # the new padding columns are zeros, not garbage
    # Decoding appends in place after a rebuild (headroom), and keeping every row changes nothing.
    for layer in batch.cache.layers:
        layer.update(torch.ones(4, 2, 1, 4), torch.ones(4, 2, 1, 4))
        assert layer.keys.shape[2] == 9 and torch.equal(layer.keys[:, :, -1], torch.ones(4, 2, 4))
    batch.keep([0, 1, 2, 3])
    assert batch.rows == ["a", "c", "y", "z"]
    batch.keep([])
    assert len(batch) == 0 and batch.cache is None


def test_a_batch_that_outgrows_its_columns_keeps_its_spare_rows():
    """Decoding past the buffers' free columns reallocates them with as many rows as before, the rows' columns
    intact: the next rows to join still go into spare rows (reallocating to the rows in use left none, and the
    next join rebuilt the whole batch)."""
    from transformers import LlamaConfig

    from verl.models.kv_cache import Joining, RowBatch, new_growing_cache

    gen = torch.Generator().manual_seed(1)
    config = LlamaConfig(num_hidden_layers=2)

    def prefilled(count: int, width: int) -> Joining:
        cache = new_growing_cache(config)
        for layer in cache.layers:
            keys = torch.randn(count, 2, width, 4, generator=gen)
            layer.set_state(keys, keys + 1)
        return Joining(list(range(count)), cache, torch.ones(count, width, dtype=torch.long), torch.zeros(count))

    batch = RowBatch()
    batch.rebuild(None, [prefilled(3, 5)])
    batch.rebuild(None, [prefilled(5, 3)])  # a rebuild: buffers with a quarter spare rows
    layer = batch.cache.layers[0]
    spare, capacity, before = layer.spare_rows(), layer._kbuf.shape[2], layer.keys.clone()
    assert spare == 2
    steps = capacity - layer._len + 3  # past the free columns
    for _ in range(steps):
        new = torch.randn(len(batch), 2, 1, 4, generator=gen)
        for cache_layer in batch.cache.layers:
            cache_layer.update(new, new + 1)
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones(len(batch), 1)], dim=1)
    assert layer._kbuf.shape[2] > capacity and layer.spare_rows() == spare
    assert torch.equal(layer.keys[:, :, :before.shape[2]], before)
    buffer = layer._kbuf
    batch.rebuild(None, [prefilled(2, 4)])
    assert layer._kbuf is buffer and layer.spare_rows() == 0  # joined in place


def test_row_batch_keeps_every_rows_cache_through_leaves_joins_and_steps():
    """Rows leave (compacted in place: the last rows move into the holes), join (in place into spare rows when
    they fit, else a rebuild) and decode, in a random order of 80 operations:
    after each one every row's real columns hold exactly its own keys/values (tracked here row by row), in the
    order the mask says, the mask is as wide as the cache, and the padding is finite (attention weights it by
    zero; NaN garbage would poison it)."""
    import random

    from transformers import LlamaConfig

    from verl.models.kv_cache import Joining, RowBatch, new_growing_cache

    gen, pick = torch.Generator().manual_seed(0), random.Random(0)
    config = LlamaConfig(num_hidden_layers=2)
    expected: dict[str, list[torch.Tensor]] = {}  # row -> per layer, keys of its real columns (2, length, 4)
    batch, names, paths = RowBatch(), iter(f"r{i}" for i in range(10_000)), set()

    def join(count: int) -> None:
        lengths = [pick.randint(1, 9) for _ in range(count)]
        width = max(lengths)
        cache = new_growing_cache(config)
        mask = torch.tensor([[0] * (width - n) + [1] * n for n in lengths])
        rows = [next(names) for _ in range(count)]
        for layer in cache.layers:
            keys = torch.randn(count, 2, width, 4, generator=gen)
            layer.set_state(keys, keys + 1)
        for i, row in enumerate(rows):
            expected[row] = [layer.keys[i, :, width - lengths[i]:].clone() for layer in cache.layers]
        before = batch.cache.layers[0].spare_rows() if batch.cache is not None else -1
        batch.rebuild(None, [Joining(rows, cache, mask, torch.arange(count))])
        paths.add("in place" if before >= count and batch.cache.layers[0].spare_rows() == before - count else "rebuild")

    def poison() -> None:
        """What lies outside the rows and columns in use is garbage (``new_empty``): make it NaN."""
        for layer in batch.cache.layers if len(batch) else []:
            for buffer in (layer._kbuf, layer._vbuf):
                buffer[layer._rows:] = float("nan")
                buffer[:, :, :layer._start] = float("nan")
                buffer[:, :, layer._len:] = float("nan")

    def check() -> None:
        poison()
        assert batch.mask.shape == (len(batch), batch.cache.layers[0].keys.shape[2]) if len(batch) else True
        for number, layer in enumerate(batch.cache.layers if len(batch) else []):
            assert layer._rows == len(batch) and layer._len - layer._start == batch.mask.shape[1]
            assert torch.isfinite(layer.keys).all() and torch.isfinite(layer.values).all()
            for i, row in enumerate(batch.rows):
                real = batch.mask[i].bool()
                assert torch.equal(layer.keys[i][:, real], expected[row][number])
                assert torch.equal(layer.values[i][:, real], expected[row][number] + 1)

    join(6)
    for _ in range(80):
        action = pick.choice(["leave", "join", "step"])
        if action == "leave" and len(batch) > 1:
            keep = sorted(pick.sample(range(len(batch)), pick.randint(1, len(batch) - 1)))
            batch.keep(keep)
        elif action == "join" or not len(batch):
            join(pick.randint(1, 4))
        else:
            new = torch.randn(len(batch), 2, 1, 4, generator=gen)
            for layer_number, layer in enumerate(batch.cache.layers):
                layer.update(new, new + 1)
                for i, row in enumerate(batch.rows):
                    expected[row][layer_number] = torch.cat([expected[row][layer_number], new[i]], dim=1)
            batch.mask = torch.cat([batch.mask, batch.mask.new_ones(len(batch), 1)], dim=1)
        check()
    assert {"in place", "rebuild"} <= paths  # both ways of joining ran

"""Token exactness on a real pretrained model (issue 64): 100 training calls of SmolLM2-135M-Instruct through the
official ``openai`` client, with tools, assembled from the records: every sample's ids and log-probs are the ones
the engine sampled, and those are the policy's own log-probs of the ids (a plain HF forward) at temperature 1.
Measured alone here: ~2 min, most of it the 100 prefills of the tool prompt and the forward of the check."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import torch

from tests.model_fixtures import model_fixtures
from tests.serve.helpers import run_server
from tests.serve.test_gateway_trajectories import KEY, recorded
from verl.data.sources import resolve_data_file
from verl.rollout.recorded_episodes import episode_samples, samples_batch
from verl.tools.calculator import SCHEMA
from verl.workers.forward import response_log_probs

MODEL = "builtin:smollm2-135m-instruct"
tokenizer, model = model_fixtures(MODEL)


@pytest.mark.slow
@pytest.mark.budget(140)
def test_a_hundred_smollm2_calls_with_tools_are_token_exact(tmp_path, model, tokenizer):
    from concurrent.futures import ThreadPoolExecutor

    from openai import OpenAI

    records = tmp_path / "records.jsonl"
    rows = pq.read_table(resolve_data_file("builtin:tool_word_problems/val")).to_pylist()[:100]
    with run_server(model=MODEL, max_output_tokens=64, max_batch_size=16, max_queue_size=128, training_api_key=KEY,
                    training_max_slots_share=1.0, records_path=str(records)) as srv:
        client = OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)

        def call(i: int) -> None:
            client.chat.completions.create(model="smollm2-135m-instruct", messages=rows[i]["prompt"], tools=[SCHEMA],
                                           temperature=1.0, seed=i, max_tokens=24,
                                           extra_headers={"X-Session-ID": f"smol-{i}"})

        with ThreadPoolExecutor(16) as pool:
            list(pool.map(call, range(len(rows))))
        episodes = recorded(records, {f"smol-{i}" for i in range(len(rows))})
    assert len(episodes) == 100
    samples = [episode_samples(name, calls) for name, calls in episodes.items()]
    for s, calls in zip(samples, episodes.values(), strict=True):
        [t] = s.trajectories
        [c] = calls
        assert t.prompt_ids == c["prompt_ids"] and t.ids == c["token_ids"] and t.log_probs == c["logprobs"]
    assert sum(len(s.trajectories[0].ids) for s in samples) >= 100 * 10
    # The policy's own log-probs of the recorded ids, on a quarter of the samples (a forward of 100 tool prompts of
    # ~300 ids costs a minute here; the equality above is on all 100).
    batch = samples_batch(samples[:25], tokenizer.pad_token_id)
    with torch.no_grad():
        policy, _ = response_log_probs(model, dict(batch.batch))
    mask = batch.batch["response_mask"].bool()
    torch.testing.assert_close(policy[mask], batch.batch["rollout_log_probs"][mask], atol=2e-4, rtol=0)

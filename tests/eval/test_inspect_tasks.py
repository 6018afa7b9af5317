"""``verl eval --inspect-task``: Inspect tasks on a checkpoint through our service (eval/inspect_tasks.py).

Side by side with Inspect's own CLI (``inspect eval``) on the same task file and the same served models: the same
per-sample scores and metrics; a model-graded task (the grader a model we serve, at temperature 0) too (slow).
Then what ``verl compare`` makes of two checkpoints' Inspect results, and bad input.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("inspect_ai")

from eval.inspect_tasks import served  # noqa: E402
from eval.runner import run_eval  # noqa: E402
from eval.settings import EvalSettings  # noqa: E402
from tests.serve.helpers import REPO  # noqa: E402
from verl.errors import ConfigError  # noqa: E402

pytestmark = pytest.mark.e2e  # a real service and real Inspect runs: `make test-fast` skips it

MODEL_DIR = str(REPO / "verl" / "models" / "assets" / "tiny-arith")
TASKS = '''
from inspect_ai import Task, task
from inspect_ai.dataset import json_dataset
from inspect_ai.scorer import includes, match, model_graded_qa
from inspect_ai.solver import generate

DATA = {data!r}


@task
def sums():
    return Task(dataset=json_dataset(DATA), solver=[generate()], scorer=[includes(), match(numeric=True)])


@task
def graded():
    # A 135M grader rarely writes "GRADE: C"; a lone C or I (its usual answer) is the grade here.
    return Task(dataset=json_dataset(DATA, limit=4), solver=[generate()],
                scorer=model_graded_qa(grade_pattern=r"\\b([CI])\\b"))
'''


@pytest.fixture(scope="module")
def task_file(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("inspect")
    rows = [{"input": f"What is {10 + 7 * i}+{3 + 5 * i}?", "target": str(13 + 12 * i), "id": f"s{i}"}
            for i in range(12)]
    (root / "sums.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "tasks.py").write_text(TASKS.format(data=str(root / "sums.jsonl")))
    return root / "tasks.py"


def inspect_cli(spec: str, url: str, log_dir: Path, *flags: str) -> dict:
    """``inspect eval`` against the service: per (sample id, epoch), each scorer's value as Inspect's log has it."""
    from inspect_ai.log import list_eval_logs, read_eval_log
    from inspect_ai.scorer import value_to_float

    env = {**os.environ, "VERL_API_KEY": "none", "VERL_BASE_URL": f"{url}/v1"}
    subprocess.run([str(Path(sys.executable).with_name("inspect")), "eval", spec, "--model", "openai-api/verl/policy",
                    "--log-dir", str(log_dir), "--display", "none", *flags], env=env, check=True, timeout=600,
                   capture_output=True, text=True)
    [info] = list_eval_logs(str(log_dir))
    log = read_eval_log(info)
    to_float = value_to_float()
    def number(value) -> float | None:  # verl writes an unscored sample (NaN) as null
        value = float(to_float(value))
        return None if value != value else value

    scores = {(s.id, s.epoch): {k: number(v.value) for k, v in s.scores.items()} for s in log.samples}
    metrics = {(r.name, name): m.value for r in log.results.scores for name, m in r.metrics.items()}
    return {"scores": scores, "metrics": metrics}


def ours(out: Path) -> dict:
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    scores = {(r["prompt_id"].split(":")[2], r["sample"] + 1): {k.split("/")[-1]: v for k, v in r.items()
                                                                 if k.startswith("inspect/")} for r in rows}
    return {"scores": scores, "results": json.loads((out / "results.json").read_text())}


def test_verl_eval_scores_every_sample_as_inspects_own_cli(task_file, tmp_path):
    flags = ["--temperature", "0", "--max-tokens", "16", "--epochs", "2"]
    args = ["temperature=0", "max_tokens=16", "epochs=2"]
    with served(MODEL_DIR, None) as url:
        theirs = inspect_cli(f"{task_file}@sums", url, tmp_path / "cli", *flags)
        run_eval(MODEL_DIR, EvalSettings(inspect_tasks=[f"{task_file}@sums"], inspect_args=args, service=url,
                                         quiet=True), tmp_path / "running")
    run_eval(MODEL_DIR, EvalSettings(inspect_tasks=[f"{task_file}@sums"], inspect_args=args, quiet=True),
             tmp_path / "own")  # the service started by verl eval itself
    for out in ("running", "own"):
        mine = ours(tmp_path / out)
        assert mine["scores"] == theirs["scores"] and len(mine["scores"]) == 24  # 12 samples x 2 epochs
        metrics = mine["results"]["metrics"]
        for (scorer, name), value in theirs["metrics"].items():
            if name == "stderr":
                assert metrics[f"eval/inspect/sums/{scorer}/accuracy"]["inspect_stderr"] == value
                continue
            assert metrics[f"eval/inspect/sums/{scorer}/{name}"]["value"] == value, (scorer, name)
    accuracy = ours(tmp_path / "own")["results"]["metrics"]["eval/inspect/sums/includes/accuracy"]
    assert 0 < accuracy["value"] <= 1 and accuracy["method"] == "cluster"  # two epochs: clustered by sample
    assert accuracy["se"] == pytest.approx(accuracy["inspect_stderr"], rel=1e-9)  # the same SE, two ways


def test_compare_pairs_two_checkpoints_inspect_samples(task_file, tmp_path):
    from eval.compare import compare
    from tests.eval.test_lm_eval_tasks import perturbed_checkpoint

    args = ["temperature=0", "max_tokens=16"]
    noisy = perturbed_checkpoint(tmp_path / "noisy", scale=0.3)
    for name, ckpt in (("a", MODEL_DIR), ("b", str(noisy))):
        run_eval(ckpt, EvalSettings(inspect_tasks=[f"{task_file}@sums"], inspect_args=args, quiet=True),
                 tmp_path / name)
    report = compare([str(tmp_path / "a"), str(tmp_path / "b")], out=tmp_path / "cmp", n_boot=500, seed=0)
    row = report["comparisons"][0]["metrics"]["eval/inspect/sums/includes/accuracy"]
    a = {k: v["includes"] for k, v in ours(tmp_path / "a")["scores"].items()}
    b = {k: v["includes"] for k, v in ours(tmp_path / "b")["scores"].items()}
    assert row["n_prompts"] == 12 and row["diff"] == pytest.approx(sum(b.values()) / 12 - sum(a.values()) / 12)
    n01 = sum(1 for k in a if a[k] == 0 and b[k] == 1)
    n10 = sum(1 for k in a if a[k] == 1 and b[k] == 0)
    assert (row["mcnemar"]["n01"], row["mcnemar"]["n10"]) == (n01, n10) and n01 + n10 > 0


def test_bad_inspect_input_fails_in_one_line(task_file, tmp_path):
    cases = [
        (EvalSettings(inspect_tasks=[str(tmp_path / "missing.py@x")], quiet=True), "no such file"),
        (EvalSettings(inspect_tasks=[f"{task_file}@sums"], inspect_args=["shots=2"], quiet=True),
         "--inspect-arg shots: not an Inspect option"),
        (EvalSettings(inspect_tasks=[f"{task_file}@sums"], inspect_args=["epochs=two"], quiet=True), "epochs=two"),
    ]
    for settings, expected in cases:
        with pytest.raises(ConfigError) as info:
            run_eval(MODEL_DIR, settings, tmp_path / "out")
        assert expected in str(info.value) and "\n" not in str(info.value)


@pytest.mark.slow
@pytest.mark.budget(60)
def test_a_model_graded_task_gets_the_same_grades_as_inspects_cli(task_file, tmp_path):
    """model_graded_qa with SmolLM2-135M-Instruct as the grader (a model we serve; temperature 0 both ways)."""
    from verl.models.loader import resolve_model_path

    grader = resolve_model_path("builtin:smollm2-135m-instruct")
    flags = ["--temperature", "0", "--max-tokens", "16", "--model-role",
             "grader={model: openai-api/verl/grader, temperature: 0}"]
    with served(MODEL_DIR, grader) as url:
        theirs = inspect_cli(f"{task_file}@graded", url, tmp_path / "cli", *flags)
    run_eval(MODEL_DIR, EvalSettings(inspect_tasks=[f"{task_file}@graded"], inspect_grader=grader,
                                     inspect_args=["temperature=0", "max_tokens=16"], quiet=True), tmp_path / "own")
    mine = ours(tmp_path / "own")
    assert mine["scores"] == theirs["scores"] and len(mine["scores"]) == 4
    assert any(v["model_graded_qa"] is not None for v in mine["scores"].values())  # the grader graded
    value = mine["results"]["metrics"]["eval/inspect/graded/model_graded_qa/accuracy"]["value"]
    assert value == theirs["metrics"][("model_graded_qa", "accuracy")]

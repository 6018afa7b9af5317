"""`verl eval` and `verl compare` on reward models (eval/pairwise.py): a `verl rm` run's checkpoints scored on
held-out pairs, numbers equal to what the trainer logged and to transformers' own forward, the best by pairwise
accuracy, reuse, and paired statistics between two reward models."""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest
import torch
from rich.console import Console
from transformers import AutoModelForSequenceClassification

from eval.compare import compare
from eval.runner import EvalSettings, run_eval
from eval.watch import watch_run
from tests.trainer_utils import rows_by_step, run_cli
from verl.config import RMConfig, build_config
from verl.errors import ConfigError
from verl.models.loader import load_tokenizer
from verl.trainer.rm import RewardModelTrainer


def train(tmp_path, name: str, seed: int):
    config = build_config({"data": {"train_max_samples": 256, "val_max_samples": 48},
                           "optim": {"warmup_steps": 1},
                           "trainer": {"output_dir": str(tmp_path), "experiment_name": name, "total_steps": 6,
                                       "test_freq": 3, "save_freq": 3, "seed": seed,
                                       "logger": ["jsonl"]}}, schema=RMConfig)
    trainer = RewardModelTrainer(config, quiet=True)
    trainer.fit()
    return trainer.run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm-runs")
    return train(root, "a", 0), train(root, "b", 1)


def test_a_reward_model_run_is_scored_on_its_held_out_pairs_as_the_trainer_scored_them(runs):
    run_dir = runs[0]
    summary = run_eval(run_dir, EvalSettings(quiet=True))
    assert summary["kind"] == "reward_model" and summary["select"]["metric"] == "eval/pairwise_accuracy"
    logged = rows_by_step(run_dir, "eval")
    assert [c["step"] for c in summary["checkpoints"]] == [3, 6]
    for checkpoint in summary["checkpoints"]:
        metrics, trained = checkpoint["metrics"], logged[checkpoint["step"]]
        # The same 48 pairs, the same forward: the trainer's validation numbers, to float precision.
        assert metrics["eval/pairwise_accuracy"]["value"] == pytest.approx(trained["pairwise_accuracy"], abs=1e-6)
        assert metrics["eval/margin"]["value"] == pytest.approx(trained["margin"], rel=1e-4, abs=1e-5)
        assert metrics["eval/loss"]["value"] == pytest.approx(trained["loss"], rel=1e-4, abs=1e-5)
        assert metrics["eval/pairwise_accuracy"]["n"] == 48
    values = {c["label"]: c["metrics"]["eval/pairwise_accuracy"]["value"] for c in summary["checkpoints"]}
    best = json.loads((run_dir / "eval" / "best.json").read_text())
    assert values[best["label"]] == max(values.values())
    assert "reward model scored on 48 preference pairs" in (run_dir / "eval" / "report.md").read_text()


def test_each_pair_row_is_transformers_own_score_and_the_metrics_follow_from_the_rows(runs):
    out = runs[0] / "eval" / "global_step_6"
    run_eval(runs[0], EvalSettings(quiet=True))
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    results = json.loads((out / "results.json").read_text())
    tokenizer = load_tokenizer(str(runs[0] / "checkpoints" / "global_step_6"))
    model = AutoModelForSequenceClassification.from_pretrained(runs[0] / "checkpoints" / "global_step_6").eval()
    for row in samples[:4]:
        for side in ("chosen", "rejected"):
            ids = tokenizer(row["prompt"] + row[side], add_special_tokens=False, return_tensors="pt")
            with torch.no_grad():
                theirs = float(model(**ids).logits[0, 0])
            assert row[f"reward_{side}"] == pytest.approx(theirs, abs=1e-4)
    margins = np.array([r["reward_chosen"] - r["reward_rejected"] for r in samples])
    accuracy = results["metrics"]["eval/pairwise_accuracy"]
    assert accuracy["value"] == pytest.approx(float(np.mean(margins > 0)))
    p = accuracy["value"]
    assert accuracy["se"] == pytest.approx(math.sqrt(p * (1 - p) / (len(margins) - 1)), rel=1e-6)
    loss = float(np.mean(np.log1p(np.exp(-margins))))
    assert results["metrics"]["eval/loss"]["value"] == pytest.approx(loss, rel=1e-5)
    assert "Pairs ranked worst" in (out / "report.md").read_text()


def test_compare_two_reward_models_pairs_them_pair_by_pair(runs, tmp_path):
    report = compare([str(runs[0]), str(runs[1])], out=tmp_path / "cmp", settings=EvalSettings(quiet=True))
    entries = report["entries"]
    assert all("best by" in e["chosen"] for e in entries)
    pair = report["comparisons"][0]
    assert pair["num_prompts"] == 48
    accuracy = pair["metrics"]["eval/pairwise_accuracy"]
    assert accuracy["test"].startswith("McNemar") and accuracy["higher_is_better"] is True
    margin = pair["metrics"]["eval/margin"]
    assert margin["test"] == "paired bootstrap" and margin["ci_low"] <= margin["diff"] <= margin["ci_high"]
    assert [e["eval_accuracy"] for e in report["experiments"]] == [accuracy["baseline"], accuracy["candidate"]]
    assert [e["lr"] for e in report["experiments"]] == [1e-3, 1e-3]
    md = (tmp_path / "cmp" / "report.md").read_text()
    assert "| eval/pairwise_accuracy |" in md and "compare_curves.png" in md  # the runs' pairwise-accuracy curves


def test_generation_flags_on_a_reward_model_are_refused_in_one_line(runs, tmp_path):
    with pytest.raises(ConfigError, match=r"is a reward model.*--n, --temperature do not apply.*--data"):
        run_eval(runs[0], EvalSettings(n=4, temperature=1.0, quiet=True))
    done = run_cli(["eval", "--ckpt", str(runs[1]), "-e", "accuracy"])
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "-e do not apply" in " ".join(done.stderr.split())


def test_the_cli_on_other_pairs_keeps_the_runs_own_results_and_reuses_its_own(runs, tmp_path):
    checkpoint = runs[1] / "checkpoints" / "global_step_3"
    first = run_cli(["eval", "--ckpt", str(checkpoint), "--data", "builtin:arithmetic/pairs_val", "--max-samples",
                     "16"])
    assert first.returncode == 0, first.stderr
    said = " ".join(first.stderr.split())
    assert "16 pairs from builtin:arithmetic/pairs_val" in said and "pairwise_accuracy" in said
    results = list((runs[1] / "eval").glob("pairs-*/global_step_3/results.json"))
    assert len(results) == 1  # beside, not over, the run's own held-out evaluation
    console = Console(file=io.StringIO(), width=200)
    again = run_eval(checkpoint, EvalSettings(data=["builtin:arithmetic/pairs_val"], max_samples=16), console=console)
    assert "reusing" in console.file.getvalue() and again["created"] == json.loads(results[0].read_text())["created"]


def test_watch_on_a_reward_model_run_scores_its_checkpoints_and_writes_the_best(runs, tmp_path):
    watch_run(str(runs[1]), EvalSettings(quiet=True), tmp_path / "watched", None)
    best = json.loads((tmp_path / "watched" / "best.json").read_text())
    assert best["metric"] == "eval/pairwise_accuracy"
    assert sorted(p.name for p in (tmp_path / "watched").glob("global_step_*")) == ["global_step_3", "global_step_6"]

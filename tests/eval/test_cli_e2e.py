"""End to end through the real CLI: tiny `verl train` runs, `verl eval` on a checkpoint and a run dir,
`verl compare` on two runs that differ in lr, and on two evaluations of one checkpoint with the same seed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from verl.utils.log import read_jsonl

pytestmark = pytest.mark.e2e  # a real process, server, cluster or trainer run: `make test-fast` skips it

TINY = ["trainer.total_steps=2", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=2",
        "trainer.save_freq=1", "trainer.test_freq=1", "data.val_max_samples=16", "trainer.logger=[jsonl]",
        "trainer.num_threads=1"]


def cli(*args: str, ok: bool = True):
    from verl.cli import app, register_subcommands

    if not any(c.name == "eval" for c in app.registered_commands):
        register_subcommands()
    result = CliRunner().invoke(app, list(args))
    if ok:
        assert result.exit_code == 0, result.output + repr(result.exception)
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Two 2-step GRPO runs that differ only in the learning rate; validation runs extra plugin evaluators."""
    root = tmp_path_factory.mktemp("runs")
    out = {}
    for name, lr in (("a", "1e-4"), ("b", "3e-3")):
        cli("train", *TINY, f"trainer.output_dir={root}", f"trainer.experiment_name={name}",
            f"actor.optim.lr={lr}", "trainer.evaluators=[accuracy,length,diversity,kl]", "--quiet")
        out[name] = root / "verl" / name
    return out


def eval_rows(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_jsonl(run_dir / "verl_logs.jsonl") if r.get("scope") == "eval"}


def test_training_validation_runs_the_plugin_evaluators(runs):
    row = eval_rows(runs["a"])[2]
    # length and diversity came through the verl.evaluators entry points, next to the trainer's own numbers.
    for key in ("accuracy", "accuracy_flexible", "exact_match", "response_length_p90", "distinct_1", "self_bleu",
                "kl_exact", "kl_k3"):
        assert key in row
    # Before the first update the policy is the reference: the exact KL is zero; after two updates it is not.
    assert eval_rows(runs["a"])[0]["kl_exact"] == 0.0 and row["kl_exact"] > 0


def test_eval_checkpoint_matches_training_accuracy(runs):
    ckpt = runs["a"] / "checkpoints" / "global_step_2"
    cli("eval", "--ckpt", str(ckpt), "--quiet")
    out = runs["a"] / "eval" / "global_step_2"
    results = json.loads((out / "results.json").read_text())
    trained = eval_rows(runs["a"])[2]
    # Same greedy generation, same batches, same strict `>> N` rule: the very same numbers.
    assert results["metrics"]["eval/accuracy"]["value"] == trained["accuracy"]
    assert results["metrics"]["eval/accuracy_flexible"]["value"] == trained["accuracy_flexible"]
    assert results["metrics"]["eval/reward_mean"]["value"] == pytest.approx(trained["reward_mean"])
    assert results["metrics"]["eval/response_length_mean"]["value"] == pytest.approx(trained["response_length_mean"])
    for key in ("kl_exact", "kl_k1", "kl_k3", "kl_exact_per_token"):  # same forward passes, same reference
        assert results["metrics"][f"eval/{key}"]["value"] == pytest.approx(trained[key], rel=1e-5, abs=1e-7), key
    # Every metric carries an SE and a 95% CI; the run's initial model is the KL reference by default.
    assert results["reference"] == "builtin:tiny-arith" and results["metrics"]["eval/kl_exact"]["value"] >= 0
    for name, metric in results["metrics"].items():
        assert metric["ci_low"] is not None and metric["ci_high"] is not None, name
        assert metric["ci_low"] <= metric["value"] + 1e-12 <= metric["ci_high"] + 2e-12, name
    assert results["sampling"]["greedy"] and results["sampling"]["seed"] == 1
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 16 and {"prompt_id", "response", "ground_truth", "accuracy", "kl_exact"} <= set(samples[0])
    for name in ("report.md", "report.html", "length_hist.png", "reward_kl.png"):
        assert (out / name).stat().st_size > 0, name
    assert "| eval/accuracy |" in (out / "report.md").read_text()


def test_eval_run_dir_writes_table_and_best(runs, tmp_path):
    cli("eval", "--ckpt", str(runs["b"]), "--evaluators", "accuracy,length", "--select", "accuracy:max",
        "--out", str(tmp_path), "--quiet")
    best = json.loads((tmp_path / "best.json").read_text())
    summary = json.loads((tmp_path / "summary.json").read_text())
    values = {c["label"]: c["metrics"]["eval/accuracy"]["value"] for c in summary["checkpoints"]}
    assert set(values) == {"global_step_1", "global_step_2"}
    assert best["value"] == max(values.values()) and values[best["label"]] == best["value"]
    report = (tmp_path / "report.md").read_text()
    assert "global_step_1" in report and "global_step_2" in report and "best.json" in report
    assert (tmp_path / "metrics_vs_step.png").stat().st_size > 0


def test_eval_run_dir_without_accuracy_has_no_best_instead_of_failing(runs, tmp_path):
    """-e length on a run: every checkpoint evaluated and summarised; the default --select (accuracy) has nothing to
    rank, so no best.json and a line saying how to pick one — not an error after all the work."""
    result = cli("eval", "--ckpt", str(runs["b"]), "-e", "length", "--out", str(tmp_path))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["best"] is None and not (tmp_path / "best.json").exists()
    assert {c["label"] for c in summary["checkpoints"]} == {"global_step_1", "global_step_2"}
    assert "no best checkpoint: these evaluators give no eval/accuracy" in result.output
    assert "eval/response_length_mean" in summary["metrics_available"]
    assert "No best checkpoint" in (tmp_path / "report.md").read_text()
    bad = cli("eval", "--ckpt", str(runs["b"]), "-e", "length", "--select", "eval/kl_exact:min", "--out",
              str(tmp_path), ok=False)  # asked for by name: still an error, naming what there is
    assert bad.exit_code != 0 and "no metric 'eval/kl_exact'" in bad.output


def test_compare_two_runs_differing_in_lr(runs, tmp_path):
    cli("compare", str(runs["a"]), str(runs["b"]), "--ckpt", "latest", "--out", str(tmp_path), "--bootstrap", "300",
        "--quiet")
    report = json.loads((tmp_path / "compare.json").read_text())
    assert report["config_diff"] == {"actor.optim.lr": [0.0001, 0.003]}
    pair = report["comparisons"][0]
    assert pair["num_prompts"] == 16
    acc = pair["metrics"]["eval/accuracy"]
    assert acc["ci_low"] <= acc["diff"] <= acc["ci_high"] and "McNemar" in acc["test"]
    assert acc["verdict"] in ("better", "worse", "no significant difference")
    for row in pair["metrics"].values():
        assert 0.0 <= row["p_value"] <= 1.0, row["metric"]
    lrs = [row["lr"] for row in report["experiments"]]
    assert lrs == [0.0001, 0.003]
    md = (tmp_path / "report.md").read_text()
    assert "## Config diff" in md and "actor.optim.lr" in md and "95% CI (paired)" in md
    assert (tmp_path / "compare_curves.png").stat().st_size > 0


def test_same_checkpoint_same_seed_shows_no_difference(runs, tmp_path):
    ckpt = str(runs["a"] / "checkpoints" / "global_step_1")
    for name in ("first", "second"):
        cli("eval", "--ckpt", ckpt, "--n", "2", "--temperature", "1.0", "--seed", "5", "--evaluators",
            "accuracy,diversity,length", "--out", str(tmp_path / name), "--quiet")
    cli("compare", str(tmp_path / "first"), str(tmp_path / "second"), "--out", str(tmp_path / "cmp"), "--bootstrap",
        "200", "--quiet")
    pair = json.loads((tmp_path / "cmp" / "compare.json").read_text())["comparisons"][0]
    assert "eval/pass@2" in pair["metrics"] and "eval/distinct_1" in pair["metrics"]
    for row in pair["metrics"].values():
        assert row["diff"] == 0, row["metric"]
        assert row["verdict"] == "no significant difference", row["metric"]


def test_bad_inputs_give_one_line_errors(runs, tmp_path):
    result = cli("eval", "--ckpt", str(tmp_path / "nope"), ok=False)
    assert result.exit_code == 1 and "no such directory" in result.output and "Traceback" not in result.output
    result = cli("eval", "--ckpt", str(runs["a"]), "--evaluators", "accuracy,bleu", ok=False)
    assert result.exit_code == 1 and "evaluator 'bleu' is unknown; available: accuracy" in result.output
    result = cli("eval", "--ckpt", "builtin:tiny-arith", "--evaluators", "kl", ok=False)
    assert result.exit_code == 1 and "--reference" in result.output
    result = cli("compare", str(runs["a"]), ok=False)
    assert result.exit_code == 1 and "at least two" in result.output
    result = cli("compare", str(runs["a"]), str(runs["b"]), "--ckpt", "global_step_9", ok=False)
    assert result.exit_code == 1 and "no checkpoint global_step_9" in result.output
    result = cli("eval", "--ckpt", str(runs["a"]), "--select", "eval/nothing:max", "--evaluators", "length",
                 "--out", str(tmp_path / "x"), ok=False)
    assert result.exit_code == 1 and "no metric 'eval/nothing'" in result.output


def test_help_works_without_matplotlib():
    code = ("import sys; sys.modules['matplotlib'] = None; from verl.cli import main; sys.argv = ['verl', '--help']; "
            "main()")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "eval" in result.stdout and "compare" in result.stdout


def test_sampled_validation_matches_too(tmp_path):
    """With n = 2 sampled validation, the seeded sampling makes verl eval reproduce training's numbers as well."""
    cli("train", *TINY, "trainer.total_steps=1", f"trainer.output_dir={tmp_path}", "trainer.experiment_name=s",
        "rollout.val_kwargs.n=2", "rollout.val_kwargs.temperature=1.0", "data.val_max_samples=8", "--quiet")
    run = tmp_path / "verl" / "s"
    cli("eval", "--ckpt", str(run / "checkpoints" / "global_step_1"), "--evaluators", "accuracy", "--quiet")
    results = json.loads((run / "eval" / "global_step_1" / "results.json").read_text())
    trained = eval_rows(run)[1]
    assert results["sampling"]["n"] == 2 and results["sampling"]["temperature"] == 1.0
    assert results["data"]["num_samples"] == 16
    for key in ("accuracy", "accuracy_flexible", "pass@2", "maj@2"):
        assert results["metrics"][f"eval/{key}"]["value"] == trained[key], key
    assert results["metrics"]["eval/accuracy"]["method"] == "cluster"


def test_lora_checkpoint_is_merged_onto_its_base(tmp_path):
    cli("train", *TINY, "trainer.total_steps=1", f"trainer.output_dir={tmp_path}", "trainer.experiment_name=l",
        "model.lora.rank=4", "data.val_max_samples=8", "trainer.evaluators=[kl]", "--quiet")
    run = tmp_path / "verl" / "l"
    ckpt = run / "checkpoints" / "global_step_1"
    assert not (ckpt / "config.json").exists()  # adapter files only
    cli("eval", "--ckpt", str(ckpt), "--evaluators", "accuracy,length,kl", "--quiet")
    results = json.loads((run / "eval" / "global_step_1" / "results.json").read_text())
    trained = eval_rows(run)[1]
    assert results["metrics"]["eval/accuracy_flexible"]["value"] == trained["accuracy_flexible"]
    assert results["metrics"]["eval/response_length_mean"]["value"] == pytest.approx(trained["response_length_mean"])
    assert 0 <= results["metrics"]["eval/kl_exact"]["value"] < 0.1  # one small LoRA step from the base
    # In training the reference is the same module with its adapters disabled; verl eval loads the base model.
    assert results["metrics"]["eval/kl_exact"]["value"] == pytest.approx(trained["kl_exact"], rel=1e-4, abs=1e-7)
    assert eval_rows(run)[0]["kl_exact"] == 0.0


def test_results_are_kept_per_settings_and_best_never_mixes_them(runs, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(runs["a"], run, ignore=shutil.ignore_patterns("eval"))
    cli("eval", "--ckpt", str(run), "--evaluators", "accuracy", "--quiet")  # the run's own (greedy) settings
    greedy_results = (run / "eval" / "global_step_2" / "results.json").read_bytes()
    greedy_best = (run / "eval" / "best.json").read_bytes()
    best = json.loads(greedy_best)
    assert best["settings"]["run_defaults"] and best["settings"]["temperature"] == 0.0 and best["settings"]["n"] == 1

    # Sampled pass@k: its own directory; the greedy results, best.json and what export picks are untouched.
    result = cli("eval", "--ckpt", str(run), "--n", "2", "--temperature", "1.0", "--evaluators", "accuracy")
    tagged = [p for p in (run / "eval").iterdir() if p.is_dir() and p.name.startswith("t1-n2-")]
    assert len(tagged) == 1 and (tagged[0] / "global_step_2" / "results.json").is_file()
    sampled_best = json.loads((tagged[0] / "best.json").read_text())
    assert sampled_best["settings"] == {**sampled_best["settings"], "n": 2, "temperature": 1.0, "run_defaults": False}
    assert tagged[0].name in result.output and "rank by the run's validation settings only" in result.output
    assert (run / "eval" / "global_step_2" / "results.json").read_bytes() == greedy_results
    assert (run / "eval" / "best.json").read_bytes() == greedy_best
    exported = cli("export", "--run", str(run), "--select", "best", "--to", str(tmp_path / "exp"))
    assert best["label"] in exported.output


def test_prompts_dropped_by_length_are_counted_in_the_notes(runs, tmp_path):
    """A prompt over max_prompt_length is dropped (data.truncation=filter); eval says how many, and
    --max-prompt-length (a results setting: its own directory) keeps them."""
    ckpt = str(runs["a"] / "checkpoints" / "global_step_2")
    cli("eval", "--ckpt", ckpt, "--max-samples", "8", "--max-prompt-length", "18", "--out", str(tmp_path / "short"),
        "--evaluators", "accuracy", "--quiet")
    notes = json.loads((tmp_path / "short" / "results.json").read_text())["notes"]
    assert any("dropped: prompts longer than max_prompt_length=18" in note for note in notes), notes
    cli("eval", "--ckpt", ckpt, "--max-samples", "8", "--out", str(tmp_path / "all"), "--evaluators", "accuracy",
        "--quiet")
    assert not any("dropped" in n for n in json.loads((tmp_path / "all" / "results.json").read_text())["notes"])


def test_run_eval_spread_over_ray_workers_equals_the_local_executor(runs, tmp_path):
    """`verl eval --ckpt RUN --executor ray --workers 2`: each worker takes a checkpoint; every metric and every
    sample equals the local executor's (same seeds, batches and evaluators)."""
    common = ["--evaluators", "accuracy,length,diversity,kl", "--quiet"]
    cli("eval", "--ckpt", str(runs["a"]), "--out", str(tmp_path / "local"), *common)
    cli("eval", "--ckpt", str(runs["a"]), "--out", str(tmp_path / "ray"), "--executor", "ray", "--workers", "2",
        *common)
    local = json.loads((tmp_path / "local" / "summary.json").read_text())
    spread = json.loads((tmp_path / "ray" / "summary.json").read_text())
    assert [c["label"] for c in spread["checkpoints"]] == [c["label"] for c in local["checkpoints"]] == \
        ["global_step_1", "global_step_2"]
    for ours, theirs in zip(spread["checkpoints"], local["checkpoints"], strict=True):
        assert ours["metrics"] == theirs["metrics"], ours["label"]
        label = ours["label"]
        assert (tmp_path / "ray" / label / "samples.jsonl").read_text() == \
            (tmp_path / "local" / label / "samples.jsonl").read_text()
    assert json.loads((tmp_path / "ray" / "best.json").read_text())["label"] == \
        json.loads((tmp_path / "local" / "best.json").read_text())["label"]
    bad = cli("eval", "--ckpt", str(runs["a"]), "--executor", "slurm", ok=False)
    assert bad.exit_code != 0 and "--executor 'slurm' must be local or ray" in bad.output


def test_a_users_data_file_is_used_whole_and_caps_are_said(runs, tmp_path):
    """The run validated on 16 prompts (data.val_max_samples=16); that cap belongs to the run's own validation files.
    `verl eval --data FILE` scores all 40 rows of the user's file, --max-samples caps it, and the console line says
    how many of how many and why (as results.json's notes do)."""
    import pyarrow.parquet as pq

    from verl.data.sources import resolve_data_file

    rows = pq.read_table(resolve_data_file("builtin:arithmetic/val")).slice(0, 40)
    data = tmp_path / "mine.parquet"
    pq.write_table(rows, data)
    ckpt = str(runs["a"] / "checkpoints" / "global_step_2")
    whole = cli("eval", "--ckpt", ckpt, "--data", str(data), "--out", str(tmp_path / "whole"), "--evaluators",
                "accuracy")
    results = json.loads((tmp_path / "whole" / "results.json").read_text())
    assert results["data"]["num_prompts"] == 40 and results["data"]["max_samples"] is None
    assert "40 prompts," in whole.output and "capped" not in whole.output
    capped = cli("eval", "--ckpt", ckpt, "--data", str(data), "--max-samples", "25", "--out",
                 str(tmp_path / "capped"), "--evaluators", "accuracy")
    assert "25 of 40 prompts (capped at 25 by --max-samples" in capped.output, capped.output
    # Without --data, the run's own validation files keep the run's cap, and the line says whose it is.
    own = cli("eval", "--ckpt", ckpt, "--out", str(tmp_path / "own"), "--evaluators", "accuracy")
    assert "16 of " in own.output and "capped at 16 by the run's data.val_max_samples" in own.output, own.output
    notes = json.loads((tmp_path / "own" / "results.json").read_text())["notes"]
    assert any("capped by the run's data.val_max_samples" in note for note in notes), notes


def test_watch_evaluates_checkpoints_as_they_land_and_equals_a_later_eval(tmp_path):
    """`verl eval --ckpt RUN --watch`, started before the run exists: it evaluates each checkpoint while the trainer
    runs, exits when the run finishes (with summary.json and best.json), and every metric and sample equals a later
    `verl eval --ckpt RUN --force` of the same checkpoints."""
    root = tmp_path / "runs"
    run_dir = root / "verl" / "w"
    env_cmd = [sys.executable, "-m", "verl.cli"]
    watch = subprocess.Popen([*env_cmd, "eval", "--ckpt", str(run_dir), "--watch", "--evaluators", "accuracy,length"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        train = subprocess.run([*env_cmd, "train", *TINY, "trainer.total_steps=3", f"trainer.output_dir={root}",
                                "trainer.experiment_name=w", "trainer.test_freq=0", "--quiet"],
                               capture_output=True, text=True, timeout=300)
        assert train.returncode == 0, train.stderr[-3000:]
        output, _ = watch.communicate(timeout=300)
    finally:
        watch.kill()
    assert watch.returncode == 0, output[-3000:]
    assert "3 checkpoint(s) evaluated while it ran" in output and "best by eval/accuracy:max" in output
    watched = run_dir / "eval"
    assert json.loads((watched / "summary.json").read_text())["best"]["label"].startswith("global_step_")
    later = tmp_path / "later"
    cli("eval", "--ckpt", str(run_dir), "--evaluators", "accuracy,length", "--out", str(later), "--force", "--quiet")
    for step in (1, 2, 3):
        a = json.loads((watched / f"global_step_{step}" / "results.json").read_text())
        b = json.loads((later / f"global_step_{step}" / "results.json").read_text())
        assert a["metrics"] == b["metrics"] and a["model_hash"] == b["model_hash"]
        assert (watched / f"global_step_{step}" / "samples.jsonl").read_bytes() == (
            later / f"global_step_{step}" / "samples.jsonl").read_bytes()
    bad = cli("eval", "--ckpt", str(run_dir / "checkpoints" / "global_step_1"), "--watch", ok=False)
    assert bad.exit_code != 0 and "--watch follows a run directory" in bad.output


def test_eval_reads_an_sft_runs_config(tmp_path):
    """A `verl sft` run's checkpoint is evaluated on the run's own validation prompts, with one note that says it
    is an SFT run — not a wall of schema errors about the SFT config's keys (issue 42 item 7)."""
    cli("sft", "--config", "configs/sft_tiny.yaml", "trainer.total_steps=2", "trainer.test_freq=0",
        "data.val_max_samples=8", f"trainer.output_dir={tmp_path}", "trainer.experiment_name=s", "--quiet")
    run = tmp_path / "verl-sft" / "s"
    result = cli("eval", "--ckpt", str(run / "checkpoints" / "global_step_2"), "--out", str(tmp_path / "e"))
    assert "does not match the current schema" not in result.output
    assert "is a `verl sft` run" in " ".join(result.output.split())
    report = json.loads((tmp_path / "e" / "results.json").read_text())
    assert report["data"]["num_prompts"] == 8 and report["reference"] == "builtin:tiny-arith-base"  # the SFT run's

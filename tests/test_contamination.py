"""Contamination (docs/architecture.md §14): evaluation prompts the training data holds too — lm-evaluation-harness's
definition checked by hand, `verl eval` reporting the overlap and the clean-subset score on a deliberately
contaminated run (and `--strict` refusing), and `verl data decontaminate` removing the overlaps."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eval.runner import EvalSettings, run_eval
from tests.test_trainer import tiny_config
from tests.trainer_utils import run_cli
from verl.data.contamination import TrainingIndex, normalise, text_of
from verl.data.sources import resolve_data_file
from verl.errors import ConfigError
from verl.tracking.follow import row_kind
from verl.trainer.local import LocalPPOTrainer

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "while", "seven", "tired", "cats",
         "watch", "from", "a", "sunny", "wall"]


def test_the_definition_by_hand():
    assert normalise("Hello, World!\n  What's 2+2?") == ["hello", "world", "what", "s", "2", "2"]
    assert text_of([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Yo"}]) == "Hi\nYo"  # a task's instructions are not its items
    assert text_of('[{"role": "user", "content": "Hi"}]') == "Hi"
    train = " ".join(WORDS[:14])  # 14 words: two 13-grams
    index = TrainingIndex.of([train, "What is 12+7?"])
    assert index.overlap("WHAT is 12 + 7?") == "exact"  # case, punctuation and spacing do not matter
    assert index.overlap("What is 1+27?") is None  # punctuation breaks words: "1 27" is not "12 7"
    shifted = " ".join(["so", *WORDS[1:14], "indeed"])  # shares the 13-gram WORDS[1:14]
    assert index.overlap(shifted) == "13-gram"
    twelve = " ".join(["so", *WORDS[2:14], "indeed"])  # only 12 words in common: clean
    assert index.overlap(twelve) is None
    assert TrainingIndex.of([train], n=8).overlap(" ".join(WORDS[5:13])) == "8-gram"


def test_a_generated_tasks_wording_is_not_an_item():
    """An n-gram more than 5% of at least 20 training prompts hold is the template: 40 items "<k> <item words>
    then the 13-word tail" share the tail; an evaluation item with the tail and new words is clean, one sharing an
    item's 13 words is not, and with 19 prompts (fewer than 20) the tail still counts."""
    tail = " ".join(WORDS[:13])
    items = [f"item {k} " + " ".join(f"w{k}x{j}" for j in range(13)) + " " + tail for k in range(40)]
    index = TrainingIndex.of(items)
    assert index.template == 1  # the tail's one 13-gram (every other n-gram holds an item's own words)
    assert index.overlap("item 99 new words here " + tail) is None
    assert index.overlap("so " + " ".join(f"w3x{j}" for j in range(13))) == "13-gram"
    assert index.overlap(items[5].upper()) == "exact"
    assert TrainingIndex.of(items[:19]).overlap("item 99 new words here " + tail) == "13-gram"


def test_the_builtin_tasks_held_out_splits_share_no_prompt_with_training():
    """The task draws train, val and test problems disjoint; the check must agree (with punctuation deleted, as
    lm-evaluation-harness does, "47+385" and "473+85" were one word and a third of val looked contaminated)."""
    index = TrainingIndex.of(text_of(r["prompt"]) for r in pq.read_table(
        resolve_data_file("builtin:arithmetic/train")).to_pylist())
    for split in ("val", "test"):
        rows = pq.read_table(resolve_data_file(f"builtin:arithmetic/{split}")).to_pylist()
        assert index.overlaps([text_of(r["prompt"]) for r in rows]) == [None] * len(rows), split


@pytest.fixture(scope="module")
def contaminated_run(tmp_path_factory):
    """One training step on a file that holds the first 8 validation prompts beside 56 training ones."""
    root = tmp_path_factory.mktemp("contaminated")
    val = pq.read_table(resolve_data_file("builtin:arithmetic/val")).to_pylist()
    train = pq.read_table(resolve_data_file("builtin:arithmetic/train")).to_pylist()
    path = root / "train.parquet"
    pq.write_table(pa.Table.from_pylist(val[:8] + train[:56]), path)
    trainer = LocalPPOTrainer(tiny_config(root, data={"train_files": [str(path)], "val_max_samples": 16},
                                          trainer={"test_freq": 1}), quiet=True)
    trainer.fit()
    return trainer.run_dir, path


def test_training_validation_logs_the_overlap_and_the_clean_subset_and_strict_refuses(contaminated_run, tmp_path):
    run_dir, path = contaminated_run
    rows = [json.loads(line) for line in (run_dir / "verl_logs.jsonl").read_text().splitlines()]
    [info] = [r for r in rows if r["scope"] == "contamination"]
    assert (info["checked"], info["overlapping"], info["exact"], info["level"]) == (256, 8, 8, "WARNING")
    assert row_kind(info) == "other" and row_kind({**info, "level": "INFO"}) == "event"  # never a tracker's curve
    assert "data.contamination=strict refuses" in info["message"]
    evals = [r for r in rows if r["scope"] == "eval"]
    assert evals
    for row in evals:  # validated: the first 16 prompts, 8 of them the training data's
        assert row["clean/num_samples"] == 8 and row["clean/overlapping_prompts"] == 8
        assert 0 <= row["clean/accuracy"] <= 1
    # The last validation is the last checkpoint's: verl eval's clean subset on the same prompts agrees.
    checkpoint = sorted((run_dir / "checkpoints").glob("global_step_*"))[-1]
    results = run_eval(checkpoint, EvalSettings(quiet=True), out=tmp_path / "eval")
    assert evals[-1]["step"] == int(checkpoint.name.split("_")[-1])
    assert evals[-1]["clean/accuracy"] == pytest.approx(results["contamination"]["clean"]["eval/accuracy"]["value"])
    assert evals[-1]["accuracy"] == pytest.approx(results["metrics"]["eval/accuracy"]["value"])
    with pytest.raises(ConfigError, match=r"data.contamination=strict: 8 of 256 validation prompts .*decontaminate"):
        LocalPPOTrainer(tiny_config(tmp_path, data={"train_files": [str(path)], "contamination": "strict"}),
                        quiet=True)
    assert not (tmp_path / "verl").exists()  # refused before the run directory was made


def test_eval_reports_the_overlap_and_the_clean_subset_and_strict_refuses(contaminated_run, tmp_path):
    run_dir, _ = contaminated_run
    checkpoint = sorted((run_dir / "checkpoints").glob("global_step_*"))[-1]
    results = run_eval(checkpoint, EvalSettings(quiet=True), out=tmp_path / "eval")
    info = results["contamination"]
    assert (info["checked"], info["overlapping"], info["exact"], info["ngram"]) == (16, 8, 8, 0)
    samples = [json.loads(line) for line in (tmp_path / "eval" / "samples.jsonl").read_text().splitlines()]
    assert [row["contaminated"] for row in samples] == ["exact"] * 8 + [None] * 8
    clean = [row["accuracy"] for row in samples[8:]]
    assert info["clean"]["eval/accuracy"] == {"value": pytest.approx(sum(clean) / 8), "n": 8}
    report = (tmp_path / "eval" / "report.md").read_text()
    assert "Contamination: 8 of 16 prompts overlap the training data (8 exactly" in report
    with pytest.raises(ConfigError, match=r"--strict: 8 of 16 evaluation prompts overlap .*verl data decontaminate"):
        run_eval(checkpoint, EvalSettings(quiet=True, strict=True, force=True), out=tmp_path / "strict")
    assert not (tmp_path / "strict" / "results.json").exists()


def test_decontaminate_removes_the_overlapping_training_rows(contaminated_run, tmp_path):
    _, path = contaminated_run
    out = tmp_path / "clean.parquet"
    done = run_cli(["data", "decontaminate", str(path), "--against", "builtin:arithmetic/val", "--out", str(out)])
    assert done.returncode == 0, done.stderr
    assert "64 training rows: 8 overlap" in " ".join(done.stderr.split())
    kept = pq.read_table(out).to_pylist()
    assert len(kept) == 56 and not any(k.startswith("__") for k in kept[0])
    again = TrainingIndex.of([text_of(r["prompt"]) for r in kept])
    val = pq.read_table(resolve_data_file("builtin:arithmetic/val")).to_pylist()
    assert all(again.overlap(text_of(r["prompt"])) is None for r in val[:16])


def test_ship_strict_refuses_gate_prompts_that_overlap_the_training_data(contaminated_run, tmp_path):
    from eval.ship.run import ShipSettings, offline_gates

    run_dir, _ = contaminated_run
    checkpoint = sorted((run_dir / "checkpoints").glob("global_step_*"))[-1]
    shipping = {"candidate": {"run": str(run_dir), "checkpoint": str(checkpoint), "step": 1},
                "gates": {"gate_data": {"judged_by": ["builtin:arithmetic/val"]}},
                "incumbent": {"kind": "model", "source": "builtin:tiny-arith"}}
    (gate,) = offline_gates(ShipSettings(run=str(run_dir), service="http://unused", strict=True, max_samples=16),
                            shipping, tmp_path)
    assert gate.name == "contamination" and not gate.passed
    assert gate.reason.startswith("--strict: 8 of 16 gate prompts overlap") and gate.evidence["exact"] == 8


def test_compare_reports_the_clean_prompts_beside_the_whole(contaminated_run, tmp_path):
    from eval.compare import compare

    run_dir, _ = contaminated_run
    checkpoint = sorted((run_dir / "checkpoints").glob("global_step_*"))[-1]
    run_eval(checkpoint, EvalSettings(quiet=True), out=tmp_path / "a")
    run_eval("builtin:tiny-arith", EvalSettings(quiet=True, data=["builtin:arithmetic/val"], max_samples=16),
             out=tmp_path / "b")  # no run: nothing to check it against
    report = compare([str(tmp_path / "b"), str(tmp_path / "a")], out=tmp_path / "cmp",
                     settings=EvalSettings(quiet=True))
    pair = report["comparisons"][0]
    assert pair["num_prompts"] == 16 and pair["contaminated_prompts"] == 8
    samples = {json.loads(line)["prompt_id"]: json.loads(line) for line in
               (tmp_path / "a" / "samples.jsonl").read_text().splitlines()}
    clean = [r["accuracy"] for r in samples.values() if not r["contaminated"]]
    assert pair["metrics"]["eval/accuracy"]["clean"]["candidate"] == pytest.approx(sum(clean) / len(clean))
    assert pair["metrics"]["eval/accuracy"]["clean"]["n_prompts"] == 8
    assert "On the clean prompts alone" in (tmp_path / "cmp" / "report.md").read_text()


def test_an_sft_run_is_checked_against_its_own_training_data_and_no_data_is_said(tmp_path):
    """A `verl sft` run's config becomes a run config with its train_files (the agent's cold start was once checked
    against the config default instead); with no run, the results say nothing was checked."""
    import yaml

    from eval.contamination import line, not_checked
    from eval.runner import load_run_config
    from verl.config import SFTConfig

    sft = SFTConfig()
    sft.data.train_files = ["builtin:word_problems/train"]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(sft.model_dump(mode="json")))
    run_cfg, _, notes = load_run_config(tmp_path)
    assert run_cfg.data.train_files == ["builtin:word_problems/train"] and "verl sft" in notes[0]
    assert line(not_checked("no training data is known for this run")) == (
        "Contamination: not checked (no training data is known for this run).")

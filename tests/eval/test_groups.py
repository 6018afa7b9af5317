"""Metrics per group of prompts (``verl eval --group-by``): the numbers by hand, then the real CLI on the shipped
tool-using warm start over the six kinds of word problems, regrouped from disk without generating again."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from eval.runner import EvalSettings, run_eval
from tests.eval.test_cli_e2e import cli
from tests.test_trainer import tiny_config
from verl.config import VerlConfig
from verl.data.sources import resolve_data_file
from verl.errors import ConfigError
from verl.evaluators import build_evaluator
from verl.evaluators.base import corpus_metrics
from verl.evaluators.groups import MISSING, group_labels, metric_key_part, metrics_by_group
from verl.evaluators.stats import mean_metric
from verl.protocol import DataProto
from verl.trainer import validation
from verl.trainer.local import LocalPPOTrainer


def test_group_means_and_corpus_metrics_by_hand():
    # Two prompts per group, two samples per prompt (clustered SE by prompt, as for the whole).
    groups = ["b", "b", "b", "b", "a", "a", "a", "a"]
    prompt = np.array([0, 0, 1, 1, 2, 2, 3, 3])
    correct = np.array([1, 1, 0, 1, 0, 0, 0, 1], dtype=float)
    lengths = np.array([10, 20, 30, 40, 1, 2, 3, 4], dtype=float)
    whole = {"accuracy": mean_metric(correct, prompt, aggregate="mean", column="accuracy", binary=True,
                                     higher_is_better=True, evaluator="accuracy")}
    length = build_evaluator("length")
    whole.update(corpus_metrics(length, ["x"] * 8, {"response_length": lengths}, prompt, 0, 0))
    out = metrics_by_group(groups, whole, {"accuracy": correct, "response_length": lengths}, ["x"] * 8, prompt,
                           {"length": length}, n_bootstrap=0, seed=0)
    assert list(out) == ["a", "b"]
    # Group b: prompt means 1.0 and 0.5 -> mean 0.75; clustered SE sqrt(C/(C-1) * sum_c (sum_i (x_i - mean))^2) / N
    # = sqrt(2 * ((0.25 + 0.25)^2 + (-0.75 + 0.25)^2)) / 4 = sqrt(2 * 0.5) / 4 = 0.25.
    b = out["b"]["accuracy"]
    assert b.value == pytest.approx(0.75) and b.se == pytest.approx(0.25) and b.n == 4
    assert (b.ci_low, b.ci_high) == pytest.approx((0.75 - 1.96 * 0.25, 1.0))  # clipped at 1 (a proportion)
    assert out["a"]["accuracy"].value == pytest.approx(0.25)
    # Corpus metrics per group: numpy's linear-rule median of each group's lengths.
    assert out["b"]["response_length_p50"].value == pytest.approx(25.0)
    assert out["a"]["response_length_p50"].value == pytest.approx(2.5)
    assert out["a"]["response_length_p50"].aggregate == "corpus"


def test_group_labels_and_names():
    rows = [{"extra_info": {"kind": "add"}}, {"extra_info": {"kind": 2.0}}, {"extra_info": {}}]
    assert group_labels(rows, "extra_info.kind", "--group-by") == ["add", "2", MISSING]
    with pytest.raises(ConfigError, match=r"no row of the data has the column 'extra_info\.level'.*extra_info\.kind"):
        group_labels(rows, "extra_info.level", "--group-by extra_info.level")
    assert metric_key_part("two steps/x") == "two_steps_x"
    groups = metrics_by_group(["10", "2", MISSING], {}, {}, ["a", "b", "c"], np.arange(3), {}, 0, 0)
    assert list(groups) == ["2", "10", MISSING]  # numbers in order, the missing group last


def test_training_validation_logs_every_metric_per_group():
    """data.val_group_by in the trainer's validation: eval/<column leaf>/<group>/<metric> beside the whole."""
    cfg = VerlConfig()
    cfg.trainer.evaluators = ["accuracy", "length"]
    evaluators = validation.build_validation_evaluators(cfg)
    # Three prompts (rows 0, 1, 2 of the validation data), two responses each; rows 0 and 2 are "add".
    batch = DataProto.from_dict(
        {"response_mask": torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1]])},
        {"index": [0, 0, 1, 1, 2, 2], "raw_prompt": ["p"] * 6, "ground_truth": ["4"] * 6,
         "data_source": ["arithmetic"] * 6})
    scores = np.array([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    extras = {"acc": scores.copy()}
    texts = ["4", "5", "1", "2", "4", "4"]
    evaluated, columns = validation.run_validation_evaluators(cfg, evaluators, batch, texts, scores, extras,
                                                              kl_terms=None)
    out = validation.grouped_validation_metrics("extra_info.kind", ["add", "two steps", "add"], batch, texts, scores,
                                                extras, evaluated, columns, evaluators)
    assert out["kind/add/num_samples"] == 4 and out["kind/two_steps/num_samples"] == 2
    assert out["kind/add/accuracy"] == pytest.approx(0.75) and out["kind/two_steps/accuracy"] == 0.0
    assert out["kind/add/reward_mean"] == pytest.approx(0.75)
    assert out["kind/add/response_length_mean"] == pytest.approx((2 + 3 + 3 + 3) / 4)
    assert out["kind/two_steps/response_length_p50"] == pytest.approx(1.0)  # the length evaluator's corpus metric
    # auto groups only data with extra_info.kind; an explicit column no row has is refused before the run.
    val = SimpleNamespace(rows=[{"extra_info": {"kind": "add"}}, {"extra_info": {"kind": "times"}}])
    assert validation.validation_group_labels(cfg, val) == ("extra_info.kind", ["add", "times"])
    assert validation.validation_group_labels(cfg, SimpleNamespace(rows=[{"extra_info": {}}])) is None
    cfg.data.val_group_by = "extra_info.level"
    with pytest.raises(ConfigError, match=r"data.val_group_by .*no row of the data has the column 'extra_info.level'"):
        validation.validation_group_labels(cfg, val)
    cfg.data.val_group_by = None
    assert validation.validation_group_labels(cfg, val) is None


@pytest.fixture(scope="module")
def grouped(tmp_path_factory):
    out = tmp_path_factory.mktemp("grouped")
    common = ["--ckpt", "builtin:tiny-agent", "--data", "builtin:tool_word_problems/val", "--tools", "calculator",
              "--max-samples", "12", "--max-prompt-length", "400", "--max-new-tokens", "48", "--n", "2",
              "--temperature", "1.0", "--seed", "5", "-e", "accuracy,length,diversity", "--out", str(out)]
    first = cli("eval", *common, "--group-by", "extra_info.kind")
    again = cli("eval", *common, "--group-by", "data_source")
    return out, common, first, again


@pytest.mark.e2e
def test_eval_reports_every_metric_per_kind(grouped):
    out, _, first, _ = grouped
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    results = json.loads((out / "results.json").read_text())
    # The second call regrouped the results on disk by data_source (one group: the whole), reusing the generations.
    assert results["groups"]["by"] == "data_source"
    (source, entry), = results["groups"]["values"].items()
    assert entry["num_samples"] == 24 and entry["num_prompts"] == 12
    for name, metric in entry["metrics"].items():
        whole = results["metrics"][name]
        assert metric["value"] == pytest.approx(whole["value"], nan_ok=True), name
    # The first call's per-kind lines: six kinds, two prompts each (the validation split interleaves them).
    lines = [line.strip() for line in first.output.splitlines() if line.strip().startswith("extra_info.kind=")]
    assert len(lines) == 6 and all("(2 prompts)" in line for line in lines), first.output
    kinds = {s["index"]: None for s in samples}
    assert len(kinds) == 12


@pytest.mark.e2e
def test_grouped_numbers_match_the_samples(grouped, tmp_path):
    out, common, _, again = grouped
    assert "reusing" in again.output
    cli("eval", *common, "--group-by", "extra_info.kind")  # back to kinds, again from disk
    results = json.loads((out / "results.json").read_text())
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    kinds = [row["extra_info"]["kind"] for row in pq.read_table(resolve_data_file("builtin:tool_word_problems/val"))
             .to_pylist()]
    values = results["groups"]["values"]
    assert set(values) == {"add", "take", "times", "share", "groups", "two_steps"}
    for kind, entry in values.items():
        mine = [s for s in samples if kinds[s["index"]] == kind]
        assert entry["num_samples"] == len(mine) == 4
        accuracy = entry["metrics"]["eval/accuracy"]
        assert accuracy["value"] == pytest.approx(np.mean([s["accuracy"] for s in mine]))
        length = entry["metrics"]["eval/response_length_mean"]
        assert length["value"] == pytest.approx(np.mean([s["response_length"] for s in mine]))
        assert length["ci_low"] <= length["value"] <= length["ci_high"]
        distinct = entry["metrics"]["eval/distinct_1"]
        assert distinct["aggregate"] == "corpus" and not math.isnan(distinct["value"])
    report = (out / "report.md").read_text()
    assert "## Per extra_info.kind" in report and "| two_steps | 2 | 4 |" in report
    bad = cli("eval", *common, "--group-by", "extra_info.level", ok=False)
    assert bad.exit_code != 0 and "no row of the data has the column 'extra_info.level'" in bad.output
    assert "extra_info.kind" in bad.output and "Traceback" not in bad.output


@pytest.mark.e2e
def test_training_validation_per_kind_equals_verl_eval_per_kind(tmp_path):
    """A run whose validation data has extra_info.kind logs every metric per kind (data.val_group_by: auto), and
    verl eval --group-by on its last checkpoint gives the same per-kind numbers."""
    val = pq.read_table(resolve_data_file("builtin:arithmetic/val")).to_pylist()[:16]
    for i, row in enumerate(val):
        row["extra_info"] = {**row["extra_info"], "kind": "even" if i % 2 == 0 else "odd"}
    path = tmp_path / "val.parquet"
    pq.write_table(pa.Table.from_pylist(val), path)
    config = tiny_config(tmp_path, data={"val_files": [str(path)], "val_max_samples": 16}, trainer={"test_freq": 1})
    trainer = LocalPPOTrainer(config, quiet=True)
    trainer.fit()
    rows = [json.loads(line) for line in (trainer.run_dir / "verl_logs.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["scope"] == "eval"]
    assert evals and all(r["kind/even/num_samples"] == 8 and r["kind/odd/num_samples"] == 8 for r in evals)
    last = evals[-1]
    assert (last["kind/even/accuracy"] + last["kind/odd/accuracy"]) / 2 == pytest.approx(last["accuracy"])
    checkpoint = sorted((trainer.run_dir / "checkpoints").glob("global_step_*"))[-1]
    assert last["step"] == int(checkpoint.name.split("_")[-1])
    results = run_eval(checkpoint, EvalSettings(quiet=True, group_by="extra_info.kind"), out=tmp_path / "eval")
    for kind in ("even", "odd"):
        offline = results["groups"]["values"][kind]["metrics"]
        for name in ("accuracy", "reward_mean", "response_length_mean"):
            assert last[f"kind/{kind}/{name}"] == pytest.approx(offline[f"eval/{name}"]["value"]), (kind, name)


def test_the_summary_line_gives_a_slow_rate_in_two_digits_not_zero():
    from eval.runner import summary_line

    def line(rate):
        return summary_line({"data": {}, "metrics": {}, "timing": {"samples_per_second": rate}})

    # A 135M agent with tool turns on one thread evaluates ~0.3 stories a second: "0 samples/s" hid it.
    assert line(0.3125).endswith("0.31 samples/s") and line(3.0).endswith("3 samples/s")
    assert line(123.4).endswith("123 samples/s")

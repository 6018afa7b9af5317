"""`compare` on hand-made evaluation dirs: pairing by prompt, McNemar, corpus metrics, >2 runs, importance."""

from __future__ import annotations

import json

import numpy as np
import pytest

from eval.compare import compare, config_diff, per_prompt
from eval.results import SCHEMA, write_results
from eval.stats import mcnemar


def fake_eval(path, accuracy: list[float], responses: list[str], lr: float, kl_coef: float = 0.04,
              order: list[int] | None = None, corpus: tuple[str, ...] = ("distinct_1",)) -> None:
    """An eval dir as `verl eval` writes it: one sample per prompt p0..pN, accuracy + the diversity evaluator's
    ``corpus`` metrics (distinct-1)."""
    order = order or list(range(len(accuracy)))
    samples = [{"prompt_id": f"p{i}", "index": i, "sample": 0, "prompt": f"q{i}", "response": responses[i],
                "ground_truth": "1", "data_source": "arithmetic", "response_length": len(responses[i].split()),
                "accuracy": accuracy[i]} for i in order]
    acc = float(np.mean(accuracy))
    results = {
        "schema": SCHEMA, "label": path.name, "checkpoint": str(path), "step": 1, "run_dir": None,
        "model_hash": path.name, "sampling": {"n": 1, "temperature": 0.0, "seed": 1}, "settings_fingerprint": "x",
        "metrics": {
            "eval/accuracy": {"value": acc, "se": 0.1, "ci_low": 0, "ci_high": 1, "n": len(accuracy),
                              "method": "mean", "aggregate": "mean", "column": "accuracy", "binary": True,
                              "higher_is_better": True, "evaluator": "accuracy"},
            **{f"eval/{name}": {"value": 0.5, "se": 0.1, "ci_low": 0, "ci_high": 1, "n": len(accuracy),
                                "method": "jackknife", "aggregate": "corpus", "column": None, "binary": False,
                                "higher_is_better": None, "evaluator": "diversity"} for name in corpus},
        },
        "config": {"actor": {"optim": {"lr": lr}, "kl_loss_coef": kl_coef}, "trainer": {"experiment_name": path.name}},
    }
    write_results(path, results, samples)


def test_pairs_by_prompt_id_not_row_order(tmp_path):
    base = [1, 0, 1, 0, 1, 0, 1, 0, 1, 0]
    fake_eval(tmp_path / "a", base, ["x y"] * 10, 1e-4)
    fake_eval(tmp_path / "b", base, ["x y"] * 10, 1e-4, order=list(reversed(range(10))))  # same answers, shuffled
    report = compare([str(tmp_path / "a"), str(tmp_path / "b")], out=tmp_path / "cmp", n_boot=200)
    row = report["comparisons"][0]["metrics"]["eval/accuracy"]
    assert row["diff"] == 0 and row["correlation"] == pytest.approx(1.0)
    assert row["verdict"] == "no significant difference"
    assert report["config_diff"] == {}  # experiment_name is ignored


def test_mcnemar_decides_binary_metrics_and_corpus_metrics_are_recomputed(tmp_path):
    a = [0] * 30 + [1] * 10
    b = [1] * 30 + [1] * 10  # 30 prompts flipped to correct, none the other way
    fake_eval(tmp_path / "a", a, [f"w{i}" for i in range(40)], 1e-4)  # all distinct words
    fake_eval(tmp_path / "b", b, ["same"] * 40, 1e-3)  # one word repeated
    report = compare([str(tmp_path / "a"), str(tmp_path / "b")], out=tmp_path / "cmp", n_boot=300)
    acc = report["comparisons"][0]["metrics"]["eval/accuracy"]
    assert acc["test"] == "McNemar (chi2)" and acc["mcnemar"]["n01"] == 30 and acc["mcnemar"]["n10"] == 0
    assert acc["p_value"] == pytest.approx(mcnemar(a, b)["p_chi2"]) and acc["verdict"] == "better"
    distinct = report["comparisons"][0]["metrics"]["eval/distinct_1"]
    assert distinct["baseline"] == pytest.approx(1.0) and distinct["candidate"] == pytest.approx(1 / 40)
    assert distinct["test"] == "paired jackknife" and distinct["verdict"] == "lower"
    assert report["config_diff"] == {"actor.optim.lr": [1e-4, 1e-3]}
    md = (tmp_path / "cmp" / "report.md").read_text()
    assert "McNemar (chi2), wins/losses = 30/0" in md


def test_three_runs_each_against_baseline_with_importance(tmp_path):
    rng = np.random.default_rng(0)
    specs = [("lo", 1e-5, 0.04, 0.2), ("mid", 1e-4, 0.01, 0.5), ("hi", 1e-3, 0.04, 0.8)]
    for name, lr, kl, p in specs:
        fake_eval(tmp_path / name, list((rng.random(60) < p).astype(float)), ["a b"] * 60, lr, kl)
    report = compare([str(tmp_path / n) for n, *_ in specs], out=tmp_path / "cmp", n_boot=200)
    assert [c["candidate"] for c in report["comparisons"]] == ["mid", "hi"]
    assert all(c["baseline"] == "lo" for c in report["comparisons"])
    rows = {r["key"]: r for r in report["importance"]["rows"]}
    assert set(rows) == {"actor.optim.lr", "actor.kl_loss_coef"}
    assert rows["actor.optim.lr"]["correlation"] > 0.8  # accuracy rises with lr in these fake runs
    assert "Hyper-parameter importance" in (tmp_path / "cmp" / "report.md").read_text()
    saved = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert saved["importance"]["metric"] == "eval/accuracy"


def test_no_shared_prompts_is_a_clear_error(tmp_path):
    from verl.errors import VerlError

    fake_eval(tmp_path / "a", [1, 0], ["x", "y"], 1e-4)
    fake_eval(tmp_path / "b", [1, 0], ["x", "y"], 1e-4)
    rows = [json.loads(line) for line in (tmp_path / "b" / "samples.jsonl").read_text().splitlines()]
    (tmp_path / "b" / "samples.jsonl").write_text("".join(json.dumps({**r, "prompt_id": "z" + r["prompt_id"]}) + "\n"
                                                          for r in rows))
    with pytest.raises(VerlError, match="share no prompts"):
        compare([str(tmp_path / "a"), str(tmp_path / "b")], out=tmp_path / "cmp")
    (tmp_path / "b" / "samples.jsonl").write_text("{not json\n")
    with pytest.raises(VerlError, match="row 1 is not valid JSON"):
        compare([str(tmp_path / "a"), str(tmp_path / "b")], out=tmp_path / "cmp")


def test_per_prompt_means_and_config_diff_helpers():
    samples = [{"prompt_id": "p", "x": 1.0}, {"prompt_id": "p", "x": 0.0}, {"prompt_id": "q", "x": None}]
    assert per_prompt(samples, "x") == {"p": 0.5}

    class E:
        def __init__(self, cfg):
            self.results = {"config": cfg}

    diff = config_diff([E({"a": {"b": 1}, "c": 2}), E({"a": {"b": 1}, "c": 3, "d": True})])
    assert diff == {"c": [2, 3], "d": [None, True]}

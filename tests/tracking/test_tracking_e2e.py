"""A real short `verl train` with every tracker: TensorBoard, offline wandb and MLflow hold the JSONL's metrics.

One subprocess run (the CLI exactly as a user types it) is shared by the tests of this module.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from verl.tracking.follow import row_kind, row_metrics
from verl.utils.log import read_jsonl

pytestmark = pytest.mark.e2e  # a real process, server, cluster or trainer run: `make test-fast` skips it

TRACKERS = "[console,jsonl,tensorboard,wandb,mlflow]"
STEPS = 3


def close(a: float, b: float, rel: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return math.isclose(a, b, rel_tol=rel, abs_tol=rel)


@pytest.fixture(scope="module")
def run(tmp_path_factory, repo_root):
    out = tmp_path_factory.mktemp("e2e")
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    env.pop("MLFLOW_TRACKING_URI", None)  # the default store under trainer.output_dir is what is tested
    env.pop("WANDB_RUN_ID", None)
    cmd = [sys.executable, "-m", "verl.cli", "train", f"trainer.output_dir={out}", "trainer.experiment_name=e2e",
           f"trainer.total_steps={STEPS}", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=4",
           "trainer.test_freq=2", "data.val_max_samples=8", f"trainer.logger={TRACKERS}",
           "trainer.tracking.wandb.log_artifacts=true", "trainer.tracking.wandb.group=e2e-group"]
    proc = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run_dir = out / "verl" / "e2e"
    rows = read_jsonl(run_dir / "verl_logs.jsonl")
    expected: dict[tuple[str, int], float] = {}
    for row in rows:
        if row_kind(row) == "metrics":
            for tag, value in row_metrics(row).items():
                assert (tag, row["step"]) not in expected, f"{tag} logged twice at step {row['step']}"
                expected[(tag, row["step"])] = value
    return {"dir": run_dir, "out": out, "rows": rows, "expected": expected, "stderr": proc.stderr}


def load_scalars(log_dir: Path) -> dict[tuple[str, int], float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    acc.Reload()
    points = {}
    for tag in acc.Tags()["scalars"]:
        for event in acc.Scalars(tag):
            assert (tag, event.step) not in points, f"TensorBoard holds {tag} twice at step {event.step}"
            points[(tag, event.step)] = event.value
    return points, acc


def test_tensorboard_scalars_equal_jsonl_step_by_step(run):
    expected = run["expected"]
    assert {step for _, step in expected} == set(range(STEPS + 1))  # step 0: validation before training
    scalars, acc = load_scalars(run["dir"] / "tensorboard")
    assert set(scalars) == set(expected)
    mismatched = {k: (v, scalars[k]) for k, v in expected.items() if not close(v, scalars[k], 1e-6)}  # float32
    assert not mismatched
    tags = acc.Tags()
    assert {"rollout/rewards", "rollout/response_lengths", "rollout/advantages"} <= set(tags["histograms"])
    assert [e.step for e in acc.Histograms("rollout/rewards")] == list(range(1, STEPS + 1))
    assert acc.Histograms("rollout/rewards")[0].histogram_value.num == 16  # 4 prompts x 4 responses
    assert {"samples/train/text_summary", "samples/val/text_summary"} <= set(tags["tensors"])
    text = acc.Tensors("samples/train/text_summary")[0].tensor_proto.string_val[0].decode()
    first_sample = next(r for r in run["rows"] if r.get("scope") == "sample" and r.get("split") == "train")
    assert first_sample["response"].replace("\n", "⏎") in text and "| prompt |" in text
    assert "_hparams_/experiment" in acc.PluginTagToContent("hparams")


def test_system_metrics_land_every_step(run):
    expected = run["expected"]
    for step in range(1, STEPS + 1):
        assert expected[("system/rss_gb", step)] > 0
        assert ("system/cpu_percent", step) in expected
        assert expected[("timing/total", step)] > 0
        assert expected[("throughput/tokens_per_second", step)] > 0


def test_wandb_offline_run_holds_the_same_metrics(run):
    from wandb_offline import read_run

    files = list((run["dir"] / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1
    record = read_run(files[0])
    ids = json.loads((run["dir"] / "tracking.json").read_text())
    assert record["run"].run_id == ids["wandb"] and record["run"].display_name == "e2e"
    assert record["run"].project == "verl"
    by_step: dict[int, dict] = {}
    for row in record["history"]:
        by_step.setdefault(int(row["_step"]), {}).update(row)
    missing = [k for k in run["expected"] if k[0] not in by_step.get(k[1], {})]
    assert not missing
    mismatched = [k for k, v in run["expected"].items() if not close(v, float(by_step[k[1]][k[0]]), 1e-9)]
    assert not mismatched
    assert record["config"]["actor"]["optim"]["lr"] == pytest.approx(1e-4)
    # Media values are stored as nested keys: ("samples/train", "_type") -> "samples/train/_type".
    assert by_step[1]["samples/train/_type"] == "table-file"
    assert by_step[1]["samples/train/nrows"] == 4
    # The table accumulates (newest max_sample_rows): validations at steps 0, 2, 3 with 4 samples each.
    assert [by_step[s]["samples/val/nrows"] for s in (0, 2, 3)] == [4, 8, 12]
    assert by_step[1]["rollout/rewards/_type"] == "histogram"
    assert record["run"].run_group == "e2e-group"
    (artifact,) = record["artifacts"]  # the final checkpoint (trainer.tracking.wandb.log_artifacts=true)
    assert artifact.type == "model" and artifact.name == "e2e-model"
    assert {"step-3", "latest"} <= set(artifact.aliases)
    files = {entry.path for entry in artifact.manifest.contents}
    assert {"model.safetensors", "config.json", "meta.json"} <= files


def test_mlflow_run_holds_the_same_metrics_params_and_samples(run):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run['out'].resolve() / 'mlflow.db'}")
    run_id = json.loads((run["dir"] / "tracking.json").read_text())["mlflow"]
    info = client.get_run(run_id)
    assert info.info.status == "FINISHED" and info.info.run_name == "e2e"
    assert client.get_experiment(info.info.experiment_id).name == "verl"
    assert info.data.params["actor.optim.lr"] == "0.0001"
    assert info.data.params["trainer.total_steps"] == str(STEPS)
    tags = {tag for tag, _ in run["expected"]}
    for tag in tags:
        history = {m.step: m.value for m in client.get_metric_history(run_id, tag)}
        want = {step: v for (t, step), v in run["expected"].items() if t == tag}
        assert set(history) == set(want), tag
        assert all(close(want[s], history[s], 1e-9) for s in want), tag
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"samples", "samples.json"} <= artifacts
    train_files = [a.path for a in client.list_artifacts(run_id, "samples/train")]
    assert train_files == [f"samples/train/step_{s:06d}.json" for s in range(1, STEPS + 1)]
    table = json.loads(Path(client.download_artifacts(run_id, "samples.json")).read_text())
    assert {"step", "prompt", "response", "score", "split"} <= set(table["columns"])
    assert len(table["data"]) == 4 * STEPS + 4 * 3  # train each step + validation at steps 0, 2, 3


def test_converter_reproduces_the_live_tensorboard_scalars(run, tmp_path):
    from verl.tracking.converter import follow

    converter = follow(run["dir"], tmp_path / "tb", once=True)
    converted, acc = load_scalars(tmp_path / "tb")
    live, _ = load_scalars(run["dir"] / "tensorboard")
    assert converted == live
    assert [e.step for e in acc.Histograms("rollout/advantages")] == list(range(1, STEPS + 1))
    assert converter.counts["texts"] == STEPS + 3  # one train table per step, one val table per validation

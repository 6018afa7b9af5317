"""``verl.trainer.run.Run``: the directory, config snapshot, trackers and logger every trainer shares, and the
logger bound for ``fit`` as a context variable: ``log.info`` from a callback, a reward or a tool thread lands in the
run being fitted, two runs fitted at once in one process each keep their own rows, and nothing is written outside
``bound``."""

from __future__ import annotations

import json
import threading

from verl.config import load_config
from verl.tools.calls import ToolCall
from verl.tools.registry import Tool, ToolSet
from verl.tools.runner import ToolRunner
from verl.trainer.run import Run
from verl.utils import log


def run_in(tmp_path, name: str) -> Run:
    config = load_config(None, [f"trainer.output_dir={tmp_path}", f"trainer.experiment_name={name}",
                                "trainer.logger=[jsonl]"])
    return Run(config, quiet=True)


def rows(run: Run, scope: str) -> list[dict]:
    return [r for r in map(json.loads, run.config.log_path().read_text().splitlines()) if r["scope"] == scope]


def test_open_writes_the_snapshot_and_the_bound_logger_takes_log_info_only_inside(tmp_path):
    run = run_in(tmp_path, "a").open()
    assert (run.dir / "config.yaml").is_file() and run.logger is not None and run.trackers
    log.info("reward", outside=1.0)  # no run bound: nothing
    with run.bound():
        assert log.get_active() is run.logger
        log.info("reward", tps=12.5)
        run.logger.log_step(1, {"rollout/reward_mean": 0.5})
    assert log.get_active() is None
    run.close()
    [reward] = rows(run, "reward")
    assert reward["tps"] == 12.5 and reward["step"] == 1 and "outside" not in reward
    run.close()  # idempotent


def test_two_runs_fitted_at_once_keep_their_own_rows(tmp_path):
    """The module global this replaces sent both threads' fields to whichever run set it last."""
    runs = [run_in(tmp_path, name).open() for name in ("a", "b")]
    barrier = threading.Barrier(2)

    def fit(run: Run, value: float) -> None:
        with run.bound():
            barrier.wait()  # both bound before either logs
            log.info("reward", mine=value)
            barrier.wait()
            run.logger.log_step(1, {"rollout/n": value})

    threads = [threading.Thread(target=fit, args=(run, float(i))) for i, run in enumerate(runs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for i, run in enumerate(runs):
        run.close()
        assert [r["mine"] for r in rows(run, "reward")] == [float(i)]


def test_a_tool_running_in_the_runners_thread_logs_into_the_bound_run(tmp_path):
    run = run_in(tmp_path, "tools").open()
    schema = {"type": "function", "function": {"name": "note", "description": "Log and answer.",
                                               "parameters": {"type": "object", "properties": {}}}}
    runner = ToolRunner(ToolSet({"note": Tool(schema, "tests.test_run:noting_tool", pure=True)}), processes=0,
                        threads=1)
    try:
        with run.bound():
            result = runner.run(ToolCall("note", {}, "note()"))
            run.logger.log_step(1, {"rollout/n": 1.0})
    finally:
        runner.shutdown()
        run.close()
    assert "noted" in str(result) and [r["called"] for r in rows(run, "tool_note")] == [1]


def noting_tool() -> str:
    """A tool that logs a field, as a user's tool may."""
    log.info("tool_note", called=1)
    return "noted"

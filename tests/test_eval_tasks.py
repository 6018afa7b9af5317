"""``trainer.eval_tasks``: held-out tasks validation also runs, each scored by its own data source's reward, never
the training reward (verl/trainer/validation.py, ``EvalTask``). A tiny run trained on a custom reward logs a sums
task and a code task (its programs run in the sandbox); the sums numbers equal ``verl eval`` on the checkpoint."""

from __future__ import annotations

import copy
import json

import pytest

from tests.test_trainer import TINY
from verl.config import build_config
from verl.errors import ConfigError, VerlError
from verl.trainer.local import LocalPPOTrainer

pytestmark = pytest.mark.e2e  # a real run and a real eval: `make test-fast` skips it

CONSTANT_REWARD = "def always_half(data_source, solution_str, ground_truth, extra_info=None, **kw):\n    return 0.5\n"


def config(tmp_path, **trainer) -> dict:
    cfg = copy.deepcopy(TINY)
    cfg["trainer"].update(output_dir=str(tmp_path), experiment_name="t", **trainer)
    return cfg


def test_eval_tasks_are_scored_by_their_own_rewards_and_equal_verl_eval(tmp_path, bubblewrap):
    from eval.runner import EvalSettings, run_eval

    reward_file = tmp_path / "half.py"
    reward_file.write_text(CONSTANT_REWARD)  # the training reward says nothing about the tasks
    tasks = [{"name": "sums", "data": ["builtin:arithmetic/test"], "max_samples": 16},
             {"name": "code", "data": ["builtin:code_functions/val"], "evaluators": ["code"], "max_samples": 4,
              "every": 4, "max_prompt_length": 400, "max_new_tokens": 16}]
    cfg = config(tmp_path, total_steps=4, test_freq=2, val_before_train=True, save_freq=4, eval_tasks=tasks)
    cfg["reward"] = {"custom_reward": {"path": str(reward_file), "name": "always_half"}}
    trainer = LocalPPOTrainer(cfg, quiet=True)
    trainer.fit()
    rows = [json.loads(line) for line in trainer.config.log_path().read_text().splitlines()]
    evals = {r["step"]: r for r in rows if r["scope"] == "eval"}
    assert sorted(evals) == [0, 2, 4]
    for step, row in evals.items():
        assert row["reward_mean"] == 0.5  # validation itself: the training reward
        assert row["sums/num_samples"] == 16 and row["sums/reward_mean"] != 0.5  # the task: arithmetic's own rule
        assert ("code/tests_passed" in row) == (step % 4 == 0)  # every: 4
    assert evals[4]["code/num_samples"] == 4 and 0.0 <= evals[4]["code/tests_passed"] <= 1.0

    checkpoint = trainer.run_dir / "checkpoints" / "global_step_4"
    offline = run_eval(str(checkpoint), EvalSettings(data=["builtin:arithmetic/test"], max_samples=16,
                                                     evaluators="accuracy", quiet=True), tmp_path / "eval")
    for name in ("accuracy", "accuracy_flexible", "exact_match"):
        assert offline["metrics"][f"eval/{name}"]["value"] == evals[4][f"sums/{name}"], name


def test_an_lm_eval_task_runs_on_the_policy_in_memory_and_equals_verl_eval_lm_eval_task(tmp_path):
    """lm-eval's multiple-choice task on the trainer's policy at each validation (lm-eval's hf model around the
    module in memory): at step 2 its numbers equal `verl eval --lm-eval-task` on the step-2 checkpoint (a directory,
    as lm-eval's CLI would load it)."""
    pytest.importorskip("lm_eval")
    from eval.runner import EvalSettings, run_eval
    from tests.eval.test_lm_eval_tasks import write_tasks

    tasks = write_tasks(tmp_path / "lm")
    spec = {"name": "mc", "lm_eval_task": str(tasks / "verl_choice.yaml"), "lm_eval_args": ["limit=20"]}
    cfg = config(tmp_path, total_steps=2, test_freq=2, val_before_train=True, save_freq=2, eval_tasks=[spec])
    trainer = LocalPPOTrainer(cfg, quiet=True)
    trainer.fit()
    assert trainer.model.training  # lm-eval's eval mode was undone
    rows = [json.loads(line) for line in trainer.config.log_path().read_text().splitlines()]
    evals = {r["step"]: r for r in rows if r["scope"] == "eval"}
    assert {"mc/verl_choice/acc", "mc/verl_choice/acc_norm"} <= set(evals[0]) and set(evals) == {0, 2}
    checkpoint = trainer.run_dir / "checkpoints" / "global_step_2"
    offline = run_eval(str(checkpoint), EvalSettings(lm_eval_tasks=[str(tasks / "verl_choice.yaml")],
                                                     lm_eval_args=["limit=20"], quiet=True), tmp_path / "eval")
    for name in ("acc", "acc_norm"):
        assert offline["metrics"][f"eval/lm_eval/verl_choice/{name}"]["value"] == evals[2][f"mc/verl_choice/{name}"]
    # The run's checkpoint: lm-eval's contexts were checked against the run's training prompts.
    assert offline["contamination"]["checked"] == 20 and offline["contamination"]["against"] == cfg["data"].get(
        "train_files", ["builtin:arithmetic/train"])
    with pytest.raises(ConfigError, match="lm_eval_task defines its own"):
        build_config({"trainer": {"test_freq": 2, "eval_tasks": [{**spec, "max_samples": 4}]}})
    with pytest.raises(ConfigError, match="one of them"):
        build_config({"trainer": {"test_freq": 2, "eval_tasks": [{**spec, "data": ["builtin:arithmetic/test"]}]}})


@pytest.mark.parametrize("tasks,trainer,expected", [
    ([{"name": "a", "data": ["builtin:arithmetic/test"], "every": 3}], {"test_freq": 2}, "multiple of"),
    ([{"name": "a", "data": ["builtin:arithmetic/test"]}] * 2, {"test_freq": 2}, "names must differ"),
    ([{"name": "a", "data": ["builtin:arithmetic/test"]}], {"test_freq": 0}, "test_freq > 0"),
    ([{"name": "a b", "data": ["builtin:arithmetic/test"]}], {"test_freq": 2}, "name"),
    ([{"name": "a", "data": ["builtin:arithmetic/test"], "metric": "x"}], {"test_freq": 2}, "metric"),
])
def test_bad_eval_tasks_are_refused_by_name(tasks, trainer, expected):
    with pytest.raises(ConfigError, match=expected):
        build_config({"trainer": {**trainer, "eval_tasks": tasks}})


def test_a_tasks_unknown_evaluator_or_data_fails_before_the_first_step(tmp_path):
    for task, expected in (({"name": "a", "data": ["builtin:arithmetic/test"], "evaluators": ["nope"]}, "nope"),
                           ({"name": "a", "data": ["builtin:no_such_task/val"]}, "no_such_task")):
        with pytest.raises(VerlError, match=expected):
            LocalPPOTrainer(config(tmp_path, test_freq=2, eval_tasks=[task]), quiet=True)
    assert not list(tmp_path.rglob("verl_logs.jsonl"))

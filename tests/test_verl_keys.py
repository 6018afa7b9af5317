"""verl users' habits: verl's own key names, Hydra's +key=value, and verl's GRPO GSM8K launch line as it is."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.trainer_utils import rows, run_cli
from verl.config import load_config
from verl.errors import ConfigError

pytestmark = pytest.mark.e2e  # a real process, server, cluster or trainer run: `make test-fast` skips it

# verl's examples/grpo_trainer GSM8K launch line (Qwen2-7B), with only the model path and data files replaced.
VERL_GRPO_GSM8K = [
    "algorithm.adv_estimator=grpo",
    "data.train_files=builtin:arithmetic/train",
    "data.val_files=builtin:arithmetic/val",
    "data.train_batch_size=1024",
    "data.max_prompt_length=512",
    "data.max_response_length=1024",
    "data.filter_overlong_prompts=True",
    "data.truncation=error",
    "actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.model.use_remove_padding=True",
    "actor_rollout_ref.actor.ppo_mini_batch_size=256",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40",
    "actor_rollout_ref.actor.use_kl_loss=True",
    "actor_rollout_ref.actor.kl_loss_coef=0.001",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.model.enable_gradient_checkpointing=True",
    "actor_rollout_ref.actor.fsdp_config.param_offload=False",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
    "actor_rollout_ref.rollout.n=5",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40",
    "actor_rollout_ref.ref.fsdp_config.param_offload=True",
    "algorithm.use_kl_in_reward=False",
    "trainer.critic_warmup=0",
    "trainer.logger=['console','wandb']",
    "trainer.project_name=verl_grpo_example_gsm8k",
    "trainer.experiment_name=qwen2_7b_function_rm",
    "trainer.n_gpus_per_node=8",
    "trainer.nnodes=1",
    "trainer.save_freq=20",
    "trainer.test_freq=5",
    "trainer.total_epochs=15",
]


def test_verl_grpo_gsm8k_line_maps_onto_our_keys(capsys):
    cfg = load_config(None, VERL_GRPO_GSM8K)
    assert cfg.model.path == "Qwen/Qwen2.5-0.5B-Instruct"
    assert (cfg.actor.optim.lr, cfg.actor.ppo_mini_batch_size, cfg.actor.ppo_micro_batch_size) == (1e-6, 256, 40)
    assert (cfg.actor.use_kl_loss, cfg.actor.kl_loss_coef, cfg.actor.kl_loss_type) == (True, 0.001, "low_var_kl")
    assert cfg.model.gradient_checkpointing and cfg.reference.offload_to_cpu
    assert (cfg.rollout.name, cfg.rollout.n, cfg.rollout.gpu_memory_utilization) == ("vllm", 5, 0.6)
    assert cfg.data.truncation == "filter"  # verl filters over-long prompts before 'error' can see them
    assert cfg.critic.warmup_steps == 0 and cfg.trainer.logger == ["console", "wandb", "jsonl"]
    assert cfg.trainer.total_epochs == 15 and cfg.trainer.total_steps is None  # resolved from the data at start
    assert cfg.resolve_total_steps(20000) == 15 * (20000 // 1024)
    notes = capsys.readouterr().err
    assert "actor_rollout_ref.actor.optim.lr -> actor.optim.lr" in notes
    assert "ignored: " in notes and "actor_rollout_ref.rollout.tensor_model_parallel_size" in notes
    load_config(None, VERL_GRPO_GSM8K)
    assert capsys.readouterr().err == ""  # the notice is printed once per process


def test_verl_line_passes_a_dry_run_through_the_cli():
    result = run_cli(["train", "--dry-run", *VERL_GRPO_GSM8K])
    assert result.returncode == 0, result.stderr
    assert "config OK: verl_grpo_example_gsm8k/qwen2_7b_function_rm" in result.stderr
    assert "1024 prompts x 5 = 5120 responses" in result.stderr


def test_verl_line_trains_on_the_tiny_model(tmp_path):
    """verl's launch line verbatim: ``python3 -m verl.trainer.main_ppo <the line>``, on the built-in model, shrunk
    to one step by verl's own keys; wandb offline (no login here)."""
    small = ["actor_rollout_ref.model.path=builtin:tiny-arith", "data.max_prompt_length=64",
             "data.max_response_length=16", "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.rollout.name=hf",
             "actor_rollout_ref.rollout.n=2", "+trainer.total_training_steps=1", "+data.val_max_samples=8",
             f"trainer.output_dir={tmp_path}", "trainer.val_before_train=False"]
    result = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", *VERL_GRPO_GSM8K, *small],
                            capture_output=True, text=True, timeout=300, env={**os.environ, "WANDB_MODE": "offline"})
    assert result.returncode == 0, result.stderr
    assert "actor_rollout_ref.actor.optim.lr -> actor.optim.lr" in result.stderr  # mapped as verl train maps it
    run_dir = tmp_path / "verl_grpo_example_gsm8k" / "qwen2_7b_function_rm"
    assert [r["step"] for r in rows(run_dir / "verl_logs.jsonl", "rollout")] == [1]
    assert (run_dir / "checkpoints" / "global_step_1" / "model.safetensors").is_file()
    assert (run_dir / "wandb").is_dir()


def test_main_ppo_takes_hydras_config_flags():
    from verl.trainer.main_ppo import hydra_to_train_args

    assert hydra_to_train_args(["--config-path", "configs", "--config-name", "grpo_tiny", "a.b=1"]) == [
        "--config", "configs/grpo_tiny.yaml", "a.b=1"]
    assert hydra_to_train_args(["--config-path=cfg", "--config-name=x.yaml", "--dry-run"]) == [
        "--config", "cfg/x.yaml", "--dry-run"]
    assert hydra_to_train_args(["algorithm.adv_estimator=grpo"]) == ["algorithm.adv_estimator=grpo"]
    with pytest.raises(SystemExit, match="--config-name"):
        hydra_to_train_args(["--config-path", "configs"])
    result = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", "--config-path", "configs",
                             "--config-name", "grpo_tiny", "--dry-run"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "config OK" in result.stderr, result.stderr
    bad = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", "actor_rollout_ref.actor.optim.lrr=1"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "did you mean 'actor.optim.lr'" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_hydra_plus_prefix_and_verl_resume_keys(tmp_path):
    assert load_config(None, ["+trainer.total_training_steps=7", "++actor.optim.lr=2e-5"]).trainer.total_steps == 7
    assert load_config(None, ["trainer.resume_mode=disable"]).trainer.resume == "disable"
    ckpt = str(tmp_path / "global_step_3")
    cfg = load_config(None, ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={ckpt}"])
    assert cfg.trainer.resume == ckpt
    with pytest.raises(ConfigError, match="resume_from_path"):
        load_config(None, ["trainer.resume_mode=resume_path"])
    cfg = load_config(None, ["custom_reward_function.path=my_reward.py", "custom_reward_function.name=score",
                             "algorithm.kl_ctrl.kl_coef=0.02", "algorithm.kl_ctrl.type=adaptive"])
    assert (cfg.reward.custom_reward.path, cfg.reward.custom_reward.name) == ("my_reward.py", "score")
    assert (cfg.algorithm.kl_ctrl.kl_coef, cfg.algorithm.kl_ctrl.type) == (0.02, "adaptive")
    # total_steps given beside total_epochs wins, as verl's total_training_steps does.
    assert load_config(None, ["trainer.total_epochs=3", "trainer.total_steps=5"]).trainer.total_steps == 5


def test_unknown_verl_keys_get_a_hint_that_fits():
    with pytest.raises(ConfigError, match=r"unknown config key 'actor.optim.lrr'; did you mean 'actor.optim.lr'"):
        load_config(None, ["actor_rollout_ref.actor.optim.lrr=1e-6"])
    with pytest.raises(ConfigError) as info:
        load_config(None, ["actor_rollout_ref.critic.lr=1e-6"])
    message = str(info.value)
    assert "actor_rollout_ref" in message and "actor, rollout, ref, model" in message
    assert "did you mean 'rollout'" not in message


def test_verls_multi_turn_keys(tmp_path, capsys):
    """verl's multi-turn (sglang/AgentLoop) lines: actor_rollout_ref.rollout.multi_turn.* and data.tool_config_path
    map onto rollout.multi_turn; sglang's tuning keys are named as ignored."""
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - class_name: verl.tools.calculator:calculator\n    config: {type: native}\n"
                     "    tool_schema:\n      type: function\n      function:\n        name: calc\n"
                     "        parameters: {type: object, properties: {expression: {type: string}}}\n")
    cfg = load_config(None, ["actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.multi_turn.enable=true",
                             "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=5",
                             "actor_rollout_ref.rollout.multi_turn.format=hermes",
                             "actor_rollout_ref.rollout.multi_turn.max_user_turns=5",
                             "actor_rollout_ref.rollout.multi_turn.use_inference_chat_template=true",
                             "actor_rollout_ref.rollout.max_num_seqs=64",
                             f"data.tool_config_path={tools}"])
    turns = cfg.rollout.multi_turn
    assert cfg.rollout.max_num_seqs == 64  # the decode width the agent loop schedules trajectories into
    assert (turns.enable, turns.max_assistant_turns, turns.format, turns.tool_config_path, turns.max_user_turns) == (
        True, 5, "hermes", str(tools), 5)
    notes = capsys.readouterr().err
    assert "data.tool_config_path -> rollout.multi_turn.tool_config_path" in notes
    ignored = notes.split("ignored:")[1]
    assert "use_inference_chat_template" in ignored and "max_user_turns" not in ignored  # ignored, and said so
    with pytest.raises(ConfigError, match="needs tools"):
        load_config(None, ["actor_rollout_ref.rollout.multi_turn.enable=true"])


@pytest.mark.parametrize(("key", "needle"), [
    ("data.custom_cls.path=my_data.py", "a dataset class of your own"),
    ("actor_rollout_ref.rollout.agent.agent_loop_config_path=loops.yaml", "agent-loop settings other than num_workers"),
])
def test_verl_keys_whose_feature_is_missing_are_refused_by_name(key, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(None, [key])
    load_config(None, ["actor_rollout_ref.rollout.agent.num_workers=8"])  # scheduling only: ignored, said so


# verl's V1 trainer and fully-async recipe, TRL's AsyncGRPOTrainer (issue 65, item 3): every key either read with
# its meaning here or refused with the reason; none ignored.
ASYNC_READ = [
    ("trainer.use_v1=true", {}),
    ("trainer.v1.trainer_mode=sync", {}),
    ("async_training.staleness_threshold=0", {}),
    ("async_training.staleness_threshold=0.0", {}),
    ("async_training.trigger_parameter_sync_step=1", {}),
    ("async_training.require_batches=1", {}),
    ("async_training.partial_rollout=false", {}),
    ("async_training.use_rollout_log_probs=true", {"algorithm.rollout_correction.bypass_mode": True}),
    ("async_training.use_rollout_log_probs=false", {"algorithm.rollout_correction.bypass_mode": False}),
    ("async_training.compute_prox_log_prob=true", {}),
    ("max_staleness=0", {"trainer.one_step_off_policy": False}),
    ("max_staleness=1", {"trainer.one_step_off_policy": True}),
    ("weight_sync_steps=1", {}),
    ("rollout.test_freq=7", {"trainer.test_freq": 7}),
    ("rollout.nnodes=2", {}),
]
ASYNC_REFUSED = [
    ("trainer.v1.trainer_mode=separate_async", "trainer_mode='separate_async'"),
    ("trainer.v1.trainer_mode=colocate_async", "trainer_mode='colocate_async'"),
    ("trainer.v1.separate_async.parameter_sync_step=2", "V1 trainer settings other than trainer_mode=sync"),
    ("trainer.v1.sampler.type=stream", "V1 trainer settings other than trainer_mode=sync"),
    ("async_training.staleness_threshold=0.5", "staleness_threshold=0.5"),
    ("async_training.trigger_parameter_sync_step=4", "trigger_parameter_sync_step=4"),
    ("async_training.require_batches=2", "require_batches=2"),
    ("async_training.partial_rollout=true", "partial_rollout=True"),
    ("async_training.new_flag=1", "fully-async settings"),
    ("checkpoint_engine.backend=nccl", "checkpoint engine"),
    ("max_staleness=4", "max_staleness=4"),
    ("weight_sync_steps=2", "weight_sync_steps=2"),
    ("max_inflight_tasks=16", "in-flight rollout tasks"),
    ("actor_rollout_ref.rollout.total_rollout_steps=1000", "set trainer.total_steps"),
]


def _setting(config, dotted: str):
    value = config
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


@pytest.mark.parametrize(("line", "meaning"), ASYNC_READ)
def test_async_trainer_keys_with_our_meaning_are_read(line, meaning):
    config = load_config(None, [line])
    for dotted, value in meaning.items():
        assert _setting(config, dotted) == value, (line, dotted)


@pytest.mark.parametrize(("line", "needle"), ASYNC_REFUSED)
def test_async_trainer_keys_we_cannot_honour_are_refused_with_the_reason(line, needle):
    with pytest.raises(ConfigError) as refused:
        load_config(None, [line])
    message = str(refused.value)
    assert needle in message and "trainer.one_step_off_policy=true" in message, message


def test_the_async_key_lists_cover_every_key_the_map_knows():
    """Each key of verl.config_aliases.ASYNC_KEYS / ASYNC_PREFIXES appears in the lists above (a key added to the
    map without a test is caught here)."""
    from verl.config_aliases import ASYNC_KEYS, ASYNC_PREFIXES

    lines = [line.split("=")[0].replace("actor_rollout_ref.", "") for line, _ in ASYNC_READ + ASYNC_REFUSED]
    assert all(key in lines for key in ASYNC_KEYS), [k for k in ASYNC_KEYS if k not in lines]
    assert all(any(line.startswith(prefix) for line in lines) for prefix in ASYNC_PREFIXES)

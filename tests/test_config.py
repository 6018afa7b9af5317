"""Config loading: YAML + dotted overrides, and one readable ConfigError for every kind of mistake."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from verl.config import RMConfig, SFTConfig, VerlConfig, build_config, dump_config, load_config, parse_overrides
from verl.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, text: str, name: str = "exp.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults_match_the_documented_names():
    cfg = load_config()
    assert isinstance(cfg, VerlConfig)
    assert cfg.model.path == "builtin:tiny-arith"
    assert cfg.algorithm.adv_estimator == "grpo"
    assert cfg.actor.clip_low == cfg.actor.clip_high == 0.2
    assert cfg.algorithm.kl_ctrl.kl_coef == 0.001 and cfg.algorithm.kl_ctrl.target_kl == 0.1
    assert cfg.algorithm.kl_ctrl.horizon == 10000 and cfg.algorithm.gamma == 1.0 and cfg.algorithm.lam == 1.0
    assert re.fullmatch(r"grpo_tiny-\d{8}-\d{6}", cfg.trainer.experiment_name)


def test_yaml_then_dotted_overrides_win(tmp_path):
    path = write(tmp_path, "actor:\n  optim:\n    lr: 3.0e-4\n  clip_ratio_high: 0.28\ntrainer:\n  total_steps: 5\n")
    cfg = load_config(path, ["trainer.total_steps=7", "algorithm.adv_estimator=rloo", "actor.optim.lr=1e-5"])
    assert cfg.trainer.total_steps == 7  # the override beats the file
    assert cfg.actor.optim.lr == 1e-5  # "1e-5" (a YAML string) still validates as a float
    assert cfg.algorithm.adv_estimator == "rloo"
    assert cfg.actor.clip_high == 0.28 and cfg.actor.clip_low == 0.2
    assert cfg.trainer.experiment_name.startswith("exp-")  # named after the config file


def test_double_dash_form_and_lists():
    cfg = load_config(None, ["--trainer.experiment_name=run-a", "--data.train_batch_size=8",
                             "actor.ppo_mini_batch_size=4", "trainer.logger=[console,jsonl,tensorboard]"])
    assert cfg.trainer.experiment_name == "run-a"
    assert cfg.data.train_batch_size == 8
    assert cfg.trainer.logger == ["console", "jsonl", "tensorboard"]


def test_jsonl_logger_is_always_added():
    assert load_config(None, ["trainer.logger=[console]"]).trainer.logger == ["console", "jsonl"]
    assert load_config(None, ["trainer.logger=[]"]).trainer.logger == ["jsonl"]
    assert load_config(None, ["trainer.logger=[jsonl,console]"]).trainer.logger == ["jsonl", "console"]


def test_parse_overrides_types():
    assert parse_overrides(["a.b=1", "a.c=true", "a.d=x", "--a.e=[1, 2]", "a.f=", "a.g=null"]) == [
        ("a.b", 1), ("a.c", True), ("a.d", "x"), ("a.e", [1, 2]), ("a.f", ""), ("a.g", None)
    ]
    with pytest.raises(ConfigError, match="key=value"):
        parse_overrides(["trainer.total_steps"])
    with pytest.raises(ConfigError, match="not valid YAML"):
        parse_overrides(["trainer.logger=[console"])


@pytest.mark.parametrize(
    ("override", "key", "suggestion"),
    [
        ("actor.optim.lrr=1e-5", "actor.optim.lrr", "actor.optim.lr"),
        ("algorithm.adv_estimater=rloo", "algorithm.adv_estimater", "algorithm.adv_estimator"),
        ("actor.ppo_mini_batchsize=8", "actor.ppo_mini_batchsize", "actor.ppo_mini_batch_size"),
        ("trainr.total_steps=5", "trainr", "trainer"),
    ],
)
def test_unknown_key_names_it_and_suggests_the_closest(override, key, suggestion):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    message = str(err.value)
    assert f"unknown config key '{key}'" in message
    assert f"did you mean '{suggestion}'" in message
    assert "\n" not in message  # one readable line


def test_unknown_key_in_a_yaml_file_names_the_file(tmp_path):
    path = write(tmp_path, "rollout:\n  temprature: 0.7\n")
    with pytest.raises(ConfigError, match=r"exp\.yaml.*'rollout\.temprature'.*did you mean 'rollout\.temperature'"):
        load_config(path)


def test_unknown_key_without_a_close_match_lists_the_valid_ones():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["algorithm.zzzzzz=1"])
    assert "did you mean" not in str(err.value)
    assert "adv_estimator" in str(err.value) and "kl_ctrl" in str(err.value)


@pytest.mark.parametrize(
    ("override", "pattern"),
    [
        ("trainer.total_steps=abc", r"'trainer\.total_steps'.*integer.*'abc'"),
        ("actor.use_kl_loss=maybe", r"'actor\.use_kl_loss'.*bool"),
        ("data.train_files=5", r"'data\.train_files'.*list"),
        ("rollout.n=0", r"'rollout\.n'.*greater than or equal to 1"),
        ("actor.loss_agg_mode=token-sum", r"'actor\.loss_agg_mode'.*token-mean"),
    ],
)
def test_wrong_type_or_out_of_range_value(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(None, [override])


def test_batch_not_divisible_by_mini_batch():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["data.train_batch_size=10", "actor.ppo_mini_batch_size=4"])
    assert "data.train_batch_size (10) must be divisible by actor.ppo_mini_batch_size (4)" in str(err.value)


def test_other_impossible_values():
    with pytest.raises(ConfigError, match=r"actor\.ppo_micro_batch_size \(5\)"):
        load_config(None, ["actor.ppo_micro_batch_size=5"])  # 16 prompts * 8 = 128 responses
    with pytest.raises(ConfigError, match=r"needs rollout\.n >= 2"):
        load_config(None, ["rollout.n=1"])  # GRPO needs a group
    with pytest.raises(ConfigError, match=r"min_digits must be <= "):
        load_config(None, ["data.arithmetic.min_digits=4", "data.arithmetic.max_digits=2"])


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match=r"broken\.yaml' line 2, column 11 is not valid YAML"):
        load_config(write(tmp_path, "trainer:\n  steps: a: b\n", "broken.yaml"))
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(write(tmp_path, "- a\n- b\n", "list.yaml"))


def test_dump_round_trips(tmp_path):
    cfg = load_config(None, ["trainer.experiment_name=x", "algorithm.adv_estimator=gae", "rollout.n=1",
                             "actor.clip_ratio_high=0.3"])
    path = write(tmp_path, dump_config(cfg), "resolved.yaml")
    again = load_config(path)
    assert again == cfg
    assert yaml.safe_load(path.read_text())["actor"]["clip_ratio_high"] == 0.3


def test_sft_schema():
    cfg = load_config(None, ["trainer.total_steps=3"], schema=SFTConfig, default_name="sft_tiny")
    assert isinstance(cfg, SFTConfig) and cfg.trainer.total_steps == 3
    assert cfg.model.path == "builtin:tiny-arith-base"
    with pytest.raises(ConfigError, match="did you mean 'optim.lr'"):
        load_config(None, ["optim.lrate=1"], schema=SFTConfig)


SHIPPED = sorted((REPO / "configs").glob("*.yaml"))


@pytest.mark.skipif(not SHIPPED, reason="no configs/*.yaml yet")
@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_configs_load(path):
    if path.stem.startswith("eval"):
        pytest.skip("eval configs have their own schema (verl eval)")
    schema = SFTConfig if path.stem.startswith("sft") else RMConfig if path.stem.startswith("rm_") else VerlConfig
    cfg = load_config(path, schema=schema)
    assert isinstance(cfg, schema)
    assert cfg.trainer.experiment_name.startswith(path.stem)
    assert cfg.model.path.startswith("builtin:") or Path(cfg.model.path).name


def test_the_config_reads_kl_estimator_names_from_the_registry(monkeypatch):
    from verl.algos import kl

    monkeypatch.setattr(kl, "KL_ESTIMATORS", kl.KL_ESTIMATORS.copy())
    with pytest.raises(ConfigError, match="unknown KL estimator 'k4'"):
        build_config({"actor": {"kl_loss_type": "k4"}})
    kl.register_kl_estimator("k4")(lambda log_r: log_r.abs() ** 3)
    assert build_config({"actor": {"kl_loss_type": "k4"}}).actor.kl_loss_type == "k4"


def test_unknown_kl_estimator_is_a_config_error():
    import pytest

    from verl.config import load_config
    from verl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"unknown KL estimator .k4.*actor.kl_loss_type"):
        load_config(None, ["actor.kl_loss_type=k4"])


def test_the_agent_warm_start_recipe_is_the_shipped_config():
    """`verl sft --build-warm-start --warm-start tiny-agent` trains what configs/sft_agent_tiny.yaml says."""
    from verl.trainer.sft import AGENT_WARM_START

    shipped = load_config(REPO / "configs" / "sft_agent_tiny.yaml", schema=SFTConfig)
    recipe = build_config(AGENT_WARM_START, schema=SFTConfig)
    recipe.trainer.experiment_name = shipped.trainer.experiment_name  # named after the file and the time
    assert recipe == shipped


def test_a_partly_given_section_keeps_the_commands_own_defaults_for_the_rest():
    # verl rm / verl sft set their own optimizer and model defaults; giving one key of the section keeps the rest
    # (it used to rebuild the section from the class defaults: lr 1e-4, constant schedule, another model).
    rm = build_config({"optim": {"warmup_steps": 1}}, schema=RMConfig)
    assert (rm.optim.lr, rm.optim.warmup_steps, rm.optim.lr_scheduler, rm.optim.min_lr_ratio) == (1e-3, 1, "cosine",
                                                                                                  0.1)
    sft = build_config({"model": {"lora": {"rank": 8}}}, schema=SFTConfig)
    assert sft.model.path == "builtin:tiny-arith-base" and sft.model.lora.rank == 8
    assert build_config({"optim": {"lr": 5e-4}}, schema=RMConfig).optim.lr == 5e-4

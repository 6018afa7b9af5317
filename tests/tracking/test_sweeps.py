"""configs/sweeps: wandb sweep definitions whose trials run `verl train` with --dotted.key=value overrides."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from verl.cli import app
from verl.config import load_config

SWEEPS = sorted((Path(__file__).resolve().parents[2] / "configs" / "sweeps").glob("*.yaml"))


def sample_value(spec: dict):
    """One value a sweep controller could pick for a parameter."""
    if "values" in spec:
        return spec["values"][-1]
    if "value" in spec:
        return spec["value"]
    return spec["min"]


def agent_command(sweep: dict, values: dict) -> list[str]:
    """The argv a wandb agent runs for one trial: ${env} dropped, ${args} formatted by wandb itself."""
    from wandb.sdk.launch.sweeps.utils import create_sweep_command_args

    flags = create_sweep_command_args({"args": {k: {"value": v} for k, v in values.items()}})["args"]
    argv: list[str] = []
    for part in sweep["command"]:
        if part == "${env}":
            continue
        argv.extend(flags if part == "${args}" else [str(part)])
    return argv


def test_sweeps_exist():
    assert len(SWEEPS) >= 2


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.name)
def test_sweep_trial_command_is_a_valid_verl_train(path, repo_root, monkeypatch):
    sweep = yaml.safe_load(path.read_text())
    assert sweep["method"] in ("grid", "random", "bayes")
    assert sweep["metric"]["goal"] in ("maximize", "minimize") and "/" in sweep["metric"]["name"]
    values = {name: sample_value(spec) for name, spec in sweep["parameters"].items()}
    argv = agent_command(sweep, values)
    assert argv[:2] == ["verl", "train"] and any(a.startswith("--actor.") or a.startswith("--algorithm.")
                                                 or a.startswith("--trainer.") for a in argv)
    monkeypatch.chdir(repo_root)  # sweep commands name configs relative to the repository root
    result = CliRunner().invoke(app, [*argv[1:], "--dry-run"])
    assert result.exit_code == 0, result.output  # the dry run validated the overridden config
    # The same arguments, as the config loader sees them, set exactly the swept values.
    config_path = argv[argv.index("--config") + 1]
    overrides = [a for a in argv[2:] if "=" in a]
    config = load_config(config_path, overrides).model_dump()
    for dotted, value in values.items():
        node = config
        for part in dotted.split("."):
            node = node[part]
        assert node == pytest.approx(value), dotted


def test_a_misspelt_swept_key_is_reported(repo_root, monkeypatch):
    monkeypatch.chdir(repo_root)
    result = CliRunner().invoke(app, ["train", "--dry-run", "--actor.optim.lrr=0.001"])
    assert result.exit_code == 1
    assert "unknown config key 'actor.optim.lrr'" in result.output and "did you mean 'actor.optim.lr'" in result.output

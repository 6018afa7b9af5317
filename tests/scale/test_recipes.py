"""GPU recipes resolve and pass the shape check here, on a CPU machine that never loads their weights."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.trainer_utils import run_cli

pytestmark = pytest.mark.e2e  # a real process, server, cluster or trainer run: `make test-fast` skips it

RECIPES = sorted((Path(__file__).resolve().parents[2] / "configs" / "recipes").glob("*.yaml"))


def test_there_are_three_recipes():
    assert {p.stem for p in RECIPES} >= {"qwen2.5-0.5b-grpo-gsm8k", "qwen2.5-1.5b-grpo-gsm8k", "llama-3.2-1b-ppo-gsm8k"}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_dry_run(recipe):
    header = recipe.read_text().splitlines()[:6]
    assert any(line.startswith("# Intended hardware:") for line in header)
    assert any(line.startswith("# Launch: verl train --config") for line in header)
    result = run_cli(["train", "--dry-run", "--config", str(recipe)])
    assert result.returncode == 0, result.stderr
    out = " ".join(result.stderr.split())
    assert "config OK" in out and "context" in out and "model state per worker" in out


def test_dry_run_catches_a_context_overflow(tmp_path):
    recipe = next(p for p in RECIPES if p.stem.startswith("qwen2.5-0.5b"))
    result = run_cli(["train", "--dry-run", "--config", str(recipe), "data.max_response_length=40000"])
    assert result.returncode == 1 and "exceeds the model's context (32768 positions" in " ".join(result.stderr.split())

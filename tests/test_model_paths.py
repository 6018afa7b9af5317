"""Model paths: a mistyped local path fails at once as "no such directory", never as a Hub download; a hub id
fails in seconds, with the reason, when the Hub cannot be asked."""

from __future__ import annotations

import pytest

from tests.trainer_utils import run_cli
from verl.errors import ModelError
from verl.models.loader import looks_local, resolve_model_path

pytestmark = pytest.mark.e2e  # a real process, server, cluster or trainer run: `make test-fast` skips it


def test_paths_that_look_local(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "exports" / "grpo-a").mkdir(parents=True)
    assert looks_local("./model") and looks_local("~/m") and looks_local("/abs/m") and looks_local("a/b/c")
    assert looks_local("exports/grpo-typo")  # ./exports exists: a local path, not the hub org "exports"
    assert not looks_local("Qwen/Qwen2.5-0.5B-Instruct") and not looks_local("gpt2")
    with pytest.raises(ModelError, match=r"'exports/grpo-typo': no such directory; did you mean 'exports/grpo-a'"):
        resolve_model_path("exports/grpo-typo")


def test_hub_id_offline_fails_in_seconds(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty HF cache
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError, match="HF_HUB_OFFLINE is set"):  # offline: no request, so no retries
        resolve_model_path("someorg/not-cached-model")


def test_hub_id_with_no_route_fails_in_seconds(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    with pytest.raises(ModelError, match=r"the Hub \(127.0.0.1\) cannot be reached"):
        resolve_model_path("someorg/not-cached-model")


@pytest.mark.parametrize("args,env", [
    (["train", "model.path=exports/grpo-typo"], {}),
    (["eval", "--ckpt", "exports/grpo-typo"], {}),
    (["export", "--ckpt", "exports/grpo-typo", "--to", "out"], {}),
])
def test_the_cli_names_the_missing_directory_at_once(tmp_path, args, env):
    """A path-like name is a missing directory, never a Hub id to retry: with the Hub pointed at a port nothing
    listens on, a lookup would end in "cannot be reached", not in the directory's name (no wall-clock bound: a
    loaded CI box took 34 s to start the CLI three times over)."""
    (tmp_path / "exports").mkdir()
    result = run_cli(args, cwd=tmp_path, env={**env, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "0"})
    assert result.returncode == 1, result.stderr
    assert "no such directory" in result.stderr and "Traceback" not in result.stderr
    assert "cannot be reached" not in result.stderr and "HF_HUB_OFFLINE" not in result.stderr


def test_a_missing_warm_start_is_a_command_to_run_never_a_training_run(tmp_path, monkeypatch):
    """Loading a model never trains one: without the shipped asset (and no rebuilt copy) the error names the
    command that rebuilds it."""
    from verl.models import loader

    monkeypatch.setattr(loader, "ASSETS_DIR", tmp_path / "assets")
    monkeypatch.setenv("VERL_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ModelError, match=r"builtin:tiny-arith: the shipped weights are missing .* "
                                         r"`verl sft --build-warm-start --warm-start tiny-arith`"):
        loader.resolve_model_path("builtin:tiny-arith")

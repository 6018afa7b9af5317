"""Service settings: env over serve.yaml over defaults; unknown or invalid values are errors that name them."""

from __future__ import annotations

import pytest

from serve.settings import load_settings
from verl.errors import ConfigError

pytestmark = pytest.mark.e2e  # a real process, server, cluster or trainer run: `make test-fast` skips it


def test_defaults_bind_loopback_and_keep_cors_off(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    settings = load_settings()
    assert settings.model == "builtin:tiny-arith" and settings.host == "127.0.0.1"
    assert settings.cors_allow_origins == [] and settings.api_key is None
    assert settings.model_name() == "tiny-arith"


def test_env_overrides_yaml_which_overrides_defaults(monkeypatch, tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("max_batch_size: 4\nmax_queue_size: 9\nmodel: /models/a\n")
    monkeypatch.setenv("VERL_SERVE_CONFIG", str(config))
    monkeypatch.setenv("VERL_SERVE_MAX_BATCH_SIZE", "16")
    monkeypatch.setenv("VERL_SERVE_CORS_ALLOW_ORIGINS", '["https://a.example"]')
    settings = load_settings()
    assert settings.max_batch_size == 16  # env wins
    assert settings.max_queue_size == 9  # from the file
    assert settings.model_name() == "a"
    assert settings.cors_allow_origins == ["https://a.example"]
    assert load_settings(max_batch_size=2).max_batch_size == 2  # explicit arguments win over both


def test_serve_yaml_in_the_working_directory_is_picked_up(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "serve.yaml").write_text("engine: transformers\nrequest_timeout_s: 5\n")
    settings = load_settings()
    assert settings.engine == "transformers" and settings.request_timeout_s == 5


def test_unknown_keys_and_bad_values_are_named(monkeypatch, tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("max_batch: 4\n")
    with pytest.raises(ConfigError, match="unknown setting 'max_batch'.*max_batch_size"):
        load_settings(config)
    monkeypatch.setenv("VERL_SERVE_MAX_BATCH_SIZE", "0")
    with pytest.raises(ConfigError, match="max_batch_size: Input should be greater than or equal to 1"):
        load_settings()
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(tmp_path / "nope.yaml")


def test_empty_api_key_means_no_key(monkeypatch):
    monkeypatch.setenv("VERL_SERVE_API_KEY", "")
    assert load_settings().api_key is None
    monkeypatch.setenv("VERL_SERVE_API_KEY", "zq-secret-9")
    settings = load_settings()
    assert settings.api_key.get_secret_value() == "zq-secret-9" and "zq-secret-9" not in repr(settings)


def test_model_source_follows_the_settings_precedence(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("VERL_SERVE_MODEL", raising=False)
    monkeypatch.delenv("VERL_SERVE_CONFIG", raising=False)
    assert load_settings().model_source == "default"
    (tmp_path / "serve.yaml").write_text("model: /models/a\n")
    assert load_settings().model_source == "serve.yaml"
    monkeypatch.setenv("VERL_SERVE_MODEL", "/models/b")
    assert load_settings().model_source == "env VERL_SERVE_MODEL"
    assert load_settings(model="/models/c").model_source == "argument"


@pytest.mark.parametrize("env,line,source", [
    ({}, "no model configured; serving the built-in builtin:tiny-arith", "default"),
    ({"VERL_SERVE_MODEL": "builtin:tiny-arith"}, "serving builtin:tiny-arith (from env VERL_SERVE_MODEL)",
     "env VERL_SERVE_MODEL"),
])
def test_uvicorn_names_the_model_and_its_source(monkeypatch, env, line, source):
    import httpx

    from tests.serve.helpers import run_server_process, wait_healthy

    monkeypatch.delenv("VERL_SERVE_MODEL", raising=False)
    with run_server_process({"VERL_SERVE_ENGINE": "transformers", **env}) as (url, proc):
        health = wait_healthy(url).json()
        assert (health["model"], health["model_source"]) == ("tiny-arith", source)
        assert httpx.get(url + "/v1/models").json()["data"][0]["source"] == source
    assert line in proc.stdout.read()


def test_a_serve_yaml_in_the_working_directory_cannot_turn_on_remote_code(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("VERL_SERVE_CONFIG", raising=False)
    monkeypatch.delenv("VERL_SERVE_TRUST_REMOTE_CODE", raising=False)
    (tmp_path / "serve.yaml").write_text("trust_remote_code: true\n")
    with pytest.raises(ConfigError, match="found in the working directory.*VERL_SERVE_TRUST_REMOTE_CODE=true"):
        load_settings()
    monkeypatch.setenv("VERL_SERVE_CONFIG", str(tmp_path / "serve.yaml"))  # named explicitly: allowed
    settings = load_settings()
    assert settings.trust_remote_code and settings.config_file == tmp_path / "serve.yaml"

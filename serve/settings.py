"""Service settings: environment variables (``VERL_SERVE_*``) over an optional ``serve.yaml`` over defaults.

    VERL_SERVE_MODEL=exports/grpo-a VERL_SERVE_MAX_BATCH_SIZE=16 uvicorn serve.api:app --host 127.0.0.1

The YAML file is ``$VERL_SERVE_CONFIG`` when set, else ``./serve.yaml`` when it exists. Its keys are the field names
below (``max_batch_size: 16``); an unknown key is an error that names it, so a typo never silently falls back to a
default. Every field documents itself in ``docs/serving.md`` (generated from the descriptions here).
"""

from __future__ import annotations

import contextvars
import json
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, YamlConfigSettingsSource

from verl.config import check_judge_rubric
from verl.errors import ConfigError

ENV_PREFIX = "VERL_SERVE_"
DEFAULT_CONFIG_FILE = "serve.yaml"
# The YAML file for the settings object being built; a context variable (not a global) so concurrent builds
# with different files (tests, several apps in one process) never see each other's file.
_CONFIG_FILE: contextvars.ContextVar[Path | None] = contextvars.ContextVar("serve_config_file", default=None)


class ModelEntry(BaseModel):
    """One servable model: a full model (``path``) or a LoRA adapter (``adapter``) over a full model's weights."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="The id clients send in `model` and see in /v1/models.", min_length=1)
    path: str | None = Field(None, description="An export / checkpoint HF dir, builtin:NAME or a .gguf file.")
    adapter: str | None = Field(
        None, description="A PEFT LoRA adapter dir (adapter_config.json), served over `base` without merging.")
    base: str | None = Field(
        None, description="For an adapter: the name of the full model entry it applies to (default: the first).")
    kind: Literal["chat", "reward"] = Field(
        "chat", description="chat: generates (completions, chat); reward: a sequence classifier (`verl rm`'s "
        "checkpoints) that scores texts on /classify and /pooling.")

    @model_validator(mode="after")
    def _one_source(self) -> ModelEntry:
        if (self.path is None) == (self.adapter is None):
            raise ValueError(f"model '{self.name}': give exactly one of 'path' (a full model) or 'adapter' (a LoRA "
                             "adapter dir)")
        if self.path is not None and self.base is not None:
            raise ValueError(f"model '{self.name}': 'base' applies to adapters only")
        if self.kind == "reward" and self.path is None:
            raise ValueError(f"model '{self.name}': a reward model is served from 'path' (a `verl rm` checkpoint or "
                             "export), not as an adapter")
        return self


class LiveScoringSettings(BaseModel):
    """``score_traffic``: a reward model or a chat judge scores a sample of the answers the service gives
    (serve/live_scoring.py)."""

    model_config = ConfigDict(extra="forbid")

    scorer: str = Field(min_length=1, description="A reward model served here (a `kind: reward` entry's name), one "
                        "behind a URL (`http://host:port#NAME`, its /classify), or a chat model judging by a rubric "
                        "behind a URL (`judge:http://host:port#NAME`, its /v1/chat/completions). Rewards are "
                        "recorded with `reward_source: rm:NAME` or `judge:NAME`.")
    fraction: float = Field(1.0, gt=0.0, le=1.0, description="The share of answered requests scored (drawn per "
                            "request).")
    routes: list[str] = Field(default_factory=list, description="Only requests to these routes (empty: every "
                              "request).")
    score: Literal["probability", "logit"] = Field("probability", description="A reward model: the classifier's "
                                                   "probability in [0, 1] (what the canary's betting test needs) or "
                                                   "its logit.")
    rubric: str | None = Field(None, description="A chat judge: the rubric file (pointwise: {open} and {close} "
                               "name the answer's markers, {low} and {high} the scale); default: the built-in one.")
    scale: tuple[float, float] = Field((1.0, 10.0), description="A chat judge: the rubric's score scale, mapped to "
                                       "[0, 1].")
    max_tokens: int = Field(256, ge=1, description="A chat judge: tokens of its reply (its reasoning, then "
                            "`Score: N`).")
    api_key_env: str | None = Field(None, description="A scorer behind a URL: the environment variable holding "
                                    "its API key.")
    max_pending: int = Field(1024, ge=1, description="Answers waiting to be scored at most; more are not scored "
                             "(counted as dropped): scoring never slows the answers down.")
    batch_size: int = Field(16, ge=1, description="Answers scored in one forward (or one remote call); a chat "
                            "judge: answers judged at once.")
    timeout_s: float = Field(30.0, gt=0, description="A scorer behind a URL: seconds per call before a retry.")

    @model_validator(mode="after")
    def _check(self) -> LiveScoringSettings:
        if self.is_judge and "://" not in self.scorer:
            raise ValueError(f"score_traffic.scorer: '{self.scorer}': a chat judge generates, and would take the "
                             "served models' slots from users; serve it apart and give its URL: "
                             "judge:http://host:port#NAME")
        if self.rubric is not None and not self.is_judge:
            raise ValueError("score_traffic.rubric applies to a chat judge (scorer: judge:URL#NAME); a reward model "
                             "needs none")
        check_judge_rubric(self.rubric, self.scale, "score_traffic")
        return self

    @property
    def is_judge(self) -> bool:
        return self.scorer.startswith("judge:")

    @property
    def remote(self) -> tuple[str, str | None] | None:
        """(URL, model name) of a scorer behind a URL (a reward model's or a judge's), else None."""
        where = self.scorer.removeprefix("judge:")
        if "://" not in where:
            return None
        url, _, name = where.partition("#")
        return url, name or None

    @property
    def source(self) -> str:
        """The reward_source its rewards are recorded with."""
        remote = self.remote
        name = self.scorer if remote is None else (remote[1] or "remote")
        return f"judge:{name}" if self.is_judge else f"rm:{name}"


def is_reward_model(path: str) -> bool:
    """Whether ``path`` is a sequence classifier (a ``verl rm`` checkpoint or export): its config.json names a
    ``*ForSequenceClassification`` architecture. Built-in names and GGUF files are generative models."""
    config = Path(path).expanduser() / "config.json"
    if path.startswith("builtin:") or not config.is_file():
        return False
    try:
        architectures = json.loads(config.read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return False
    return any(str(a).endswith("ForSequenceClassification") for a in architectures)


# Served beside the default model when no model is configured: its chat template renders tools (issue 25).
DEFAULT_TOOL_MODEL = "builtin:tiny-agent"


class ServeSettings(BaseSettings):
    """Everything the inference service can be told. Env var = ``VERL_SERVE_`` + field name in upper case."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", validate_default=True)

    # ---------------------------------------------------------------- model and engine
    model: str = Field("builtin:tiny-arith", description="Model to serve: an export/checkpoint HF dir or builtin:NAME.")
    served_model_name: str | None = Field(
        None, description="Name clients use in the `model` field (default: the model dir's name or builtin name)."
    )
    engine: Literal["auto", "transformers", "vllm"] = Field(
        "auto", description="Generation engine; auto = vllm when importable, else transformers."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Weights dtype.")
    device: str = Field("auto", description="transformers engine device: auto, cpu, cuda, cuda:1, ...")
    trust_remote_code: bool = Field(False, description="Run model code shipped in the model dir.")
    torch_threads: int = Field(1, ge=1, description="torch intra-op threads (1 is fastest on small shared CPUs).")
    seed: int = Field(0, description="Seed of the engine's sampler for requests that give no `seed`.")


    # ---------------------------------------------------------------- several models, routes, admin
    models: list[ModelEntry] = Field(
        default_factory=list, description="Several models in one service (replaces `model`): a list of {name, path} "
        "and {name, adapter, base} entries; adapters share their base's weights in memory.",
    )
    routes: dict[str, dict[str, float]] = Field(
        default_factory=dict, description="Route name -> {model: weight}; a request whose `model` is the route goes "
        "to one of them by weight, sticky per `user` (or the X-Verl-User header). The route `default` also takes "
        "requests that name no model.",
    )
    admin_api_key: SecretStr | None = Field(
        None, description="Turns on /admin/* (route weights, load and unload models) for `Authorization: Bearer "
        "<this key>`; unset: the admin endpoints do not exist.",
    )
    state_path: str | None = Field(
        None, description="Save the served models and routes here (JSON, atomically) after every admin change, and "
        "start from it when it exists (over `models`/`routes`), so a restart keeps the last promote.",
    )
    records_path: str | None = Field(
        None, description="Append one JSON line per finished request (model, route, prompt hash, latency, tokens, "
        "reward) here, for `verl compare --online FILE`; the last 10000 are also kept in memory for /admin/records.",
    )
    records_retention_s: float = Field(
        7 * 86_400.0, gt=0, description="How long records are kept (in memory, in records_path, which is rewritten "
        "without older rows at start and hourly) and so how long feedback on an answer is accepted.",
    )
    records_max_completions: int = Field(
        200_000, ge=1, description="Answers whose ids are remembered for feedback (the oldest are forgotten first: "
        "feedback on them then gets 410).",
    )
    record_texts: bool = Field(
        False, description="Keep each request's prompt (chat messages or prompt, as sent) and its answer in the "
        "records, for the data export and trace replay; off by default: texts may hold personal data.",
    )
    record_texts_max_chars: int = Field(
        16_000, ge=0, description="record_texts: a prompt or answer longer than this is cut (and the row says so).",
    )
    records_not_for_training: bool = Field(
        False, description="Mark every request not for training (as a client does with verl.not_for_training): "
        "`verl data from-records` never exports them.",
    )
    feedback_rate_limit: float = Field(
        20.0, gt=0, description="POST /v1/feedback calls per second per API key (or client address without one); "
        "more get 429.",
    )
    score_traffic: LiveScoringSettings | None = Field(
        None, description="Score a sample of the answers with a reward model or a chat judge, in the background "
        "(never on a user's latency path, never in a user's queue slot), into the records as `reward_source: "
        "rm:NAME` / `judge:NAME`: {scorer, fraction, routes, score, rubric, scale, max_pending, batch_size}.",
    )
    feedback_burst: int = Field(40, ge=1, description="Feedback calls a key may send at once before the rate applies.")
    feedback_max_comment_chars: int = Field(2_000, ge=0, description="Longest feedback comment accepted (a 400 after).")

    fault_error_rate: float | dict[str, float] = Field(
        0.0, description="Test-only fault injection: fail this share of requests as an engine error would (500, an "
        "error row in the records); a number for every model, or {model: rate} with '*' for the rest.",
    )

    # ---------------------------------------------------------------- capacity and limits
    max_batch_size: int = Field(32, ge=1, le=4096, description="Sequences decoded together in one forward pass.")
    shared_prefix_tokens: int = Field(
        16, ge=0, description="transformers engine: prompts prefilled together that start with the same N or more "
        "tokens (a chat template's system prompt) compute that prefix once for all of them; 0 turns it off.")
    prefix_cache_entries: int = Field(
        8, ge=0, description="transformers engine: prefixes of at least shared_prefix_tokens that two prompts shared "
        "are kept (their keys and values) for later prefills, up to this many (least recently used out); 0 off.")
    max_queue_size: int = Field(
        256, ge=0, description="Sequences allowed to wait for a batch slot; beyond it requests get 429 + Retry-After."
    )
    max_prompt_tokens: int | None = Field(
        None, ge=1, description="Longest prompt accepted (default: the model's context length minus one)."
    )
    max_output_tokens: int = Field(512, ge=1, description="Largest `max_tokens` a request may ask for.")
    default_max_tokens: int = Field(64, ge=1, description="`max_tokens` when a request gives none.")
    max_n: int = Field(8, ge=1, description="Largest `n` (completions per prompt) a request may ask for.")
    max_prompts_per_request: int = Field(32, ge=1, description="Largest list of prompts in one /v1/completions call.")
    max_score_inputs: int = Field(256, ge=1, description="Largest list of inputs in one /classify or /pooling call "
                                  "(reward models: one forward per 32, no generation).")
    max_body_bytes: int = Field(2 * 1024 * 1024, ge=1024,
                                description="Largest request body; bigger ones get 413 before they are read.")
    request_timeout_s: float = Field(120.0, gt=0, description="A request still generating after this gets 504.")
    body_timeout_s: float = Field(
        30.0, gt=0, description="A request body that stops arriving for this long gets 408 and the connection closes."
    )
    header_timeout_s: float = Field(
        10.0, gt=0, description="`verl serve` only: a connection whose request headers are not complete after this "
        "is closed (uvicorn itself waits forever; behind `uvicorn serve.api:app` use a proxy's header timeout).",
    )
    keep_alive_timeout_s: float = Field(
        5.0, gt=0, description="`verl serve` only: an idle kept-alive connection is closed after this.",
    )
    retry_after_s: int = Field(1, ge=0, description="Retry-After seconds sent with 429/503.")
    shutdown_timeout_s: float = Field(
        15.0, ge=0, description="On shutdown, in-flight requests get this long to finish before they are aborted."
    )
    drain_grace_s: float = Field(
        0.0, ge=0, description="After SIGTERM, answer /health and new requests with 503 this long before stopping "
        "(lets a load balancer take the instance out first).",
    )
    load_in_background: bool = Field(
        True, description="Accept connections while the model loads (/health answers 503 until ready)."
    )

    # ---------------------------------------------------------------- security
    api_key: SecretStr | None = Field(
        None, description="When set, /v1/*, /generate, /tokenize, /detokenize need `Authorization: Bearer <key>`."
    )
    training_api_key: SecretStr | None = Field(
        None, description="The key of training traffic (issue 64's gateway): a request with this bearer key and an "
        "episode id (`X-Session-ID` header or `verl.episode_id`) is recorded with its prompt ids as rendered, its "
        "sampled ids and log-probs and the weight version; it is also accepted wherever the API key is.")
    training_max_slots_share: float = Field(
        0.5, gt=0.0, le=1.0, description="Training traffic holds at most this share of the sequence slots "
        "(max_batch_size + max_queue_size); past it a training request is a 429 and user traffic keeps the rest. "
        "In the transformers engine also of the decode rows (max_batch_size): user requests are admitted ahead of "
        "training ones that would exceed it.")
    metrics_public: bool = Field(
        False, description="With an API key set, still serve /metrics without it (for scrapers that send no header)."
    )
    cors_allow_origins: list[str] = Field(
        default_factory=list, description="Origins allowed by CORS (empty: CORS off; other origins blocked)."
    )

    # ---------------------------------------------------------------- vLLM engine
    vllm_kv_cache_gib: float = Field(1.0, gt=0, description="vLLM CPU KV cache size (VLLM_CPU_KVCACHE_SPACE, GiB).")
    vllm_enforce_eager: bool = Field(True, description="vLLM: skip graph compilation (starts in ~15 s, not ~45 s).")
    vllm_max_model_len: int | None = Field(None, ge=1, description="vLLM max_model_len (default: the model's).")
    vllm_max_loras: int = Field(4, ge=1, description="vLLM: LoRA adapters in one batch (when adapters are served).")
    vllm_max_lora_rank: int = Field(64, ge=1, description="vLLM: the largest LoRA rank it accepts.")

    # ---------------------------------------------------------------- `verl serve` only
    host: str = Field("127.0.0.1", description="`verl serve` bind address (loopback unless you mean otherwise).")
    port: int = Field(8000, ge=0, le=65535, description="`verl serve` port.")

    # Where `model` came from ("env VERL_SERVE_MODEL", "serve.yaml (<path>)", "argument", "default"); see load_settings.
    _model_source: str = PrivateAttr("default")
    _config_file: Path | None = PrivateAttr(None)

    @property
    def model_source(self) -> str:
        return self._model_source

    @property
    def config_file(self) -> Path | None:
        """The serve.yaml these settings read, if any (logged at startup)."""
        return self._config_file

    @field_validator("api_key", "admin_api_key", "training_api_key")
    @classmethod
    def _empty_key_is_none(cls, value: SecretStr | None) -> SecretStr | None:
        # `VERL_SERVE_API_KEY=` (empty) must not mean "the key is the empty string".
        return value if value is not None and value.get_secret_value() else None

    @field_validator("fault_error_rate")
    @classmethod
    def _rates_in_range(cls, value: float | dict[str, float]) -> float | dict[str, float]:
        for name, rate in (value.items() if isinstance(value, dict) else [("", value)]):
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"fault_error_rate{f'[{name}]' if name else ''} is a share of requests: 0 to 1 "
                                 f"(got {rate})")
        return value

    @model_validator(mode="after")
    def _check_models_and_routes(self) -> ServeSettings:
        names = [m.name for m in self.models]
        duplicated = sorted({n for n in names if names.count(n) > 1})
        if duplicated:
            raise ValueError(f"models: the name '{duplicated[0]}' is used twice; names must be unique")
        full = [m.name for m in self.models if m.path is not None and m.kind == "chat"]
        if any(m.adapter is not None for m in self.models) and not full:
            raise ValueError("models: adapters need a full model to apply to; add an entry with 'path'")
        for m in self.models:
            if m.adapter is not None and m.base is not None and m.base not in full:
                raise ValueError(f"models: '{m.name}' names base '{m.base}', which is not a full model entry "
                                 f"(full models: {', '.join(full)})")
        reward = {m.name for m in self.models if m.kind == "reward"}
        for route, weights in self.routes.items():
            scorers = sorted(reward & set(weights))
            if scorers:
                raise ValueError(f"routes.{route}: '{scorers[0]}' is a reward model; routes send chat and "
                                 "completion requests, which reward models do not answer")
        live = self.score_traffic
        if live is not None and live.remote is None and self.models and live.scorer not in reward:
            raise ValueError(f"score_traffic.scorer: '{live.scorer}' is not a reward model served here (kind: reward "
                             f"entries: {', '.join(sorted(reward)) or 'none'}); add it to models, or give a URL "
                             "(http://host:port#NAME)")
        known = set(names) or {self.model_name()}
        for route, weights in self.routes.items():
            check_route(route, weights, known)
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Precedence: explicit arguments > environment > YAML file > defaults."""
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        path = _CONFIG_FILE.get()
        if path is not None:
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=path))
        return tuple(sources)

    def records_options(self) -> dict:
        """``serve.records.OnlineRecords``' keyword arguments from these settings."""
        return {"retention_s": self.records_retention_s, "max_completions": self.records_max_completions}

    def model_entries(self) -> list[ModelEntry]:
        """The models to serve: ``models``, or one entry made of ``model`` / ``served_model_name``. With nothing
        configured, the built-in tool-using model is served beside the default one, so the default service
        answers tool-calling requests too (``DEFAULT_TOOL_MODEL``)."""
        if self.models:
            return list(self.models)
        kind = "reward" if is_reward_model(self.model) else "chat"  # VERL_SERVE_MODEL=<a verl rm export>
        entries = [ModelEntry(name=self.model_name(), path=self.model, kind=kind)]
        if self.model_source == "default" and not self.served_model_name:
            entries.append(ModelEntry(name=DEFAULT_TOOL_MODEL.split(":", 1)[1], path=DEFAULT_TOOL_MODEL))
        return entries

    def model_name(self) -> str:
        """The id clients see in /v1/models and send back in `model`."""
        if self.served_model_name:
            return self.served_model_name
        if self.model.startswith("builtin:"):
            return self.model.split(":", 1)[1]
        return Path(self.model).name or self.model


def check_route(route: str, weights: dict[str, float], known: set[str]) -> None:
    """Raise ``ValueError`` naming what is wrong with one route's weights."""
    if route in known:
        raise ValueError(f"routes: '{route}' is also a model name; a route needs a name of its own")
    if not weights:
        raise ValueError(f"routes.{route}: give at least one model with a weight")
    for name, weight in weights.items():
        if name not in known:
            raise ValueError(f"routes.{route}: unknown model '{name}' (models: {', '.join(sorted(known))})")
        if not weight >= 0 or weight == float("inf"):
            raise ValueError(f"routes.{route}.{name}: the weight must be a finite number >= 0 (got {weight})")
    if sum(weights.values()) <= 0:
        raise ValueError(f"routes.{route}: the weights sum to 0; at least one must be > 0")


def config_file_path(config_file: str | os.PathLike | None = None) -> Path | None:
    """The YAML file to read: the argument, else ``$VERL_SERVE_CONFIG``, else ``./serve.yaml`` if present."""
    named = config_file or os.environ.get("VERL_SERVE_CONFIG")
    if named:
        path = Path(named).expanduser()
        if not path.is_file():
            raise ConfigError(f"serve config file '{path}' does not exist (from VERL_SERVE_CONFIG or --config)")
        return path
    default = Path(DEFAULT_CONFIG_FILE)
    return default if default.is_file() else None


def load_settings(config_file: str | os.PathLike | None = None, **overrides: Any) -> ServeSettings:
    """Build settings from ``overrides`` > env > YAML > defaults; any invalid value raises one ``ConfigError``."""
    path = config_file_path(config_file)
    token = _CONFIG_FILE.set(path)
    try:
        settings = ServeSettings(**overrides)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, path)) from None
    finally:
        _CONFIG_FILE.reset(token)
    settings._model_source = _model_source(overrides, path)
    settings._config_file = path
    implicit = path is not None and not (config_file or os.environ.get("VERL_SERVE_CONFIG"))
    if implicit and settings.trust_remote_code and "trust_remote_code" not in overrides \
            and not os.environ.get(ENV_PREFIX + "TRUST_REMOTE_CODE"):
        # A serve.yaml that merely lies in the working directory must not turn on running the model's own code.
        raise ConfigError(f"{path} (found in the working directory) sets trust_remote_code; running a model's own "
                          f"code needs an explicit setting: {ENV_PREFIX}TRUST_REMOTE_CODE=true, or name the file "
                          "with VERL_SERVE_CONFIG")
    return settings


def _model_source(overrides: dict[str, Any], path: Path | None) -> str:
    """Which layer chose ``model`` (the same precedence as the settings sources)."""
    if "model" in overrides:
        return "argument"
    if os.environ.get(ENV_PREFIX + "MODEL"):
        return f"env {ENV_PREFIX}MODEL"
    if path is not None:
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except (yaml.YAMLError, OSError):
            data = {}
        if isinstance(data, dict) and "model" in data:
            return f"{path}"
    return "default"


def _describe(exc: ValidationError, path: Path | None) -> str:
    where = f"env {ENV_PREFIX}*" + (f" or {path}" if path else "")
    problems = []
    for error in exc.errors():
        field = ".".join(str(p) for p in error["loc"]) or "settings"
        if error["type"] == "extra_forbidden":
            known = ", ".join(sorted(ServeSettings.model_fields))
            problems.append(f"unknown setting '{field}' (known: {known})")
        else:
            problems.append(f"{field}: {error['msg']} (got {error.get('input')!r})")
    return f"invalid serve settings ({where}): " + "; ".join(problems)

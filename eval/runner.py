"""``verl eval``: generate once, score once, compute log-probs once, run every evaluator, write the results.

    from eval.runner import EvalSettings, run_eval
    run_eval("outputs/verl/grpo-a/checkpoints/global_step_60", EvalSettings())   # one checkpoint
    run_eval("outputs/verl/grpo-a", EvalSettings())                              # every checkpoint + best

What is evaluated and how, when the checkpoint belongs to a run (``<run>/checkpoints/global_step_N``):
the run's ``config.yaml`` supplies the defaults — validation files, prompt/ground-truth keys, chat template,
``max_response_length``, the validation sampling (``rollout.val_kwargs``: greedy by default), ``trainer.seed``,
``data.val_batch_size`` / ``val_max_samples``, the reward function, and the reference model (``model.path``, the
run's initial weights). The generation loop is the trainer's validation loop (same dataset collation, batch
boundaries, engine and reward manager), so ``eval/accuracy`` equals the trainer's ``eval/accuracy`` for the same
checkpoint. Anything given explicitly (``--data``, ``--n``, ``--temperature`` ...) overrides the run.

Outputs (``<run>/eval/<checkpoint>/`` or ``--out``): ``results.json`` (metrics with SE and 95% CI, sampling
settings, data, model hash, config, versions, timing), ``samples.jsonl`` (one row per response with every
per-sample value), ``report.md``, ``report.html`` and PNG plots. On a run dir also the table of all
checkpoints, ``best.json`` (``--select eval/accuracy:max``) and metric-vs-step plots.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
from peft import PeftModel
from pydantic import ValidationError
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

import verl.config as config_module
from eval import contamination as contamination_check
from eval.groups import group_lines, group_results
from eval.pairwise import evaluate_reward_model
from eval.report import write_checkpoint_report, write_run_report
from eval.results import (
    METRIC_PREFIX,
    SCHEMA,
    load_samples,
    model_hash,
    parse_select,
    reusable_results,
    versions,
    write_results,
    write_run_summary,
)
from eval.settings import EvalSettings
from verl.batch import jsonable
from verl.config import DataConfig, RewardConfig, RolloutConfig, SFTConfig, ValidationSampling, build_config, load_yaml
from verl.data.dataset import RLHFDataset
from verl.errors import CheckpointError, ConfigError
from verl.evaluators import EvalBatch, Metric, build_evaluator, build_evaluators, run_evaluators
from verl.evaluators.groups import AUTO_GROUP_COLUMN, group_labels, has_column
from verl.evaluators.kl_terms import compute_kl_terms
from verl.evaluators.registry import BUILTIN_EVALUATORS, evaluator_needs, split_specs
from verl.models.loader import check_hub_id, load_causal_lm, load_tokenizer, looks_local, missing_dir_error, pick_device
from verl.protocol import DataProto, pad_responses
from verl.rollout.agent_loop import AgentRollout
from verl.rollout.base import EngineSpec, SamplingParams, build_rollout
from verl.tools.templates import ToolPrompting
from verl.trainer.checkpoint import STEP_DIR, list_checkpoints
from verl.utils.seeding import set_num_threads
from verl.workers.reward import RewardManager, decode_responses

# ---------------------------------------------------------------------------------------------- settings


@dataclass
class Resolved:
    """Settings after the run's config filled the gaps; ``fingerprint`` identifies results that can be reused."""

    data_files: list[str]
    evaluator_specs: list[str]
    n: int
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    seed: int
    batch_size: int
    max_samples: int | None
    reference: str | None
    engine: str
    max_prompt_length: int = 64
    multi_turn: dict[str, Any] | None = None  # rollout.multi_turn's fields when the rollouts are agent loops
    notes: list[str] = field(default_factory=list)
    # Where max_samples came from ("--max-samples" or "the run's data.val_max_samples"), said when it caps the data.
    max_samples_from: str | None = None

    @property
    def sampling(self) -> dict[str, Any]:
        return {"n": self.n, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "max_new_tokens": self.max_new_tokens, "seed": self.seed, "greedy": self.temperature == 0.0,
                "engine": self.engine, "batch_size": self.batch_size}

    @property
    def fingerprint(self) -> str:
        # A single-turn evaluation hashes as it did before multi-turn existed, so its cached results stay valid.
        payload = {k: v for k, v in asdict(self).items()
                   if k not in ("notes", "max_samples_from") and not (k == "multi_turn" and v is None)}
        return hashlib.sha1(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]

    @property
    def results_settings(self) -> dict[str, Any]:
        """What decides the numbers (data and sampling): results under other values are never mixed with these."""
        return {k: getattr(self, k) for k in RESULT_SETTINGS if not (k == "multi_turn" and self.multi_turn is None)}

    @property
    def settings_tag(self) -> str:
        """A directory name for these results settings: ``greedy-n1-<hash>`` / ``t1-n8-<hash>``."""
        digest = hashlib.sha1(json.dumps(self.results_settings, sort_keys=True, default=str).encode()).hexdigest()
        sampling = "greedy" if self.temperature == 0.0 else f"t{self.temperature:g}"
        return f"{sampling}-n{self.n}-{digest[:8]}"


# The settings that change an evaluation's numbers. Results under different values live in different directories,
# and selecting the best checkpoint only compares results made under one of them.
RESULT_SETTINGS = ("data_files", "n", "temperature", "top_p", "top_k", "max_new_tokens", "seed", "max_samples",
                   "engine", "max_prompt_length", "multi_turn")


def results_root(run_dir: Path, resolved: Resolved, run_cfg: Any) -> Path:
    """Where a run's results under ``resolved`` go: ``<run>/eval/`` for the run's own validation settings (what the
    trainer reported and what ``verl export --select best`` and ``verl compare`` rank by), ``<run>/eval/<tag>/``
    for any other data or sampling settings, so e.g. a sampled pass@k evaluation never overwrites the greedy one."""
    return run_dir / "eval" if is_run_default(resolved, run_cfg) else run_dir / "eval" / resolved.settings_tag


def is_run_default(resolved: Resolved, run_cfg: Any) -> bool:
    """Whether ``resolved`` evaluates with the run's own validation data and sampling."""
    return resolved.results_settings == resolve_settings(EvalSettings(), run_cfg, None).results_settings


# ---------------------------------------------------------------------------------------------- targets


@dataclass
class CheckpointRef:
    """What ``--ckpt`` named: a run dir, a checkpoint of a run, or a bare model (HF dir / builtin:NAME / hub id)."""

    kind: str  # "run" | "checkpoint" | "model"
    path: str
    run_dir: Path | None = None
    step: int | None = None

    @property
    def label(self) -> str:
        if self.kind == "checkpoint":
            return Path(self.path).name
        return Path(self.path).name or self.path.replace(":", "-")


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.yaml").is_file() and (
        (path / "checkpoints").is_dir() or (path / "verl_logs.jsonl").is_file())


def resolve_target(spec: str | Path) -> CheckpointRef:
    text = str(spec)
    path = Path(text).expanduser()
    if path.is_dir():
        if is_run_dir(path):
            return CheckpointRef("run", str(path), run_dir=path)
        if (path / "config.json").is_file() or (path / "adapter_config.json").is_file():
            run = path.parent.parent if path.parent.name == "checkpoints" else None
            match = STEP_DIR.match(path.name)
            if run is not None and (run / "config.yaml").is_file():
                return CheckpointRef("checkpoint", str(path), run_dir=run, step=int(match.group(1)) if match else None)
            return CheckpointRef("model", str(path))
        if (path / "results.json").is_file():
            raise ConfigError(f"'{path}' holds evaluation results, not a model; `verl compare` reads those, "
                              "`verl eval --ckpt` needs a checkpoint or run directory")
        raise CheckpointError(
            f"'{path}' is neither a checkpoint (no config.json / adapter_config.json) nor a run directory "
            "(config.yaml + checkpoints/); point --ckpt at <run> or <run>/checkpoints/global_step_N"
        )
    if text.startswith("builtin:"):
        return CheckpointRef("model", text)
    if path.exists():
        raise CheckpointError(f"--ckpt '{text}' is not a directory; give a checkpoint dir, a run dir or builtin:NAME")
    if looks_local(text):
        raise missing_dir_error(text, "--ckpt")
    return CheckpointRef("model", check_hub_id(text))  # a hub id: fails in seconds when the Hub cannot be asked


def load_run_config(run_dir: Path | None) -> tuple[Any, dict | None, list[str]]:
    """``(VerlConfig or None, the raw dict, notes)`` from ``<run>/config.yaml``."""
    if run_dir is None:
        return None, None, []

    raw = load_yaml(run_dir / "config.yaml")
    try:
        return build_config(raw, str(run_dir / "config.yaml")), raw, []
    except ConfigError as exc:
        sft = _sft_as_run_config(raw, run_dir)
        if sft is not None:
            return sft, raw, [f"{run_dir} is a `verl sft` run: its model, validation prompts, prompt/response lengths "
                              "and seed are used; sampling is the evaluator's default (greedy)"]
        # A run from an older schema still has checkpoints worth evaluating; use defaults where it does not parse.
        return None, raw, [f"{run_dir / 'config.yaml'} does not match the current schema ({exc}); defaults used"]


def _sft_as_run_config(raw: dict, run_dir: Path) -> Any:
    """A ``verl sft`` run's config seen as a training run's (what evaluation reads from it), or None if it is not
    one."""
    try:
        sft = build_config(raw, str(run_dir / "config.yaml"), schema=SFTConfig)
    except ConfigError:
        return None
    d = sft.data
    return build_config({"model": sft.model.model_dump(), "data": {
        "train_files": d.train_files, "val_files": d.val_files, "val_max_samples": d.val_max_samples,
        "prompt_key": d.prompt_key,
        "ground_truth_key": d.ground_truth_key, "max_prompt_length": d.max_prompt_length,
        "max_response_length": d.max_response_length, "arithmetic": d.arithmetic.model_dump()},
        "rollout": {"multi_turn": sft.rollout.multi_turn.model_dump()}, "trainer": {"seed": sft.trainer.seed}},
        f"{run_dir / 'config.yaml'} (a verl sft run)")


def resolve_settings(settings: EvalSettings, run_cfg: Any, explicit_reference: str | None) -> Resolved:
    data = run_cfg.data if run_cfg is not None else DataConfig()
    val = run_cfg.rollout.val_kwargs if run_cfg is not None else ValidationSampling()
    notes: list[str] = []
    n = settings.n if settings.n is not None else val.n
    temperature = settings.temperature if settings.temperature is not None else val.temperature
    if settings.n is not None and n > 1 and temperature == 0.0 and settings.temperature is None:
        # n identical greedy samples would make pass@k meaningless; sample at temperature 1 unless told otherwise.
        temperature = 1.0
        notes.append(f"n={n} with the run's greedy validation: sampling at temperature 1.0 (pass --temperature)")
    if n < 1:
        raise ConfigError(f"--n must be >= 1, got {n}")
    if temperature < 0:
        raise ConfigError(f"--temperature must be >= 0, got {temperature}")
    reference = explicit_reference or (run_cfg.model.path if run_cfg is not None else None)
    data_files = list(settings.data) if settings.data else list(data.val_files)
    multi_turn = _multi_turn(settings, run_cfg, data_files)
    specs = _evaluator_specs(settings.evaluators, reference, notes, multi_turn is not None)
    seed = settings.seed if settings.seed is not None else (run_cfg.trainer.seed if run_cfg is not None else 0)
    if settings.max_samples is not None:
        max_samples, max_samples_from = settings.max_samples, "--max-samples"
    elif not settings.data and data.val_max_samples is not None:
        max_samples, max_samples_from = data.val_max_samples, "the run's data.val_max_samples"
    else:
        max_samples, max_samples_from = None, None
    return Resolved(
        data_files=data_files,
        evaluator_specs=specs,
        n=n,
        temperature=float(temperature),
        top_p=settings.top_p if settings.top_p is not None else val.top_p,
        top_k=settings.top_k if settings.top_k is not None else val.top_k,
        max_new_tokens=settings.max_new_tokens or data.max_response_length,
        seed=int(seed),
        batch_size=settings.batch_size or data.val_batch_size,
        # The run's val_max_samples caps the run's own validation files; a file the user names is used whole
        # unless --max-samples says otherwise.
        max_samples=max_samples,
        max_samples_from=max_samples_from,
        reference=reference if any(_needs_reference(s) for s in specs) else None,
        engine=settings.engine,
        max_prompt_length=settings.max_prompt_length or data.max_prompt_length,
        multi_turn=multi_turn,
        notes=notes,
    )


def _multi_turn(settings: EvalSettings, run_cfg: Any, data_files: list[str]) -> dict[str, Any] | None:
    """The agent-loop settings: the run's ``rollout.multi_turn`` with ``--tools`` / ``--tool-config`` /
    ``--max-turns`` on top (either of the first two turns multi-turn on, as do an environment's episodes as data:
    openenv:, env:); None for single-turn rollouts."""
    base = run_cfg.rollout.multi_turn if run_cfg is not None else config_module.MultiTurnConfig()
    update: dict[str, Any] = {}
    if settings.tools is not None:
        update["tools"] = list(settings.tools)
    if settings.tool_config is not None:
        update["tool_config_path"] = settings.tool_config
    episodes = any(str(f).startswith(config_module.ENVIRONMENT_SCHEMES) for f in data_files)
    if update or episodes:
        update["enable"] = True
    if settings.max_turns is not None:
        update["max_assistant_turns"] = settings.max_turns
    try:
        merged = config_module.MultiTurnConfig.model_validate({**base.model_dump(), **update})
    except ValidationError as exc:
        problem = exc.errors()[0]
        raise ConfigError(f"--max-turns {settings.max_turns!r}: {problem['msg'].lower()}") from None
    if not merged.enable:
        if settings.max_turns is not None:
            raise ConfigError("--max-turns applies to multi-turn rollouts: give --tools calculator (or "
                              "--tool-config FILE), or evaluate a run trained with rollout.multi_turn")
        return None
    if not (merged.tools or merged.tool_config_path or merged.interaction_config_path or episodes):
        raise ConfigError("multi-turn evaluation needs tools (--tools calculator or --tool-config FILE), the run's "
                          "interaction, or an environment's episodes as --data (openenv:<url>, env:<module>:<Class>)")
    return merged.model_dump(mode="json")


def _needs_reference(spec: str) -> bool:
    return "ref_logprobs" in evaluator_needs(build_evaluator(spec))


def _evaluator_specs(requested: str | list[str] | None, reference: str | None, notes: list[str],
                     multi_turn: bool) -> list[str]:
    if requested is None:  # every built-in, except those that need a reference when there is none
        specs = []
        for cls in BUILTIN_EVALUATORS:
            if "tool_calls" in cls.needs and not multi_turn:
                continue  # single-turn rollouts make no tool calls; nothing to say
            if reference is None and "ref_logprobs" in cls.needs:
                notes.append(f"{cls.name} skipped: no reference model (give --reference, or evaluate a checkpoint "
                             "of a run)")
            else:
                specs.append(cls.name)
    else:
        specs = [e.spec if hasattr(e, "spec") else s for e, s in
                 zip(build_evaluators(requested), _split(requested), strict=True)]
        if not multi_turn and any("tool_calls" in evaluator_needs(build_evaluator(s)) for s in specs):
            raise ConfigError("the tools evaluator measures multi-turn rollouts: give --tools calculator (or "
                              "--tool-config FILE), or evaluate a run trained with rollout.multi_turn.enable")
        if reference is None and any(_needs_reference(s) for s in specs):
            raise ConfigError("the kl evaluator needs a reference model: pass --reference PATH (the model the run "
                              "started from), or evaluate a checkpoint inside a run dir whose config names model.path")
    return specs


def _split(requested: str | list[str]) -> list[str]:
    return split_specs(requested) if isinstance(requested, str) else [s for s in requested if s.strip()]


# ---------------------------------------------------------------------------------------------- models


def load_policy(path: str, run_cfg: Any, device: Any, dtype: str) -> Any:
    """The model at ``path``; a LoRA checkpoint (adapter files only) is applied to its base and merged."""
    local = Path(path)
    if local.is_dir() and (local / "adapter_config.json").is_file() and not (local / "config.json").is_file():
        adapter = json.loads((local / "adapter_config.json").read_text())
        base_path = run_cfg.model.path if run_cfg is not None else adapter.get("base_model_name_or_path")
        if not base_path:
            raise CheckpointError(f"{local} is a LoRA adapter with no base model; evaluate it inside its run dir")
        base = load_causal_lm(base_path, dtype, device)
        return PeftModel.from_pretrained(base, str(local)).merge_and_unload()
    return load_causal_lm(path, dtype, device)


def sample_rows(batch: Any, texts: list[str], scores: Any, columns: dict[str, np.ndarray],
                prompt_ids: list[str]) -> list[dict]:
    """``samples.jsonl``'s rows: one per generated response, keyed by (prompt id, sample number), with its
    reward, an agent's trace and each evaluator's per-sample column."""
    index = np.asarray(batch.non_tensor["index"], dtype=np.int64)
    lengths = batch.batch["response_mask"].sum(-1).tolist()
    rows, seen = [], {}
    for i, text in enumerate(texts):
        k = seen.get(int(index[i]), 0)
        seen[int(index[i])] = k + 1
        row = {"prompt_id": prompt_ids[int(index[i])], "index": int(index[i]), "sample": k,
               "prompt": str(batch.non_tensor["raw_prompt"][i]), "response": text,
               "ground_truth": jsonable(batch.non_tensor["ground_truth"][i]),
               "data_source": str(batch.non_tensor["data_source"][i]), "response_length": int(lengths[i])}
        if scores is not None:
            row["reward"] = float(scores[i])
        if "tool_trace" in batch.non_tensor:  # an agent trajectory: its turns and calls, structured
            row["turns"] = int(batch.non_tensor["num_turns"][i])
            row["finish_reason"] = str(batch.non_tensor["finish_reason"][i])
            row["tool_trace"] = jsonable(list(batch.non_tensor["tool_trace"][i]))
        for name, column in columns.items():
            if name in row:  # e.g. response_length: the base field already holds it (as an int)
                continue
            value = float(column[i])
            row[name] = value if np.isfinite(value) else None
        rows.append(row)
    return rows


def reward_config(run_cfg: Any, sandbox_url: str | None) -> RewardConfig:
    """The run's reward (the built-in rules without a run); ``--sandbox-url`` replaces its sandbox, which may be a
    served one that is gone since (``local``: this process's)."""
    reward_cfg = run_cfg.reward if run_cfg is not None else RewardConfig()
    if sandbox_url is None:
        return reward_cfg
    url = None if sandbox_url == "local" else sandbox_url
    return reward_cfg.model_copy(update={"sandbox": reward_cfg.sandbox.model_copy(update={"url": url})})


class Evaluation:
    """Shared state for evaluating one or more checkpoints with the same settings (tokenizer, dataset, reward
    manager, reference model and evaluators are built once)."""

    def __init__(self, settings: EvalSettings, resolved: Resolved, run_cfg: Any, raw_config: dict | None,
                 tokenizer_path: str, console: Any = None):
        self.settings, self.resolved, self.run_cfg, self.raw_config = settings, resolved, run_cfg, raw_config
        self.console = console
        threads = settings.num_threads if settings.num_threads is not None else (
            run_cfg.trainer.num_threads if run_cfg is not None else 1)
        set_num_threads(threads)
        self.device = pick_device(settings.device)
        self.dtype = settings.dtype or (run_cfg.model.dtype if run_cfg is not None else "float32")
        self.tokenizer = load_tokenizer(tokenizer_path)
        data_cfg = run_cfg.data if run_cfg is not None else DataConfig()
        self.data_cfg = data_cfg.model_copy(update={"val_files": resolved.data_files,
                                                    "max_prompt_length": resolved.max_prompt_length})
        self.evaluators = build_evaluators(resolved.evaluator_specs)
        self.needs = set().union(*(set(getattr(e, "needs", {"generations"})) for e in self.evaluators))
        self._dataset = None
        self._reference = None
        self._overlaps: tuple[list[str | None], dict] | None = None
        self.reward_manager = None
        reward_cfg = reward_config(run_cfg, settings.sandbox_url)

        # Rule rewards cost nothing; they are always computed so samples.jsonl carries the run's score.
        if "rewards" in self.needs or not reward_cfg.model.path:
            self.reward_manager = RewardManager(self.tokenizer, reward_cfg, self.device)
        self._torch = torch

    @property
    def dataset(self) -> Any:
        if self._dataset is None:
            # Generated sources skip the run's training items (its data.train_files), as its validation did.
            self._dataset = RLHFDataset(self.resolved.data_files, self.tokenizer, self.data_cfg, "--data",
                                        tools=self._tool_prompting(), disjoint_from=self.data_cfg.train_files)
            # The rows' identity keys (content ids of the raw prompts): two models with different templates pair.
            self.prompt_ids = self._dataset.sample_keys
            dropped, cut = self._dataset.num_filtered, getattr(self._dataset, "num_truncated", 0)
            if dropped or cut:  # said in results.json and the report: a comparison pairs fewer prompts because of it
                what = f"{dropped} dropped" if dropped else f"{cut} truncated"
                self.resolved.notes.append(
                    f"{what}: prompts longer than max_prompt_length={self.data_cfg.max_prompt_length} tokens after "
                    f"the chat template (data.truncation={self.data_cfg.truncation}); --max-prompt-length N keeps "
                    "them")
            cap = self.resolved.max_samples
            if cap is not None and cap < len(self._dataset):
                self.resolved.notes.append(f"the first {cap} of {len(self._dataset)} prompts: capped by "
                                           f"{self.resolved.max_samples_from}; --max-samples N changes it")
        return self._dataset

    def _contamination(self) -> tuple[list[str | None], dict] | None:
        """Per dataset row, its overlap with the run's training data, and the summary; None without a run (no
        training data is known). Computed once per evaluation, for all its checkpoints."""
        if self.run_cfg is None or not self.run_cfg.data.train_files:
            return None
        if self._overlaps is None:
            count = min(len(self.dataset), self.resolved.max_samples or len(self.dataset))  # the prompts evaluated
            kinds, info = contamination_check.check(self.dataset.rows[:count], self.data_cfg.prompt_key,
                                                       list(self.run_cfg.data.train_files),
                                                       self.run_cfg.data.prompt_key, self.settings.strict)
            self._overlaps = kinds, info
        return self._overlaps

    def _multi_turn_config(self) -> config_module.MultiTurnConfig | None:
        turns = self.resolved.multi_turn
        return None if turns is None else config_module.MultiTurnConfig.model_validate(turns)

    def _tool_prompting(self) -> ToolPrompting | None:
        """The tools' rendering for prompts (multi-turn only): the same template the run trained with."""
        turns = self._multi_turn_config()
        return None if turns is None else ToolPrompting.from_config(turns, self.tokenizer)

    def reference(self) -> Any:
        if self._reference is None:
            self._reference = load_causal_lm(self.resolved.reference, self.dtype, self.device)
            self._reference.requires_grad_(False)
        return self._reference

    # ------------------------------------------------------------------ one model

    def evaluate(self, model_path: str, out_dir: Path, label: str, step: int | None = None,
                 run_dir: Path | None = None) -> dict[str, Any]:
        """Evaluate the weights at ``model_path``: build the engine, generate, KL to the reference, run the
        evaluators, assemble and write ``results.json`` (+ samples, report); returns its content."""
        t0 = time.perf_counter()
        digest = model_hash(model_path)
        cached = reusable_results(out_dir, self.resolved.fingerprint, digest) if not self.settings.force else None
        if cached is not None:
            self._say(f"{label}: reusing {out_dir / 'results.json'} (same weights and settings; --force recomputes)")
            samples = load_samples(out_dir) if self.group_column else []
            if self._add_groups(cached, samples):  # grouped from the samples on disk: nothing reruns
                write_results(out_dir, cached, samples)
                write_checkpoint_report(out_dir, cached, samples)
                self._say_groups(cached)
            elif ensure_report(out_dir, cached):
                self._say(f"{label}: rewrote the missing report/plots in {out_dir}")
            return cached
        contamination = self._contamination()  # before any weights load: --strict refuses at once
        if self.group_column:  # and a --group-by column the data lacks
            group_labels(self.dataset.rows, self.group_column, f"--group-by {self.group_column}")
        policy = load_policy(model_path, self.run_cfg, self.device, self.dtype)
        policy.requires_grad_(False)
        engine = self._build_engine(policy, model_path)
        params = SamplingParams(n=self.resolved.n, temperature=self.resolved.temperature, top_p=self.resolved.top_p,
                                top_k=self.resolved.top_k, max_new_tokens=self.resolved.max_new_tokens,
                                seed=self.resolved.seed, logprobs="engine_logprobs" in self.needs)
        timing = {"load_seconds": time.perf_counter() - t0}
        try:
            batch, texts, scores, extras, timing["generation_seconds"] = self._generate(engine, params, label)
        finally:
            engine.shutdown()
        t1 = time.perf_counter()
        kl_terms = self._kl_terms(policy, batch, label) if "ref_logprobs" in self.needs else None
        mismatch_terms = self._mismatch_terms(policy, batch, params) if "engine_logprobs" in self.needs else None
        timing["kl_seconds"] = time.perf_counter() - t1
        del policy
        if self._torch.cuda.is_available():
            self._torch.cuda.empty_cache()

        eval_batch = EvalBatch.from_rollout(batch, texts, scores, extras, n=self.resolved.n,
                                            max_new_tokens=self.resolved.max_new_tokens,
                                            sampling=self.resolved.sampling, n_bootstrap=self.settings.n_bootstrap,
                                            seed=self.resolved.seed)
        eval_batch.kl_terms = kl_terms
        eval_batch.mismatch_terms = mismatch_terms
        t2 = time.perf_counter()
        metrics, columns, notes = run_evaluators(self.evaluators, eval_batch)
        timing["evaluator_seconds"] = time.perf_counter() - t2
        timing["total_seconds"] = time.perf_counter() - t0
        results = self._assemble(model_path, label, step, run_dir, digest, batch, len(texts), metrics, notes, timing)
        samples = sample_rows(batch, texts, scores, columns, self.prompt_ids)
        if contamination is not None:
            kinds, info = contamination
            for row in samples:
                row["contaminated"] = kinds[row["index"]]
            results["contamination"] = {**info, "clean": contamination_check.clean_metrics(samples, results["metrics"])}
        else:  # said, not left out: a report without the line would read as a clean bill
            known = "this checkpoint (no run directory)" if self.run_cfg is None else "this run"
            results["contamination"] = contamination_check.not_checked(f"no training data is known for {known}")
        self._add_groups(results, samples)
        write_results(out_dir, results, samples)

        write_checkpoint_report(out_dir, results, samples)
        self._say(f"{label}: " + summary_line(results) + f"  -> {out_dir}")
        self._say_groups(results)
        return results

    def _add_groups(self, results: dict, samples: list[dict]) -> bool:
        """``--group-by``: put the per-group metrics into ``results`` (from ``samples``) unless they are there for
        the same column; True when it added them."""
        column = self.group_column
        if column is None or (results.get("groups") or {}).get("by") == column:
            return False
        built = {getattr(e, "spec", None): e for e in self.evaluators}
        results["groups"] = group_results(samples, results["metrics"], column, self.dataset.rows,
                                          lambda spec: built.get(spec) or build_evaluator(spec),
                                          self.settings.n_bootstrap, results["sampling"]["seed"])
        return True

    @property
    def group_column(self) -> str | None:
        """``--group-by``'s column; unset: ``extra_info.kind`` if every row has it (as ``data.val_group_by=auto``)."""
        column = self.settings.group_by
        if column is None:
            return AUTO_GROUP_COLUMN if has_column(self.dataset.rows, AUTO_GROUP_COLUMN) else None
        return None if column == "none" else column

    def _say_groups(self, results: dict) -> None:
        for line in group_lines(results["groups"]) if results.get("groups") else []:
            self._say(line)

    def _build_engine(self, policy: Any, model_path: str) -> Any:
        """The rollout engine the run's validation used, around ``policy`` (vLLM loads ``model_path`` itself)."""
        # The run's generation chunking and autocast, so samples match the trainer's validation exactly.
        rollout_cfg = self.run_cfg.rollout if self.run_cfg is not None else RolloutConfig()
        bf16 = self.run_cfg is not None and self.run_cfg.actor.autocast == "bf16"
        if rollout_cfg.dtype is not None:  # the run's engine dtype
            bf16 = rollout_cfg.dtype == "bfloat16"
        engine = build_rollout(self.resolved.engine, EngineSpec(
            policy, model_path, self.tokenizer, rollout_cfg,
            self.data_cfg.max_prompt_length + self.resolved.max_new_tokens, self.resolved.seed,
            micro_batch_size=rollout_cfg.micro_batch_size, autocast_dtype=self._torch.bfloat16 if bf16 else None))
        turns = self._multi_turn_config()
        return engine if turns is None else AgentRollout(engine, turns, self.resolved.max_new_tokens)

    def _kl_terms(self, policy: Any, batch: Any, label: str) -> dict[str, Any]:
        """Exact per-token KL of ``policy`` from the reference along the generated responses."""
        reference = self.reference()
        if reference.config.vocab_size != policy.config.vocab_size:
            raise ConfigError(f"reference '{self.resolved.reference}' has vocab size {reference.config.vocab_size} "
                              f"but the checkpoint has {policy.config.vocab_size}; give a --reference with the "
                              "same tokenizer")

        with self._progress(f"{label}: KL to reference", len(batch)) as advance:
            return compute_kl_terms(policy, reference, batch, self.settings.kl_micro_batch_size, progress=advance)

    def _assemble(self, model_path: str, label: str, step: int | None, run_dir: Path | None, digest: str,
                  batch: Any, num_samples: int, metrics: dict[str, Metric], notes: list[str],
                  timing: dict[str, float]) -> dict[str, Any]:
        """``results.json``'s content: what was evaluated, how, the metrics with their CIs, and the timings."""
        generation, total = timing["generation_seconds"], timing["total_seconds"]
        return {
            "schema": SCHEMA,
            "label": label,
            "checkpoint": str(model_path),
            "step": step,
            "run_dir": str(run_dir) if run_dir else None,
            "model_hash": digest,
            "created": datetime.now().isoformat(timespec="seconds"),
            "sampling": self.resolved.sampling,
            "data": {"files": self.resolved.data_files, "num_prompts": int(len(set(batch.non_tensor["index"]))),
                     "num_samples": num_samples, "max_samples": self.resolved.max_samples,
                     "max_samples_from": self.resolved.max_samples_from, "num_usable": len(self.dataset),
                     "num_dropped": self.dataset.num_filtered,
                     "num_truncated": getattr(self.dataset, "num_truncated", 0),
                     "max_prompt_length": self.data_cfg.max_prompt_length,
                     "prompt_key": self.data_cfg.prompt_key, "ground_truth_key": self.data_cfg.ground_truth_key},
            "evaluators": [getattr(e, "spec", getattr(e, "name", type(e).__name__)) for e in self.evaluators],
            **({"multi_turn": self.resolved.multi_turn} if self.resolved.multi_turn else {}),
            "reference": self.resolved.reference,
            # builtin:NAME references can change under the same name; the hash says which weights were used.
            "reference_hash": model_hash(self.resolved.reference) if self.resolved.reference else None,
            "reward": self.run_cfg.reward.model_dump(mode="json") if self.run_cfg is not None else {"name": "auto"},
            "metrics": {f"{METRIC_PREFIX}{k}": m.to_dict() for k, m in metrics.items()},
            "notes": [*self.resolved.notes, *notes],
            "config": self.raw_config,
            "settings_fingerprint": self.resolved.fingerprint,
            "n_bootstrap": self.settings.n_bootstrap,
            "versions": versions(),
            "device": str(self.device),
            "timing": {**timing, "samples_per_second": num_samples / generation if generation else None,
                       "samples_per_second_total": num_samples / total if total else None},
        }

    def _mismatch_terms(self, policy: Any, batch: Any, params: Any) -> dict[str, Any]:
        """The engine's log-probs of its tokens and the trainer's forward on them (the run's autocast), at the
        sampling temperature (1 for greedy decoding, as the engine reports them)."""
        from verl.workers.forward import response_log_probs  # noqa: PLC0415 (torch-heavy; only for -e mismatch)

        if "rollout_log_probs" not in batch.batch:
            raise ConfigError(f"-e mismatch needs the engine's log-probs, and the {self.resolved.engine} engine gave "
                              "none (a multi-turn vLLM rollout does not yet)")
        bf16 = self.run_cfg is not None and self.run_cfg.actor.autocast == "bf16"
        temperature = 1.0 if params.greedy else params.temperature
        parts = []
        with self._torch.no_grad():
            for start in range(0, len(batch), self.settings.kl_micro_batch_size):
                rows = {k: batch.batch[k][start : start + self.settings.kl_micro_batch_size].to(self.device)
                        for k in ("input_ids", "attention_mask", "position_ids", "responses")}
                log_probs, _ = response_log_probs(policy, rows, temperature,
                                                  autocast_dtype=self._torch.bfloat16 if bf16 else None)
                parts.append(log_probs.float().cpu())
        mask = batch.batch["response_mask"]
        return {"trainer": self._torch.cat(parts) * mask, "rollout": batch.batch["rollout_log_probs"] * mask,
                "mask": mask, "trainer_dtype": "bf16 autocast" if bf16 else "fp32"}

    def _generate(self, engine: Any, params: Any, label: str) -> tuple[Any, list[str], Any, dict, float]:
        """The trainer's validation loop (``verl.trainer.validation.generate_and_score``) with a progress bar."""
        dataset = self.dataset
        count = min(len(dataset), self.resolved.max_samples or len(dataset))
        outputs, scores, texts = [], [], []
        extras: dict[str, list[np.ndarray]] = {}
        start_time = time.perf_counter()
        with self._progress(f"{label}: generating", count * self.resolved.n) as advance:
            for start in range(0, count, self.resolved.batch_size):
                prompts = dataset.collate(list(range(start, min(start + self.resolved.batch_size, count))))
                out = engine.generate(prompts, params)
                if self.reward_manager is not None:
                    token_scores, ex, txt = self.reward_manager.compute(out)
                    scores.append(token_scores.sum(-1).numpy())
                    for key, value in ex.items():
                        extras.setdefault(key, []).append(value)
                else:
                    txt = decode_responses(self.tokenizer, out)
                outputs.append(out)
                texts.extend(txt)
                advance(len(out))
        seconds = time.perf_counter() - start_time
        batch = DataProto.concat(pad_responses(outputs, self.tokenizer.pad_token_id))
        merged = {k: np.concatenate(v) for k, v in extras.items() if len(v) == len(outputs)}
        return batch, texts, (np.concatenate(scores) if scores else None), merged, seconds

    # ------------------------------------------------------------------ console

    def _say(self, text: str) -> None:
        if self.console is not None and not self.settings.quiet:
            self.console.print(text, soft_wrap=True, highlight=False)

    @contextlib.contextmanager
    def _progress(self, description: str, total: int):
        """A rich progress bar (only on a terminal, never with --quiet) yielding an ``advance(k)`` function."""
        console = self.console
        if console is None or not console.is_terminal or self.settings.quiet:
            yield lambda k: None
            return
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, transient=True) as progress:
            task = progress.add_task(description, total=total)
            yield lambda k: progress.advance(task, k)


def data_line(data: dict) -> str:
    """How many prompts were evaluated and, when that is not the whole file, why: ``64 of 200 prompts (capped at 64
    by the run's data.val_max_samples; --max-samples N changes it)``."""
    used, usable = data.get("num_prompts"), data.get("num_usable")
    if usable is None:  # results written before these fields existed
        return f"{used} prompts"
    dropped, cut = data.get("num_dropped", 0), data.get("num_truncated", 0)
    total = usable + dropped
    why = []
    if used < usable:
        why.append(f"capped at {data['max_samples']} by {data['max_samples_from']}; --max-samples N changes it")
    if dropped:
        why.append(f"{dropped} dropped: longer than max_prompt_length={data['max_prompt_length']} tokens; "
                   "--max-prompt-length N keeps them")
    if cut:
        why.append(f"{cut} truncated to max_prompt_length={data['max_prompt_length']} tokens")
    head = f"{used} prompts" if used == total else f"{used} of {total} prompts"
    return head + (f" ({'; '.join(why)})" if why else "")


def summary_line(results: dict) -> str:
    parts = [data_line(results.get("data", {}))]
    for key in ("eval/accuracy", "eval/reward_mean", "eval/kl_exact", "eval/response_length_mean", "eval/distinct_1",
                "eval/tool_call_rate", "eval/valid_call_rate"):
        metric = results["metrics"].get(key)
        if metric and metric.get("value") is not None:
            se = metric.get("se")
            parts.append(f"{key[5:]} {metric['value']:.4g}" + (f" ± {1.96 * se:.2g}" if se is not None else ""))
    rate = results["timing"].get("samples_per_second")
    if rate:  # two significant digits below 10: a 135M agent on one thread runs ~0.3 a second, not "0"
        parts.append(f"{rate:.0f} samples/s" if rate >= 10 else f"{rate:.2g} samples/s")
    return ", ".join(parts)


REPORT_FILES = ("report.md", "report.html", "length_hist.png")


def ensure_report(out_dir: Path, results: dict) -> bool:
    """Reports are derived from results.json + samples.jsonl: rewrite them when a file is missing or empty (an eval
    killed after its results were written), and drop temp files such a kill left behind. True if it rewrote."""
    for stale in out_dir.glob(".*.tmp"):
        stale.unlink(missing_ok=True)
    plots_wanted = importlib.util.find_spec("matplotlib") is not None
    wanted = [name for name in REPORT_FILES if plots_wanted or not name.endswith(".png")]
    if all((out_dir / name).is_file() and (out_dir / name).stat().st_size > 0 for name in wanted):
        return False

    write_checkpoint_report(out_dir, results, load_samples(out_dir))
    return True


def reward_model_checkpoint(target: CheckpointRef) -> Path | None:
    """The checkpoint dir when ``target`` is (or a run whose checkpoints are) a reward model, else None."""
    from serve.settings import is_reward_model  # noqa: PLC0415  (the one test of a reward-model checkpoint)

    path = Path(target.path)
    candidates = sorted(path.glob("checkpoints/global_step_*")) if target.kind == "run" else [path]
    return candidates[0] if candidates and is_reward_model(str(candidates[0])) else None


def run_eval(ckpt: str | Path, settings: EvalSettings, out: str | Path | None = None, console: Any = None) -> dict:
    """Evaluate a checkpoint, a bare model or every checkpoint of a run. Returns the results (or run summary)."""
    target = resolve_target(ckpt)
    if reward_model_checkpoint(target) is not None:
        # A sequence classifier does not generate: it is scored on preference pairs instead.
        return evaluate_reward_model(target, settings, out, console)
    if settings.inspect_tasks:  # Inspect generates (through our service) and scores
        from eval.inspect_tasks import run_inspect_tasks  # noqa: PLC0415

        return run_inspect_tasks(target, settings, out, console, load_run_config(target.run_dir)[0])
    if settings.lm_eval_tasks:  # lm-eval generates and scores: none of the machinery below runs
        from eval.lm_eval_tasks import run_lm_eval_tasks  # noqa: PLC0415

        return run_lm_eval_tasks(target, settings, out, console, load_run_config(target.run_dir)[0],
                                 tokenizer_source_for)
    run_cfg, raw, notes = load_run_config(target.run_dir)
    if console is not None and notes and not settings.quiet:
        for note in notes:
            console.print(Text.assemble(("note:", "yellow"), f" {note}"))
    resolved = resolve_settings(settings, run_cfg, settings.reference)
    resolved.notes.extend(notes)
    if target.kind == "run":
        return evaluate_run_dir(target, settings, resolved, run_cfg, raw, out, console)
    evaluation = Evaluation(settings, resolved, run_cfg, raw, tokenizer_source_for(target.path, run_cfg), console)
    if out is not None:
        out_dir = Path(out)
    elif target.run_dir is not None:
        out_dir = results_root(target.run_dir, resolved, run_cfg) / target.label
    else:
        out_dir = Path("outputs") / "eval" / target.label
    return evaluation.evaluate(target.path, out_dir, target.label, target.step, target.run_dir)


def tokenizer_source_for(path: str, run_cfg: Any) -> str:
    local = Path(path)
    has_tokenizer = any((local / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
    # A LoRA checkpoint holds adapter files only (no config.json); its tokenizer is the base model's.
    is_model_dir = (local / "config.json").is_file()
    if local.is_dir() and not (has_tokenizer and is_model_dir) and run_cfg is not None:
        return run_cfg.model.tokenizer_path or run_cfg.model.path
    return path


def evaluate_run_dir(target: CheckpointRef, settings: EvalSettings, resolved: Resolved, run_cfg: Any, raw: dict | None,
                  out: str | Path | None, console: Any) -> dict:
    run_dir = Path(target.path)
    checkpoints = list_checkpoints(run_dir)
    if not checkpoints:
        raise CheckpointError(f"run '{run_dir}' has no complete checkpoints (checkpoints/global_step_N with "
                              "meta.json); train with trainer.save_freq > 0 or wait for the first save")
    metric, mode = parse_select(settings.select)
    out_dir = Path(out) if out is not None else results_root(run_dir, resolved, run_cfg)
    tokenizer_source = tokenizer_source_for(str(checkpoints[0][1]), run_cfg)
    if settings.executor == "ray":
        per_checkpoint = evaluate_on_ray(checkpoints, settings, resolved, run_cfg, raw, tokenizer_source, out_dir,
                                          run_dir, console)
    else:
        evaluation = Evaluation(settings, resolved, run_cfg, raw, tokenizer_source, console)
        per_checkpoint = [evaluation.evaluate(str(path), out_dir / path.name, path.name, step, run_dir)
                          for step, path in checkpoints]
    summary = write_run_summary(out_dir, run_dir, per_checkpoint, settings.select, metric, mode,
                                {**resolved.results_settings, "tag": resolved.settings_tag,
                                 "run_defaults": is_run_default(resolved, run_cfg)}, resolved.sampling)
    best = summary["best"]
    write_run_report(out_dir, summary, run_dir)
    if console is not None and not settings.quiet and best is None:
        console.print(f"no best checkpoint: these evaluators give no {metric}; --select METRIC:max|min ranks by one "
                      f"of {', '.join(summary['metrics_available'])} -> {out_dir / 'summary.json'}",
                      highlight=False, soft_wrap=True)
    elif console is not None and not settings.quiet:
        value = best["value"]
        where = ("the run's validation settings" if best["settings"]["run_defaults"] else
                 f"settings {best['settings']['tag']} (n={resolved.n}, temperature {resolved.temperature:g}); "
                 "`verl export --select best` and `verl compare` rank by the run's validation settings only")
        console.print(f"best by {metric}:{mode}: {best['label']} ({value:.4g}) under {where} -> "
                      f"{out_dir / 'best.json'}", highlight=False, soft_wrap=True)
    return summary


def _evaluate_shard(shard: list[tuple[int, str]], settings: EvalSettings, resolved: Resolved, run_cfg: Any,
                    raw: dict | None, tokenizer_source: str, out_dir: str, run_dir: str) -> list[dict]:
    """One Ray worker's share of a run's checkpoints, evaluated exactly as the local executor does (same settings,
    seeds and batches; one torch thread unless ``--threads``)."""
    torch.set_num_threads(settings.num_threads or 1)
    evaluation = Evaluation(settings, resolved, run_cfg, raw, tokenizer_source, None)
    return [evaluation.evaluate(path, Path(out_dir) / Path(path).name, Path(path).name, step, Path(run_dir))
            for step, path in shard]


def start_ray(workers: int) -> bool:
    """Join the cluster ``RAY_ADDRESS`` names, or start a local one with room for ``workers``; False when Ray was
    already initialized (the caller then leaves it running)."""
    import ray  # noqa: PLC0415  (only the ray executor needs it)

    if ray.is_initialized():
        return False
    ray.init(num_cpus=None if os.environ.get("RAY_ADDRESS") else max(workers, os.cpu_count() or 1),
             include_dashboard=False, log_to_driver=False)
    return True


def evaluate_on_ray(checkpoints: list[tuple[int, Path]], settings: EvalSettings, resolved: Resolved, run_cfg: Any,
                    raw: dict | None, tokenizer_source: str, out_dir: Path, run_dir: Path, console: Any) -> list[dict]:
    """``--executor ray --workers N``: checkpoints dealt round-robin to N Ray tasks (one CPU each) on the cluster
    ``ray.init`` finds (``RAY_ADDRESS``) or a local one; results in step order, as the local executor gives them."""
    import ray  # noqa: PLC0415  (only this executor needs ray)

    started = start_ray(settings.workers)
    workers = min(settings.workers, len(checkpoints))
    shards = [[(step, str(path)) for step, path in checkpoints[i::workers]] for i in range(workers)]
    quiet = dataclasses.replace(settings, quiet=True)
    task = ray.remote(num_cpus=1)(_evaluate_shard)
    start = time.perf_counter()
    try:
        done = ray.get([task.remote(shard, quiet, resolved, run_cfg, raw, tokenizer_source, str(out_dir),
                                    str(run_dir)) for shard in shards])
    finally:
        if started:
            ray.shutdown()
    results = sorted((r for shard in done for r in shard), key=lambda r: r["step"])
    if console is not None and not settings.quiet:
        console.print(f"{len(results)} checkpoints on {workers} Ray workers in {time.perf_counter() - start:.1f} s",
                      highlight=False)
        for r in results:
            console.print(f"{r['label']}: " + summary_line(r), highlight=False, soft_wrap=True)
    return results


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use `verl eval`")

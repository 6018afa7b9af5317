"""lm-evaluation-harness tasks inside ``verl eval`` (``--lm-eval-task NAME|FILE.yaml``).

    verl eval --ckpt C --lm-eval-task my_task.yaml --lm-eval-arg num_fewshot=5 --lm-eval-arg limit=100

The checkpoint (a LoRA checkpoint: its base with ``peft=``) goes to lm-eval's ``hf`` model as a directory, as
``lm_eval --model hf --model_args pretrained=C`` would (verl/evaluators/lm_eval.py runs it and converts what comes
back); this module writes ``verl eval``'s outputs: ``results.json`` (schema ``verl-eval/1``), ``samples.jsonl``
(one row per task document, which ``verl compare`` pairs) and the report, and runs the contamination check on the
contexts.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from verl.errors import ConfigError
from verl.evaluators.lm_eval import DEFAULT_SEEDS, PREFIX, LmEvalRequest, convert, model_args_for, run_lm_eval

# ---------------------------------------------------------------------------------------------- one checkpoint


def evaluate_lm_eval(model_path: str, base_path: str | None, tokenizer: str | None, request: LmEvalRequest,
                     out_dir: Path, label: str, step: int | None, run_dir: Path | None, device: str,
                     run_cfg: Any, strict: bool, say: Any = None) -> dict:
    """Run the tasks on the checkpoint at ``model_path``; write ``results.json``, ``samples.jsonl`` and the report
    into ``out_dir``; returns the results. ``run_cfg``: the run's config, whose training prompts the contexts are
    checked against (None: not checked)."""
    from eval import contamination as contamination_check  # noqa: PLC0415
    from eval.report import write_tool_report  # noqa: PLC0415
    from eval.results import SCHEMA, model_hash, versions, write_results  # noqa: PLC0415

    t0 = time.perf_counter()
    model_args = model_args_for(model_path, base_path, request.args.get("model_args"), tokenizer)
    out = run_lm_eval(model_args, request, device)
    seconds = time.perf_counter() - t0
    metrics, samples, summary = convert(out)
    contamination = contamination_check.of_samples(samples, metrics, run_cfg, strict)
    results = {
        "schema": SCHEMA, "label": label, "checkpoint": str(model_path), "step": step,
        "run_dir": str(run_dir) if run_dir else None, "model_hash": model_hash(model_path),
        "created": datetime.now().isoformat(timespec="seconds"),
        "sampling": {"engine": "lm_eval:hf", "n": 1, "temperature": None, "seed": request.args.get("seed",
                                                                                                   DEFAULT_SEEDS),
                     "gen_kwargs": request.args.get("gen_kwargs")},
        "data": {"files": [f"lm_eval:{t}" for t in request.tasks], "num_prompts": len(samples),
                 "num_samples": len(samples)},
        "evaluators": ["lm_eval"], "lm_eval": {**summary, "model_args": model_args, "request": {
            "tasks": request.tasks, "include": request.include, "args": request.args}},
        "metrics": metrics, "contamination": contamination, "notes": [], "config": None,
        "versions": versions(), "device": device, "timing": {"total_seconds": seconds},
    }
    write_results(out_dir, results, samples)
    args = json.dumps(request.args) if request.args else "lm-eval CLI defaults"
    write_tool_report(out_dir, results, samples, "lm-eval", f"lm-evaluation-harness {summary.get('lm_eval_version')} "
                      f"tasks {', '.join(request.tasks)}, model `hf` with `{model_args}`, options {args}",
                      "lm_eval_stderr")
    if say is not None:
        say(f"{label}: " + "  ".join(f"{name[len(PREFIX):]}={m['value']:.4f}" for name, m in metrics.items())
            + f"  -> {out_dir}")
    return results


# ---------------------------------------------------------------------------------------------- verl eval


# verl eval's own generation options mean nothing to an lm-eval task (the task's YAML says how it generates): each
# is refused by name with lm-eval's way to say it.
NOT_FOR_LM_EVAL = {"data": "the task's dataset_kwargs", "evaluators": "the task's metric_list",
                   "n": "the task's repeats", "temperature": "--lm-eval-arg gen_kwargs=temperature=T",
                   "top_p": "--lm-eval-arg gen_kwargs=top_p=P", "top_k": "--lm-eval-arg gen_kwargs=top_k=K",
                   "max_new_tokens": "--lm-eval-arg gen_kwargs=max_gen_toks=N",
                   "batch_size": "--lm-eval-arg batch_size=B", "max_samples": "--lm-eval-arg limit=N",
                   "tools": None, "tool_config": None, "max_turns": None, "group_by": None, "reference": None}
FLAG_OF = {"data": "--data", "evaluators": "-e", "n": "--n", "temperature": "--temperature", "top_p": "--top-p",
           "top_k": "--top-k", "max_new_tokens": "--max-new-tokens", "batch_size": "--batch-size",
           "max_samples": "--max-samples", "tools": "--tools", "tool_config": "--tool-config",
           "max_turns": "--max-turns", "group_by": "--group-by", "reference": "--reference"}


def check_settings(settings: Any) -> None:
    for name, instead in NOT_FOR_LM_EVAL.items():
        if getattr(settings, name) is not None:
            hint = f"; use {instead}" if instead else ""
            raise ConfigError(f"{FLAG_OF[name]} does not apply to --lm-eval-task (the task defines how it is "
                              f"generated and scored){hint}")
    if settings.engine != "hf" or settings.executor != "local":
        raise ConfigError("--lm-eval-task runs lm-eval's hf model in this process: --engine and --executor do not "
                          "apply")


def run_lm_eval_tasks(target: Any, settings: Any, out: str | Path | None, console: Any, run_cfg: Any,
                      tokenizer_source_for: Callable[[str, Any], str]) -> dict:
    """``verl eval --ckpt TARGET --lm-eval-task ...``: one checkpoint or model, or every checkpoint of a run.
    ``run_cfg``: the run's config (or None); ``tokenizer_source_for(path, run_cfg)``: where a checkpoint's
    tokenizer is (eval.runner's, passed in: the runner imports this module)."""
    from verl.models.loader import pick_device, resolve_model_path  # noqa: PLC0415
    from verl.trainer.checkpoint import list_checkpoints  # noqa: PLC0415
    from verl.utils.seeding import set_num_threads  # noqa: PLC0415

    check_settings(settings)
    request = LmEvalRequest.parse(settings.lm_eval_tasks, settings.lm_eval_include, settings.lm_eval_args)
    set_num_threads(settings.num_threads or (run_cfg.trainer.num_threads if run_cfg is not None else 1))
    device = str(pick_device(settings.device))
    say = None if console is None or settings.quiet else (
        lambda text: console.print(text, highlight=False, soft_wrap=True))
    if target.kind == "run":
        checkpoints = [(step, str(path), path.name) for step, path in list_checkpoints(target.path)]
        if not checkpoints:
            raise ConfigError(f"run '{target.path}' has no complete checkpoints to evaluate")
        root = Path(out) if out is not None else Path(target.path) / "eval" / "lm_eval"
    else:
        checkpoints = [(target.step, target.path, target.label)]
        root = None
    per_checkpoint = {}
    for step, path, label in checkpoints:
        local = Path(path)
        base = None
        if (local / "adapter_config.json").is_file() and not (local / "config.json").is_file():
            adapter = json.loads((local / "adapter_config.json").read_text())
            base = run_cfg.model.path if run_cfg is not None else adapter.get("base_model_name_or_path")
            if not base:
                raise ConfigError(f"{local} is a LoRA adapter with no base model; evaluate it inside its run dir")
            base = resolve_model_path(base)
        model_dir = str(local) if local.is_dir() else resolve_model_path(path)
        tokenizer = tokenizer_source_for(model_dir, run_cfg)
        tokenizer = resolve_model_path(tokenizer) if tokenizer != model_dir else None
        if root is not None:
            out_dir = root / label
        elif out is not None:
            out_dir = Path(out)
        elif target.run_dir is not None:
            out_dir = Path(target.run_dir) / "eval" / "lm_eval" / label
        else:
            out_dir = Path("outputs") / "eval" / "lm_eval" / label
        per_checkpoint[label] = evaluate_lm_eval(model_dir, base, tokenizer, request, out_dir, label, step,
                                                 target.run_dir, device, run_cfg, settings.strict, say)
    return per_checkpoint if target.kind == "run" else per_checkpoint[checkpoints[0][2]]

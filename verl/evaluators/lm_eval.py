"""lm-evaluation-harness as a library (``verl eval --lm-eval-task``: eval/lm_eval_tasks.py; ``trainer.eval_tasks``
entries with ``lm_eval_task``: verl/trainer/validation.py).

lm-eval runs the task itself (``lm_eval.simple_evaluate``, the call its CLI makes, with the CLI's defaults), so its
prompts, filters, metrics and stderrs are its own; this module parses what a user asks lm-eval for, keeps the hub
off, runs it on a model (lm-eval's ``hf`` backend: a directory through ``model_args``, or a model in memory), and
turns what comes back into verl's metrics and per-document rows:

- each ``metric,filter`` of each task as ``eval/lm_eval/<task>/<metric>`` (``/<filter>`` unless the filter is
  ``none``), with lm-eval's value and stderr (``lm_eval_stderr``) and our SE and 95% CI from the per-document
  values. A metric whose lm-eval aggregation is not the mean of its documents' values (bleu, perplexity, a group's
  aggregate) keeps lm-eval's value and stderr (CI = value ± 1.96·stderr) and is not paired by ``verl compare``;
- one row per (task, document): ``prompt_id`` = ``lm_eval:<task>:<doc_id>:<doc hash>`` (two checkpoints pair a
  document only when its content is the same), the context, every response (lm-eval's ``repeats`` are reduced per
  document by the task's own filters), and every metric's per-document value.

The ``hf`` backend runs every output type (``loglikelihood``, ``multiple_choice``, ``loglikelihood_rolling``,
``generate_until``) in-process with no server, which is what lm-eval's own CLI does with ``--model hf`` on the same
directory, so the two print the same numbers. The chat-completions backend could score ``generate_until`` only.

The Hugging Face Hub is off (``HF_HUB_OFFLINE``, ``HF_DATASETS_OFFLINE``): a task whose dataset lives on the hub
fails in one line that says how to point it at local files.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from verl.errors import ConfigError, VerlError
from verl.evaluators.stats import reported_metric
from verl.utils.cli import key_values

PREFIX = "eval/lm_eval/"


def _flag(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise ValueError("expected true or false")


def _chat_template(value: str) -> bool | str:
    """lm-eval's ``--apply_chat_template [NAME]``: true/false, or the name of one of the tokenizer's templates."""
    try:
        return _flag(value)
    except ValueError:
        return value


def _limit(value: str) -> int | float:
    number = float(value)
    if number <= 0:
        raise ValueError("must be > 0 (a count of documents, or a fraction below 1)")
    return number if number < 1 else int(number)


def _batch(value: str) -> int | str:
    return value if value.startswith("auto") else int(value)


def _seeds(value: str) -> list[int]:
    """lm-eval's ``--seed``: one value for all four generators, or ``random,numpy,torch,fewshot``."""
    parts = [int(p) for p in value.split(",")]
    if len(parts) == 1:
        return parts * 4
    if len(parts) != 4:
        raise ValueError("one seed, or four (random,numpy,torch,fewshot)")
    return parts


# --lm-eval-arg KEY=VALUE: the lm-eval options a user of its CLI relies on, each parsed as its CLI parses it.
ARGS: dict[str, Any] = {
    "num_fewshot": int,
    "apply_chat_template": _chat_template,
    "fewshot_as_multiturn": _flag,
    "system_instruction": str,
    "limit": _limit,
    "gen_kwargs": str,  # "temperature=0,max_gen_toks=64": lm-eval parses it
    "bootstrap_iters": int,
    "batch_size": _batch,
    "seed": _seeds,
    "model_args": str,  # extra hf model args, e.g. "dtype=bfloat16,max_length=2048"
}
# lm-eval's CLI defaults (lm_eval/config/evaluate_config.py): the numbers then match `lm_eval` run directly.
DEFAULT_SEEDS = [0, 1234, 1234, 1234]
DEFAULT_BOOTSTRAP = 100000


@dataclass
class LmEvalRequest:
    """What ``--lm-eval-task`` / ``--lm-eval-include`` / ``--lm-eval-arg`` asked for, validated."""

    tasks: list[str]
    include: list[str] = field(default_factory=list)
    args: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, tasks: list[str], include: list[str] | None, raw_args: list[str] | None) -> LmEvalRequest:
        include = list(include or [])
        names = []
        for task in tasks:
            path = Path(task).expanduser()
            if path.suffix in (".yaml", ".yml"):
                if not path.is_file():
                    raise ConfigError(f"--lm-eval-task {task}: no such file")
                names.append(_task_name(path))
                include.append(str(path.parent.resolve()))
            else:
                names.append(task)
        for folder in include:
            if not Path(folder).is_dir():
                raise ConfigError(f"--lm-eval-include {folder}: no such directory")
        args = key_values(raw_args, "--lm-eval-arg", ARGS, "lm-eval", "num_fewshot=5")
        if args.get("fewshot_as_multiturn") and not args.get("apply_chat_template"):
            raise ConfigError("--lm-eval-arg fewshot_as_multiturn=true needs apply_chat_template=true (as in lm-eval)")
        return cls(names, list(dict.fromkeys(include)), args)


def _task_name(path: Path) -> str:
    import yaml  # noqa: PLC0415

    try:
        config = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"--lm-eval-task {path}: not valid YAML ({exc})") from None
    name = config.get("task") if isinstance(config, dict) else None
    if not name:
        name = config.get("group") if isinstance(config, dict) else None
    if not isinstance(name, str):
        raise ConfigError(f"--lm-eval-task {path}: the file names no task (a top-level `task:` or `group:` key)")
    return name


def model_args_for(model_path: str, base_path: str | None, extra: str | None, tokenizer: str | None = None) -> str:
    """lm-eval's ``hf`` model arguments: the directory (a LoRA adapter: its base and ``peft=``), its tokenizer when
    the directory holds none, float32 unless ``model_args`` says otherwise."""
    args = f"pretrained={base_path},peft={model_path}" if base_path else f"pretrained={model_path}"
    if tokenizer:
        args += f",tokenizer={tokenizer}"
    given = extra or ""
    if "dtype=" not in given:
        args += ",dtype=float32"
    return args + (f",{given}" if given else "")


def hub_off() -> None:
    """No hub: a dataset that is not local fails at once instead of waiting on the network."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    import datasets.config  # noqa: PLC0415
    import huggingface_hub.constants  # noqa: PLC0415

    # Both libraries read the variables at import: if they were imported already, set their copies too.
    datasets.config.HF_HUB_OFFLINE = True
    datasets.config.HF_DATASETS_OFFLINE = True
    huggingface_hub.constants.HF_HUB_OFFLINE = True


@functools.lru_cache(maxsize=4)
def task_manager(include: tuple[str, ...]) -> Any:
    """lm-eval's task index (~7 s: it reads every task YAML it ships), built once per process and include path:
    a run dir's checkpoints share it."""
    from lm_eval.tasks import TaskManager  # noqa: PLC0415

    return TaskManager(include_path=list(include) or None)


def run_lm_eval(model: Any, request: LmEvalRequest, device: str) -> dict:
    """``lm_eval.simple_evaluate`` as lm-eval's CLI calls it (its defaults), with samples logged. ``model``: the
    ``hf`` backend's ``model_args`` (a directory), or a model in memory (``in_memory_lm``)."""
    try:
        import lm_eval  # noqa: PLC0415
    except ImportError:
        raise VerlError("lm-eval tasks need lm-evaluation-harness: pip install 'lm_eval>=0.4.13'") from None
    hub_off()
    manager = task_manager(tuple(request.include))
    missing = [t for t in request.tasks if t not in manager.all_tasks]
    if missing:
        raise ConfigError(f"--lm-eval-task {', '.join(missing)}: lm-eval knows no such task; give the task's YAML "
                          "file, or its folder with --lm-eval-include DIR")
    args = request.args
    seeds = args.get("seed", DEFAULT_SEEDS)
    chat = args.get("apply_chat_template", False)
    try:
        return lm_eval.simple_evaluate(
            model="hf" if isinstance(model, str) else model, model_args=model if isinstance(model, str) else None,
            tasks=list(request.tasks), task_manager=manager,
            num_fewshot=args.get("num_fewshot"), batch_size=args.get("batch_size", 1), device=device,
            limit=args.get("limit"), bootstrap_iters=args.get("bootstrap_iters", DEFAULT_BOOTSTRAP),
            log_samples=True, system_instruction=args.get("system_instruction"), apply_chat_template=chat,
            fewshot_as_multiturn=args.get("fewshot_as_multiturn", bool(chat)), gen_kwargs=args.get("gen_kwargs"),
            random_seed=seeds[0], numpy_random_seed=seeds[1], torch_random_seed=seeds[2],
            fewshot_random_seed=seeds[3], verbosity="ERROR")
    except Exception as exc:  # noqa: BLE001 - the hub's errors come as several types; one line names the fix
        if _is_offline_error(exc):
            raise ConfigError(
                f"lm-eval task(s) {', '.join(request.tasks)}: the dataset is on the Hugging Face Hub, and the hub is "
                "off here (HF_HUB_OFFLINE=1). Point the task at local files: `dataset_path: json` (or parquet, csv) "
                "with `dataset_kwargs: {data_files: {test: /path/to/test.jsonl}}` and `test_split: test`"
            ) from None
        raise


def _is_offline_error(exc: BaseException) -> bool:
    text = f"{type(exc).__name__}: {exc}"
    return any(s in text for s in ("offline", "Offline", "OFFLINE", "ConnectionError", "couldn't reach",
                                   "Couldn't reach", "LocalEntryNotFound", "DatasetNotFound"))


# ---------------------------------------------------------------------------------------------- results


def _metric_name(task: str, metric: str, filt: str) -> str:
    return f"{PREFIX}{task}/{metric}" + ("" if filt == "none" else f"/{filt}")


def _is_mean(config: dict, metric: str) -> bool:
    """Whether lm-eval aggregates ``metric`` as the mean of its documents' values (so it pairs per document)."""
    from lm_eval.api.metrics import mean  # noqa: PLC0415
    from lm_eval.api.registry import AGGREGATION_REGISTRY, get_metric_aggregation  # noqa: PLC0415

    for entry in config.get("metric_list") or []:
        if entry.get("metric") == metric and "aggregation" in entry:
            named = entry["aggregation"]
            return named == "mean" if isinstance(named, str) else AGGREGATION_REGISTRY.get(str(named)) is mean
    try:
        return get_metric_aggregation(metric) is mean
    except Exception:  # noqa: BLE001 - a task-defined metric lm-eval's registry does not know
        return False


def convert(out: dict) -> tuple[dict[str, dict], list[dict], dict[str, Any]]:
    """lm-eval's returned dict -> (our metrics, samples.jsonl rows, a summary of what ran)."""
    metrics: dict[str, dict] = {}
    rows: dict[tuple[str, int], dict] = {}
    higher = out.get("higher_is_better", {})
    for task, samples in out.get("samples", {}).items():
        config = out["configs"].get(task, {})
        columns: dict[tuple[str, str], list[tuple[str, float]]] = {}
        for sample in samples:
            doc_id = int(sample["doc_id"])
            row = rows.setdefault((task, doc_id), {
                "prompt_id": f"lm_eval:{task}:{doc_id}:{sample['doc_hash'][:16]}", "index": doc_id, "sample": 0,
                "task": task, "prompt": _context(sample), "response": _first_response(sample),
                "responses": [_text(r) for r in sample["resps"]], "ground_truth": _text(sample.get("target")),
                "data_source": f"lm_eval:{task}", "response_length": None})
            filt = sample.get("filter", "none")
            row.setdefault("filtered", {})[filt] = _text(sample.get("filtered_resps"))
            for metric in sample.get("metrics", []):
                value = sample.get(metric)
                if isinstance(value, bool):
                    value = float(value)
                if not isinstance(value, (int, float)):
                    continue  # e.g. bleu's (reference, prediction) pairs: corpus-level only
                column = _metric_name(task, metric, filt)[len("eval/"):]
                row[column] = float(value)
                columns.setdefault((metric, filt), []).append((row["prompt_id"], float(value)))
        for (metric, filt), pairs in columns.items():
            name = _metric_name(task, metric, filt)
            value = out["results"][task].get(f"{metric},{filt}")
            stderr = out["results"][task].get(f"{metric}_stderr,{filt}")
            values = np.array([v for _, v in pairs])
            if value is None:
                continue
            metrics[name] = reported_metric(float(value), _number(stderr), "lm_eval", values,
                                            mean=_is_mean(config, metric), column=name[len("eval/"):],
                                            higher_is_better=higher.get(task, {}).get(metric))
    for group, subtasks in (out.get("group_subtasks") or {}).items():
        if not subtasks:
            continue
        for key, value in out["results"].get(group, {}).items():
            metric, _, filt = key.partition(",")
            if not filt or "_stderr" in metric or not isinstance(value, (int, float)):
                continue
            stderr = out["results"][group].get(f"{metric}_stderr,{filt}")
            count = sum(len(out["samples"].get(t, [])) for t in subtasks)
            metrics[_metric_name(group, metric, filt)] = reported_metric(float(value), _number(stderr), "lm_eval",
                                                                         n=count)
    summary = {"tasks": sorted(out.get("samples", {})), "groups": dict(out.get("group_subtasks") or {}),
               "n_shot": out.get("n-shot", {}), "versions": out.get("versions", {}),
               "n_samples": out.get("n-samples", {}), "config": out.get("config", {}),
               "lm_eval_version": out.get("lm_eval_version")}
    return metrics, list(rows.values()), summary


def _number(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):  # lm-eval writes "N/A" where it has no stderr
        return None
    return number if math.isfinite(number) else None


def _context(sample: dict) -> str:
    args = sample.get("arguments") or [[""]]
    first = args[0]
    return str(first[0] if isinstance(first, (list, tuple)) else first)


def _first_response(sample: dict) -> str:
    resps = sample.get("resps") or [[""]]
    return _text(resps[0][0] if isinstance(resps[0], (list, tuple)) and resps[0] else resps[0])


def _text(value: Any) -> Any:
    """lm-eval's nested lists of strings and (logprob, greedy) tuples as JSON."""
    return json.loads(json.dumps(value, default=str))


def in_memory_lm(model: Any, tokenizer: Any, batch_size: int | str = 1, device: str = "cpu") -> Any:
    """lm-eval's ``hf`` model around a model already in memory (a trainer's policy): the same code path as a
    directory, without saving it. A LoRA policy (peft) is passed as its base with the adapters injected, which
    its forward applies."""
    from lm_eval.models.huggingface import HFLM  # noqa: PLC0415

    module = model.get_base_model() if hasattr(model, "get_base_model") else model
    return HFLM(pretrained=module, tokenizer=tokenizer, batch_size=batch_size, device=device)


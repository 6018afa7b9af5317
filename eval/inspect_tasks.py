"""Inspect tasks inside ``verl eval`` (``--inspect-task FILE.py@task``).

    verl eval --ckpt C --inspect-task tasks.py@sums [--inspect-grader builtin:smollm2-135m-instruct] \
        [--inspect-arg epochs=4] [--service URL]

Inspect (``inspect_ai.eval``) runs the task itself — its dataset, solvers, scorers, epochs and reducers — against
an OpenAI-compatible endpoint through its ``openai-api`` provider: our service, started here on the checkpoint at
127.0.0.1 (served as ``policy``, with the grader model beside it as ``grader`` when ``--inspect-grader`` names one)
or a running one (``--service URL``: its first model, or ``--inspect-arg model=NAME``). A model-graded scorer gets
the grader through Inspect's ``grader`` model role, at temperature 0. Inspect's own log goes to ``<out>/inspect``.

What comes back is ``verl eval``'s: ``results.json`` with each scorer metric as
``eval/inspect/<task>/<scorer>/<metric>`` (Inspect's value and stderr, ``inspect_stderr``; a mean metric also our
clustered SE and 95% CI from the samples' per-epoch values), and ``samples.jsonl`` with one row per (sample,
epoch): ``prompt_id`` ``inspect:<task>:<sample id>:<input hash>``, ``sample`` the epoch, the input, the
completion, each scorer's value as a number (Inspect's ``value_to_float``: C 1, P 0.5, I 0), so ``verl compare``
pairs samples as for any evaluation.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from verl.errors import ConfigError, VerlError
from verl.evaluators.stats import reported_metric

PREFIX = "eval/inspect/"
SERVICE = "verl"  # openai-api/verl/<model>: Inspect reads VERL_API_KEY and the base URL we pass


# --inspect-arg KEY=VALUE: what `inspect eval` users pass most, parsed as its CLI parses it.
ARGS: dict[str, Callable[[str], Any]] = {
    "epochs": int, "epochs_reducer": str, "limit": int, "temperature": float, "top_p": float,
    "max_tokens": int, "seed": int, "max_connections": int, "model": str,
}


def parse_args(raw: list[str] | None) -> dict[str, Any]:
    from verl.utils.cli import key_values  # noqa: PLC0415

    return key_values(raw, "--inspect-arg", ARGS, "Inspect", "epochs=4")


def check_task_spec(spec: str) -> None:
    path = spec.partition("@")[0]
    if not Path(path).is_file():
        raise ConfigError(f"--inspect-task {spec}: no such file {path!r} (give FILE.py@task)")


@contextlib.contextmanager
def served(model_dir: str, grader: str | None) -> Iterator[str]:
    """Our service on 127.0.0.1 (a free port) in a thread: ``policy`` (and ``grader``); yields its base URL."""
    from serve.api import create_app  # noqa: PLC0415
    from serve.settings import load_settings  # noqa: PLC0415
    from verl.utils.net import running_app  # noqa: PLC0415

    models = [{"name": "policy", "path": model_dir}] + ([{"name": "grader", "path": grader}] if grader else [])
    settings = load_settings(None, load_in_background=False, models=models)
    with running_app(create_app(settings), timeout=120, name=f"service for {model_dir}") as url:
        yield url


def first_model(url: str) -> str:
    import httpx  # noqa: PLC0415

    try:
        data = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
    except Exception as exc:  # noqa: BLE001 - any failure here is the same fix
        raise ConfigError(f"--service {url}: no model list at /v1/models ({exc}); is it a verl serve URL?") from None
    return data[0]["id"]


def run_inspect(specs: list[str], url: str, model: str, grader: str | None, args: dict[str, Any],
                log_dir: Path) -> list[Any]:
    """``inspect_ai.eval`` of ``specs`` on ``openai-api/verl/<model>`` at ``url``; the grader role at temperature 0."""
    try:
        import inspect_ai  # noqa: PLC0415
        from inspect_ai.model import GenerateConfig, get_model  # noqa: PLC0415
    except ImportError:
        raise VerlError("--inspect-task needs Inspect: pip install 'inspect-ai>=0.3.285'") from None
    os.environ.setdefault(f"{SERVICE.upper()}_API_KEY", "none")  # our service takes none unless configured
    base = f"{url}/v1"
    roles = None
    if grader:
        roles = {"grader": get_model(f"openai-api/{SERVICE}/{grader}", base_url=base,
                                     config=GenerateConfig(temperature=0.0))}
    generate = {k: args[k] for k in ("temperature", "top_p", "max_tokens", "seed", "max_connections") if k in args}
    epochs = args.get("epochs")
    if epochs is not None and "epochs_reducer" in args:
        from inspect_ai import Epochs  # noqa: PLC0415

        epochs = Epochs(epochs, args["epochs_reducer"])
    logs = inspect_ai.eval(list(specs), model=f"openai-api/{SERVICE}/{model}", model_base_url=base,
                           model_roles=roles, log_dir=str(log_dir), display="none", limit=args.get("limit"),
                           epochs=epochs, **generate)
    failed = [log for log in logs if log.status != "success"]
    if failed:
        error = failed[0].error.message if failed[0].error else failed[0].status
        raise VerlError(f"Inspect task {failed[0].eval.task} did not finish: {error}")
    return logs


def convert(logs: list[Any]) -> tuple[dict[str, dict], list[dict]]:
    """Inspect's logs -> (our metrics, samples.jsonl rows)."""
    from inspect_ai.scorer import value_to_float  # noqa: PLC0415

    to_float = value_to_float()
    metrics: dict[str, dict] = {}
    rows: list[dict] = []
    for log in logs:
        task = log.eval.task.split("/")[-1]
        columns: dict[str, list[tuple[str, float]]] = {}
        for sample in log.samples or []:
            text = sample.input if isinstance(sample.input, str) else json.dumps(
                [m.model_dump(mode="json") for m in sample.input])
            digest = hashlib.sha256(text.encode()).hexdigest()[:16]
            row = {"prompt_id": f"inspect:{task}:{sample.id}:{digest}", "index": len(rows),
                   "sample": int(sample.epoch) - 1, "task": task, "prompt": text,
                   "response": sample.output.completion if sample.output else "",
                   "ground_truth": sample.target, "data_source": f"inspect:{task}", "response_length": None}
            for scorer, score in (sample.scores or {}).items():
                value = float(to_float(score.value))
                row[f"inspect/{task}/{scorer}"] = value if math.isfinite(value) else None
                row.setdefault("answers", {})[scorer] = score.answer
                if math.isfinite(value):
                    columns.setdefault(scorer, []).append((row["prompt_id"], value))
            rows.append(row)
        for result in log.results.scores if log.results else []:
            stderr = result.metrics.get("stderr")
            pairs = columns.get(result.name, [])
            values = np.array([v for _, v in pairs])
            for name, metric in result.metrics.items():
                if name == "stderr":
                    continue
                mean = name in ("accuracy", "mean") and result.reducer in (None, "mean")
                ours = reported_metric(float(metric.value), None if stderr is None else float(stderr.value),
                                       "inspect", values, mean=mean, clusters=np.array([p for p, _ in pairs]),
                                       column=f"inspect/{task}/{result.name}", higher_is_better=True if mean else None)
                ours["reducer"] = result.reducer
                metrics[f"{PREFIX}{task}/{result.name}/{name}"] = ours
    return metrics, rows


def run_inspect_tasks(target: Any, settings: Any, out: str | Path | None, console: Any, run_cfg: Any) -> dict:
    """``verl eval --ckpt TARGET --inspect-task ...`` on one checkpoint or model (or ``--service URL``);
    ``run_cfg``: the checkpoint's run, whose training prompts the samples' inputs are checked against."""
    from eval.report import write_tool_report  # noqa: PLC0415
    from eval.results import SCHEMA, model_hash, versions, write_results  # noqa: PLC0415
    from verl.models.loader import resolve_model_path  # noqa: PLC0415

    for spec in settings.inspect_tasks:
        check_task_spec(spec)
    args = parse_args(settings.inspect_args)
    if target.kind == "run":
        raise ConfigError("--inspect-task evaluates one checkpoint: give --ckpt RUN/checkpoints/global_step_N")
    model_dir = target.path if Path(target.path).is_dir() else resolve_model_path(target.path)
    grader = settings.inspect_grader
    out_dir = Path(out) if out is not None else (
        Path(target.run_dir) / "eval" / "inspect" / target.label if target.run_dir else
        Path("outputs") / "eval" / "inspect" / target.label)
    t0 = time.perf_counter()
    if settings.service:
        url = settings.service.rstrip("/")
        model = args.get("model") or first_model(url)
        logs = run_inspect(settings.inspect_tasks, url, model, grader, args, out_dir / "inspect")
    else:
        grader_dir = None if grader is None else (grader if Path(grader).is_dir() else resolve_model_path(grader))
        with served(model_dir, grader_dir) as url:
            logs = run_inspect(settings.inspect_tasks, url, "policy", "grader" if grader else None, args,
                               out_dir / "inspect")
    metrics, samples = convert(logs)
    from eval import contamination as contamination_check  # noqa: PLC0415

    contamination = contamination_check.of_samples(samples, metrics, run_cfg, settings.strict)
    results = {
        "schema": SCHEMA, "label": target.label, "checkpoint": str(model_dir), "step": target.step,
        "run_dir": str(target.run_dir) if target.run_dir else None, "model_hash": model_hash(model_dir),
        "created": datetime.now().isoformat(timespec="seconds"),
        "sampling": {"engine": "inspect", "n": args.get("epochs", 1), "temperature": args.get("temperature"),
                     "seed": args.get("seed")},
        "data": {"files": [f"inspect:{s}" for s in settings.inspect_tasks],
                 "num_prompts": len({r["prompt_id"] for r in samples}), "num_samples": len(samples)},
        "evaluators": ["inspect"], "metrics": metrics, "contamination": contamination, "notes": [], "config": None,
        "inspect": {"tasks": settings.inspect_tasks, "args": args, "grader": grader, "service": settings.service,
                    "logs": [str(log.location) for log in logs]},
        "versions": versions(), "device": "service", "timing": {"total_seconds": time.perf_counter() - t0},
    }
    write_results(out_dir, results, samples)
    write_tool_report(out_dir, results, samples, "Inspect", f"Inspect tasks {', '.join(settings.inspect_tasks)} "
                      f"on {'the service ' + settings.service if settings.service else 'our service'}"
                      + (f", grader {grader}" if grader else "") + f", options {json.dumps(args) or '{}'}",
                      "inspect_stderr")
    if console is not None and not settings.quiet:
        console.print(f"{target.label}: " + "  ".join(f"{k[len(PREFIX):]}={m['value']:.4f}" for k, m in metrics.items())
                      + f"  -> {out_dir}", highlight=False, soft_wrap=True)
    return results

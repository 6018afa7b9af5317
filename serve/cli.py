"""``verl export``, ``verl serve``, ``verl promote`` and ``verl data from-records``, contributed to the ``verl`` CLI
through the ``verl.commands`` entry point (pyproject.toml).

Heavy imports (torch, transformers, fastapi, uvicorn) happen inside the commands, so ``verl --help`` works in an
environment without the serving extra.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.text import Text

from verl.utils.cli import command_group, err, new_console, run_guarded


def export_command(
    to: Annotated[Path, typer.Option("--to", help="Output directory (a self-contained HF model dir).")],
    run: Annotated[Path | None, typer.Option("--run", help="Run dir (outputs/<project>/<experiment>).")] = None,
    ckpt: Annotated[Path | None, typer.Option("--ckpt", help="A checkpoint/model dir instead of --run.")] = None,
    select: Annotated[str, typer.Option("--select", help="With --run: best, latest or global_step_N.")] = "best",
    metric: Annotated[str | None, typer.Option(
        "--metric", help="With --select best: METRIC[:max|min] (default eval/accuracy:max).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing export at --to.")] = False,
    base: Annotated[str | None, typer.Option(
        "--base", help="LoRA checkpoints: the base model, if it moved since training.")] = None,
    dtype: Annotated[str, typer.Option("--dtype", help="auto (as saved), float32, bfloat16 or float16.")] = "auto",
    logs: Annotated[Path | None, typer.Option(
        "--logs", help="verl_logs.jsonl (or its dir) when it is not in the run dir.")] = None,
    no_verify: Annotated[bool, typer.Option(
        "--no-verify", help="Skip reloading the export to compare logits (saves memory on big models).")] = False,
) -> None:
    """Export a checkpoint as a servable HF model dir (LoRA merged, safetensors, tokenizer, export.json)."""

    def _run() -> None:
        from serve.export import run_export
        from verl.errors import ConfigError
        from verl.utils.log import quiet_hf

        if dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"--dtype '{dtype}' must be auto, float32, bfloat16 or float16")
        quiet_hf()
        path, selection = run_export(to, run=run, ckpt=ckpt, select=select, metric=metric, force=force,
                                     base=base, dtype=dtype, logs=logs, verify=not no_verify)
        console = new_console()
        for note in selection.notes:
            console.print(Text.assemble(("note:", "yellow"), f" {note}"), soft_wrap=True)
        why = selection.selected_by
        if selection.metric:
            m = selection.metric
            value = "?" if m["value"] is None else f"{m['value']:.4g}"
            why += f" by {m['name']}:{m['mode']} = {value} (from {m['source']})"
        console.print(f"exported {selection.checkpoint} (step {selection.step}, {why}) -> {path}", soft_wrap=True)
        console.print(f"serve it: VERL_SERVE_MODEL={path} uvicorn serve.api:app --host 127.0.0.1 --port 8000",
                      soft_wrap=True)

    run_guarded(_run)


def serve_command(
    model: Annotated[str | None, typer.Option("--model", help="Model dir or builtin:NAME "
                                              "(default: VERL_SERVE_MODEL or builtin:tiny-arith).")] = None,
    host: Annotated[str | None, typer.Option("--host", help="Bind address (default 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option("--port", help="Port (default 8000).")] = None,
    engine: Annotated[str | None, typer.Option("--engine", help="auto, transformers or vllm.")] = None,
    config: Annotated[Path | None, typer.Option("--config", "-c", help="serve.yaml settings file.")] = None,
    replicas: Annotated[int | None, typer.Option("--replicas", min=1, help="Run N replicas on Ray Serve with "
                                                 "one control plane (docs/serving.md); without it: one uvicorn "
                                                 "process.")] = None,
    ray_address: Annotated[str | None, typer.Option("--ray-address", help="Join this Ray cluster (e.g. "
                                                    "127.0.0.1:6379 after `ray start --head`).")] = None,
    max_replicas: Annotated[int | None, typer.Option("--max-replicas", help="Autoscale between --replicas and "
                                                     "this many (Ray Serve, by ongoing requests).")] = None,
) -> None:
    """Run the inference service (same app as `uvicorn serve.api:app`); Ctrl-C drains and stops it."""

    def _run() -> None:
        overrides = {k: v for k, v in {"model": model, "host": host, "port": port, "engine": engine}.items()
                     if v is not None}
        if replicas is not None or ray_address or max_replicas:
            from serve.fleet import run_fleet

            run_fleet(str(config) if config else None, overrides, replicas or 1, ray_address, max_replicas)
            return
        import uvicorn

        from serve.api import create_app
        from serve.settings import load_settings

        # Load before accepting traffic here: a bad model path fails the command with its message.
        settings = load_settings(config, load_in_background=False, **overrides)
        app = create_app(settings)
        uvicorn.run(app, log_level="info", **uvicorn_options(settings))

    run_guarded(_run)


def promote_command(
    service: Annotated[str, typer.Option("--service", help="The service's URL, e.g. http://127.0.0.1:8000.")],
    model: Annotated[str, typer.Option("--model", help="The model (or adapter) to give traffic to.")],
    route: Annotated[str, typer.Option("--route", help="The route to change.")] = "default",
    weight: Annotated[float, typer.Option("--weight", help="Its share of the route, 0-1; the other models "
                                          "keep their proportions of the rest.")] = 1.0,
    path: Annotated[str | None, typer.Option("--path", help="Load --model first from this export dir.")] = None,
    adapter: Annotated[str | None, typer.Option("--adapter", help="Load --model first as this LoRA adapter "
                                                "(over --base).")] = None,
    base: Annotated[str | None, typer.Option("--base", help="The full model an --adapter applies to.")] = None,
    unload: Annotated[list[str] | None, typer.Option("--unload", help="Unload this model afterwards "
                                                     "(repeatable); its requests finish first.")] = None,
    admin_key: Annotated[str | None, typer.Option("--admin-key", help="The service's admin_api_key (default: "
                                                  "$VERL_SERVE_ADMIN_API_KEY).")] = None,
) -> None:
    """Shift a route's traffic on a running service (canary, promote, roll back) without a restart."""

    def _run() -> None:
        import json

        from serve.promote import promote

        state = promote(service, route, model, weight, admin_key, path, adapter, base, unload)
        new_console(stderr=False).print_json(json.dumps(state))

    run_guarded(_run)


def data_from_records(
    records: Annotated[list[str], typer.Argument(help="Records files (a service's records_path) or service URLs "
                                                      "(their /admin/records; a fleet's holds every replica's).")],
    out: Annotated[Path, typer.Option("--out", help="Output directory: train/val.parquet, pairs/, summary.json.")
                   ] = Path("data/from-records"),
    route: Annotated[list[str] | None, typer.Option("--route", help="Only requests to this route (repeatable).")
                     ] = None,
    model: Annotated[list[str] | None, typer.Option("--model", help="Only answers of this model (repeatable).")] = None,
    since: Annotated[float | None, typer.Option("--since", help="Only records after this Unix time.")] = None,
    until: Annotated[float | None, typer.Option("--until", help="Only records before this Unix time.")] = None,
    reward_source: Annotated[str | None, typer.Option("--reward-source", help="The rewards exported: rule, "
                                                      "feedback, rm:NAME or judge:NAME (needed when the records "
                                                      "hold several; sources are never mixed).")] = None,
    min_rewards: Annotated[int, typer.Option("--min-rewards", help="Prompts with fewer rewarded answers are "
                                             "dropped (0: keep prompts without any).")] = 1,
    prompts: Annotated[str, typer.Option("--prompts", help="Which prompts: chat (messages, the default) or "
                                         "completion (/v1/completions texts); one file holds one kind.")] = "chat",
    near_dup: Annotated[float, typer.Option("--near-dup", help="Jaccard similarity (character 5-grams) at which a "
                                            "prompt is a near duplicate of an earlier one; 1 turns it off.")] = 0.8,
    val_fraction: Annotated[float, typer.Option("--val-fraction", help="Share of user groups held out (no user "
                                                "in both files).")] = 0.1,
    seed: int = 0,
    admin_key: Annotated[str | None, typer.Option("--admin-key", help="A service URL's admin_api_key (default: "
                                                  "$VERL_SERVE_ADMIN_API_KEY).")] = None,
) -> None:
    """A service's online records into training data: prompts with their rewards and lineage, preference pairs for
    `verl rm`, deduplicated and split by user; records marked not-for-training are never exported."""

    def _run() -> None:
        from serve.from_records import RecordFilters, export_records, summary_line

        filters = RecordFilters(routes=route or None, models=model or None, since=since, until=until,
                                reward_source=reward_source, min_rewards=min_rewards, prompts=prompts)
        summary = export_records(records, out, filters, val_fraction=val_fraction, near_dup_threshold=near_dup,
                                 seed=seed, admin_key=admin_key)
        err.print(summary_line(summary), highlight=False, soft_wrap=True)
        err.print(f"-> {out} (summary.json says which records went where and why)", highlight=False)

    run_guarded(_run)


def register(app: typer.Typer) -> None:
    """Attach this module's commands to the ``verl`` app."""
    app.command("export")(export_command)
    app.command("serve")(serve_command)
    app.command("promote")(promote_command)
    command_group(app, "data").command("from-records")(data_from_records)


def uvicorn_options(settings) -> dict:
    """What ``verl serve`` tells uvicorn beyond the app: bind address, shutdown grace, and the connection deadlines
    (headers, keep-alive) that ``uvicorn serve.api:app`` alone does not have."""
    from serve.http_protocol import protocol_with_header_timeout

    grace = settings.drain_grace_s + settings.shutdown_timeout_s + 1
    return {"host": settings.host, "port": settings.port, "timeout_graceful_shutdown": int(grace) + 1,
            "http": protocol_with_header_timeout(settings.header_timeout_s),
            "timeout_keep_alive": max(1, round(settings.keep_alive_timeout_s))}

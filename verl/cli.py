"""The ``verl`` command.

    verl train [--config FILE] [key=value ...]     RL post-training (GRPO by default, on the built-in task)
    verl sft [--config FILE] [key=value ...]       supervised warm start
    verl rm [--config FILE] [key=value ...]        reward model on preference pairs
    verl data arithmetic --out DIR                 write the built-in task's parquet files
    verl data pairs --model M --out DIR            preference pairs from a model's own answers
    verl check-env                                 what is installed, what is missing, how to fix it
    verl sandbox serve                             run untrusted code isolated (SandboxFusion's /run_code)

Errors a user can act on (``VerlError``) print as one line and exit 1; ``--debug`` shows the traceback.
The packages add their own commands (eval, compare, export, serve, loadtest, tensorboard, dashboard, ...) through
``COMMANDS`` below.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from verl.registry import Registry
from verl.trainer.cli import train_command
from verl.utils.cli import OVERRIDE_CONTEXT, STATE, err, run_guarded, split_overrides
from verl.utils.log import quiet_hf

app = typer.Typer(name="verl", help="RL post-training for causal LMs: train, evaluate, compare, export, serve.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  context_settings={"help_option_names": ["-h", "--help"]})


@app.callback()
def main_options(
    debug: Annotated[bool, typer.Option("--debug", help="Show full tracebacks.")] = False,
) -> None:
    STATE["debug"] = debug or os.environ.get("VERL_DEBUG") == "1"


app.command("train", context_settings=OVERRIDE_CONTEXT)(train_command)


@app.command(context_settings=OVERRIDE_CONTEXT)
def sft(
    ctx: typer.Context,
    config: Annotated[Path | None, typer.Option("--config", "-c", help="YAML config (default: tiny SFT).")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q")] = False,
    build_warm_start: Annotated[bool, typer.Option(
        "--build-warm-start", help="Rebuild a shipped warm start (--warm-start) into the cache, for a checkout "
                                   "whose verl/models/assets copy is missing.")] = False,
    warm_start: Annotated[str, typer.Option(
        "--warm-start", help="Which one --build-warm-start rebuilds: tiny-arith or tiny-agent.")] = "tiny-arith",
) -> None:
    """Supervised fine-tuning (the warm start before RL). Extra args are key=value overrides."""

    def _run():
        from verl.config import SFTConfig, load_config
        from verl.trainer.sft import SFTTrainer

        quiet_hf()
        if build_warm_start:
            from verl.models.loader import warm_start_cache_dir
            from verl.trainer.sft import train_builtin_warm_start

            target = warm_start_cache_dir(warm_start)
            train_builtin_warm_start(target, warm_start)
            err.print(f"builtin:{warm_start} rebuilt in {target}")
            return
        cfg = load_config(config, split_overrides(list(ctx.args)), schema=SFTConfig, default_name="sft_tiny")
        path = SFTTrainer(cfg, quiet=quiet).fit()
        err.print(f"final checkpoint: {path}")

    run_guarded(_run)


@app.command(context_settings=OVERRIDE_CONTEXT)
def rm(
    ctx: typer.Context,
    config: Annotated[Path | None, typer.Option("--config", "-c", help="YAML config (default: the tiny model on "
                                                "the built-in arithmetic pairs).")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q")] = False,
) -> None:
    """Train a reward model on preference pairs (Bradley-Terry). Extra args are key=value overrides."""

    def _run():
        from verl.config import RMConfig, load_config
        from verl.trainer.rm import RewardModelTrainer

        quiet_hf()
        cfg = load_config(config, split_overrides(list(ctx.args)), schema=RMConfig, default_name="rm_tiny")
        trainer = RewardModelTrainer(cfg, quiet=quiet)
        path = trainer.fit()
        err.print(f"final checkpoint: {path}  best held-out pairwise accuracy: {trainer.best_accuracy:.3f}")

    run_guarded(_run)


data_app = typer.Typer(help="Write datasets in the trainer's parquet format.", no_args_is_help=True)
app.add_typer(data_app, name="data")


@data_app.command("arithmetic")
def data_arithmetic(out: Annotated[Path, typer.Option("--out", help="Output directory.")] = Path("data/arithmetic"),
                    min_digits: int = 1, max_digits: int = 3, num_train: int = 20000, num_val: int = 256,
                    seed: int = 1234) -> None:
    """Write train/val (and sft_train/sft_val) parquet files of the built-in arithmetic task."""

    def _run():
        from verl.data.builtin import write_arithmetic
        from verl.data.tasks.arithmetic import ArithmeticSpec

        spec = ArithmeticSpec(min_digits=min_digits, max_digits=max_digits, num_train=num_train, num_val=num_val,
                              seed=seed)
        for name, path in write_arithmetic(out, spec).items():
            err.print(f"{name}: {path}")

    run_guarded(_run)


env_app = typer.Typer(help="Environments: serve our sources to other frameworks (docs/environments.md).",
                      no_args_is_help=True)
app.add_typer(env_app, name="env")


@env_app.command("serve")
def env_serve(
    source: Annotated[str, typer.Argument(help="A data source (builtin:arithmetic/val, reasoning_gym:..., a parquet "
                                          "file): one OpenEnv episode per row.")],
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to bind.")] = 8010,
    max_concurrent_envs: Annotated[int, typer.Option(help="OpenEnv sessions at once (more get CAPACITY_REACHED).")] = 8,
) -> None:
    """Serve a source as an OpenEnv server (openenv's create_app): reset(seed=i) opens row i, step scores the answer
    with the row's reward and ends the episode."""

    def _run():
        import uvicorn

        from verl.envs.openenv_server import build_app

        app_ = build_app(source, max_concurrent_envs)
        err.print(f"serving {source} as an OpenEnv environment on http://{host}:{port} (/ws sessions, /schema)",
                  soft_wrap=True)
        uvicorn.run(app_, host=host, port=port, log_level="warning")

    run_guarded(_run)


@data_app.command("materialize")
def data_materialize(
    source: Annotated[str, typer.Argument(help="A data source: reasoning_gym:DATASET?..., builtin:TASK/SPLIT, a "
                                          "parquet file (quote it on a shell line: ? and & are the shell's).")],
    out: Annotated[Path, typer.Option("--out", help="Output directory: DIR/data.parquet.")],
    disjoint_from: Annotated[list[str] | None, typer.Option(
        "--disjoint-from", help="Training sources this is validation data for (repeatable): generated items are "
        "taken after theirs and questions equal to theirs dropped, as the trainer does.")] = None,
) -> None:
    """Write a source's rows as parquet, with ``source``, ``seed`` and ``index`` columns (a sample's identity)."""

    def _run():
        from verl.data.builtin import write_parquet
        from verl.data.dataset import read_rows

        rows = read_rows([source], "SOURCE", disjoint_from=disjoint_from or ())
        clean = []
        for row in rows:
            info = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
            clean.append({**{k: v for k, v in row.items() if not k.startswith("__")},
                          "source": source, "seed": info.get("seed"), "index": info.get("index", row["__row__"])})
        err.print(f"{len(clean)} rows of {source}: {write_parquet(clean, out / 'data.parquet')}", soft_wrap=True)

    run_guarded(_run)


@data_app.command("word-problems")
def data_word_problems(
    out: Annotated[Path, typer.Option("--out", help="Output directory.")] = Path("data/word_problems"),
) -> None:
    """Write train/val parquet files of the built-in GSM8K-style word problems (held-out number pairs)."""

    def _run():
        from verl.data.builtin import write_parquet
        from verl.data.tasks.word_problems import WordProblemSpec, generate_splits

        for name, rows in generate_splits(WordProblemSpec()).items():
            err.print(f"{name}: {write_parquet(rows, out / f'{name}.parquet')}")

    run_guarded(_run)


@data_app.command("pairs")
def data_pairs(
    model: Annotated[str, typer.Option("--model", help="The model that answers: a checkpoint dir or builtin:NAME.")],
    data: Annotated[list[str], typer.Option("--data", help="Rule-scored prompts (parquet or builtin:TASK/SPLIT); "
                                            "repeatable.")] = ["builtin:arithmetic/train"],  # noqa: B006
    out: Annotated[Path, typer.Option("--out", help="Output directory (train.parquet, val.parquet).")] = Path(
        "data/pairs"),
    n: Annotated[int, typer.Option("--n", help="Answers sampled per prompt.")] = 4,
    temperature: Annotated[float, typer.Option("--temperature")] = 1.0,
    max_prompts: Annotated[int, typer.Option("--max-prompts", help="Prompts sampled (the first N).")] = 1000,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens")] = 16,
    max_prompt_length: Annotated[int, typer.Option("--max-prompt-length", help="Longer prompts are skipped.")] = 64,
    pairs_per_prompt: Annotated[int, typer.Option("--pairs-per-prompt")] = 1,
    val_fraction: Annotated[float, typer.Option("--val-fraction", help="Share of prompts held out.")] = 0.1,
    seed: int = 0,
) -> None:
    """Preference pairs from a model's own answers: correct (by the task's rule) chosen over incorrect, for `verl rm`
    (an outcome reward model)."""

    def _run():
        from verl.trainer.self_pairs import sample_pairs, write_pairs

        quiet_hf()
        rows, stats = sample_pairs(model, data, n=n, temperature=temperature, max_prompts=max_prompts,
                                   max_new_tokens=max_new_tokens, max_prompt_length=max_prompt_length,
                                   pairs_per_prompt=pairs_per_prompt, seed=seed)
        err.print(stats.line())
        for name, path in write_pairs(rows, out, val_fraction, seed).items():
            err.print(f"{name}: {path}")

    run_guarded(_run)


@data_app.command("decontaminate")
def data_decontaminate(
    train: Annotated[list[str], typer.Argument(help="Training parquet file(s) to clean.")],
    against: Annotated[list[str], typer.Option("--against", help="Evaluation prompts (parquet or builtin:TASK/SPLIT) "
                                               "that must not be in the training data; repeatable.")],
    out: Annotated[Path, typer.Option("--out", help="The cleaned training file (parquet).")],
    prompt_key: Annotated[str, typer.Option("--prompt-key", help="The prompt column on both sides.")] = "prompt",
    ngram: Annotated[int, typer.Option("--ngram", help="Word n-gram length of an overlap (lm-evaluation-harness: "
                                       "13).")] = 13,
) -> None:
    """Remove from training data every prompt that overlaps the evaluation prompts: equal after normalisation, or
    sharing a word 13-gram (lm-evaluation-harness's decontamination)."""

    def _run():
        from verl.data.builtin import write_parquet
        from verl.data.contamination import TrainingIndex, prompts_of
        from verl.data.dataset import read_rows

        index = TrainingIndex.of(prompts_of(against, prompt_key, "--against"), ngram)
        rows = read_rows(train, "TRAIN")
        kinds = index.overlaps_rows(rows, prompt_key)
        kept = [{k: v for k, v in r.items() if not k.startswith("__")} for r, kind in zip(rows, kinds, strict=True)
                if kind is None]
        exact = sum(k == "exact" for k in kinds)
        err.print(f"{len(rows)} training rows: {len(rows) - len(kept)} overlap the {index.size} evaluation prompts "
                  f"({exact} exactly, {len(rows) - len(kept) - exact} by a shared {ngram}-gram) and are removed; "
                  f"{write_parquet(kept, out)}", highlight=False, soft_wrap=True)

    run_guarded(_run)


@data_app.command("gsm8k")
def data_gsm8k(
    src: Annotated[Path, typer.Option("--src", help="Directory with GSM8K's train/test parquet (config 'main').")],
    out: Annotated[Path, typer.Option("--out", help="Output directory.")] = Path("data/gsm8k"),
) -> None:
    """Convert the GSM8K parquet files into the trainer's format (prompt messages + ground truth)."""

    def _run():
        from verl.data.gsm8k import convert_gsm8k

        for name, path in convert_gsm8k(src, out).items():
            err.print(f"{name}: {path}")

    run_guarded(_run)


@app.command("check-env")
def check_env_command(
    build_kernels: Annotated[bool, typer.Option(
        "--build-kernels", help="Build verl's CPU kernels now (once per machine, ~1 min) instead of at the first "
        "model load; the kernels' line then says built, or why not.")] = False,
) -> None:
    """Check Python, torch, transformers and the optional parts; print the fix for each problem."""
    from verl.models.cpu_kernels import build_ahead, status
    from verl.sandbox.isolation import check as sandbox_check
    from verl.utils.env_check import check_env

    def _run() -> bool:
        if build_kernels:
            build_ahead()  # a failed build in auto mode is reported by the kernels' line below
        return check_env(extra=[status(), sandbox_check()])

    ok = run_guarded(_run)
    raise typer.Exit(0 if ok else 1)


# The command groups the packages contribute (docs/architecture.md, "Package map"): each entry is a function
# ``register(app)`` that attaches its commands. The core's own are here; the packages above it (eval, serve,
# loadtest) declare theirs as entry points of the group ``verl.commands`` in pyproject.toml, so the core names none
# of them. Each module imports only typer at its top, so ``verl train`` pays nothing for them.
COMMANDS: Registry[Callable[[typer.Typer], None]] = Registry("command group", group="verl.commands")
COMMANDS.lazy("tracking", "verl.tracking.cli:register")
COMMANDS.lazy("dashboard", "verl.dashboard.cli:register")
COMMANDS.lazy("sandbox", "verl.sandbox.cli:register")


def register_subcommands() -> None:
    """Attach every contributed command group's commands to ``app``."""
    for name in COMMANDS.available():
        COMMANDS[name](app)


def main() -> None:
    register_subcommands()
    app(prog_name="verl")


if __name__ == "__main__":
    sys.exit(main())

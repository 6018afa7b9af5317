"""The ``verl`` command.

    verl train [--config FILE] [key=value ...]     RL post-training (GRPO by default, on the built-in task)
    verl sft [--config FILE] [key=value ...]       supervised warm start
    verl rm [--config FILE] [key=value ...]        reward model on preference pairs
    verl data arithmetic --out DIR                 write the built-in task's parquet files
    verl data pairs --model M --out DIR            preference pairs from a model's own answers
    verl check-env                                 what is installed, what is missing, how to fix it

Errors a user can act on (``VerlError``) print as one line and exit 1; ``--debug`` shows the traceback.
Feature modules add their own commands (eval, compare, export, tensorboard, dashboard, ...) in
``register_subcommands`` below.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from verl.errors import VerlError
from verl.utils.cli import STATE, err, run_guarded
from verl.utils.log import quiet_hf

app = typer.Typer(
    name="verl",
    help="RL post-training for causal LMs: train, evaluate, compare, export, serve.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
# Extra CLI args are dotted overrides: `verl train actor.optim.lr=1e-5 --trainer.total_steps=10`.
OVERRIDE_CONTEXT = {"allow_extra_args": True, "ignore_unknown_options": True}


@app.callback()
def main_options(
    debug: Annotated[bool, typer.Option("--debug", help="Show full tracebacks.")] = False,
) -> None:
    STATE["debug"] = debug or os.environ.get("VERL_DEBUG") == "1"


def _split_overrides(extra: list[str]) -> list[str]:
    bad = [a for a in extra if "=" not in a]
    if bad:
        raise VerlError(f"unexpected argument(s) {bad}; overrides look like key=value, e.g. trainer.total_steps=10")
    return extra


@app.command(context_settings=OVERRIDE_CONTEXT)
def train(
    ctx: typer.Context,
    config: Annotated[Path | None, typer.Option("--config", "-c", help="YAML config (default: built-in GRPO).")] = None,
    log_dir: Annotated[
        Path | None, typer.Option("--log_dir", "--log-dir", help="Directory for verl_logs.jsonl.")
    ] = None,
    log_level: Annotated[str | None, typer.Option("--log_level", "--log-level", help="INFO or DEBUG.")] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Resolve the config and check shapes; load no weights.")
    ] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No console lines.")] = False,
) -> None:
    """RL post-training (PPO / GRPO / RLOO / REINFORCE++ / ReMax). Extra args are key=value overrides."""

    def _run():
        from verl.trainer.resume import load_train_config

        overrides = _split_overrides(list(ctx.args))
        if log_dir is not None:
            overrides.append(f"trainer.log_dir={log_dir}")
        if log_level is not None:
            overrides.append(f"trainer.log_level={log_level.upper()}")
        cfg, resume = load_train_config(config, overrides)
        if resume is not None:
            err.print(resume.summary(), soft_wrap=True, markup=False)
        if dry_run:
            from verl.trainer.dry_run import dry_run as check

            err.print(check(cfg))
            return
        from verl.utils.fs import ensure_writable_dir

        ensure_writable_dir(cfg.trainer.output_dir, "trainer.output_dir")  # before minutes of model loading
        quiet_hf()
        from verl.trainer.factory import build_trainer

        trainer = build_trainer(cfg, quiet=quiet)
        try:
            metrics = trainer.fit()
        finally:
            trainer.shutdown()
        summary = {k: round(v, 4) for k, v in metrics.items() if k.startswith(("eval/accuracy", "rollout/reward_mean"))}
        err.print(f"run directory: {cfg.run_dir()}  {summary}")

    run_guarded(_run)


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
        cfg = load_config(config, _split_overrides(list(ctx.args)), schema=SFTConfig, default_name="sft_tiny")
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
        cfg = load_config(config, _split_overrides(list(ctx.args)), schema=RMConfig, default_name="rm_tiny")
        trainer = RewardModelTrainer(cfg, quiet=quiet)
        path = trainer.fit()
        err.print(f"final checkpoint: {path}  best held-out pairwise accuracy: {trainer.best_accuracy:.3f}")

    run_guarded(_run)


data_app = typer.Typer(help="Write datasets in the trainer's parquet format.", no_args_is_help=True)
app.add_typer(data_app, name="data")


@data_app.command("arithmetic")
def data_arithmetic(
    out: Annotated[Path, typer.Option("--out", help="Output directory.")] = Path("data/arithmetic"),
    min_digits: int = 1,
    max_digits: int = 3,
    num_train: int = 20000,
    num_val: int = 256,
    seed: int = 1234,
) -> None:
    """Write train/val (and sft_train/sft_val) parquet files of the built-in arithmetic task."""

    def _run():
        from verl.data.builtin import write_arithmetic
        from verl.data.tasks.arithmetic import ArithmeticSpec

        spec = ArithmeticSpec(min_digits=min_digits, max_digits=max_digits, num_train=num_train, num_val=num_val,
                              seed=seed)
        for name, path in write_arithmetic(out, spec).items():
            err.print(f"{name}: {path}")

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


@data_app.command("from-records")
def data_from_records(
    records: Annotated[list[str], typer.Argument(help="Records files (a service's records_path) or service URLs "
                                                      "(their /admin/records; a fleet's holds every replica's).")],
    out: Annotated[Path, typer.Option("--out", help="Output directory: train/val.parquet, pairs/, summary.json.")
                   ] = Path("data/from-records"),
    route: Annotated[list[str] | None, typer.Option("--route", help="Only requests to this route (repeatable).")
                     ] = None,
    model: Annotated[list[str] | None, typer.Option("--model", help="Only answers of this model (repeatable).")
                     ] = None,
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

    def _run():
        from serve.from_records import RecordFilters, export_records, summary_line

        filters = RecordFilters(routes=route or None, models=model or None, since=since, until=until,
                                reward_source=reward_source, min_rewards=min_rewards, prompts=prompts)
        summary = export_records(records, out, filters, val_fraction=val_fraction, near_dup_threshold=near_dup,
                                 seed=seed, admin_key=admin_key)
        err.print(summary_line(summary), highlight=False, soft_wrap=True)
        err.print(f"-> {out} (summary.json says which records went where and why)", highlight=False)

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
    from verl.utils.env_check import check_env

    def _run() -> bool:
        if build_kernels:
            build_ahead()  # a failed build in auto mode is reported by the kernels' line below
        return check_env(extra=[status()])

    ok = run_guarded(_run)
    raise typer.Exit(0 if ok else 1)


def register_subcommands() -> None:
    """Attach commands that live with their feature (kept out of this file so each feature owns its CLI). Each
    module imports only typer at its top, so ``verl train`` pays nothing for them. This is the face (DESIGN §2): the
    one module of ``verl`` that may reach eval, serve and loadtest, as imports the architecture test sees."""
    from eval.cli import register as register_eval  # noqa: PLC0415
    from loadtest.cli import register as register_loadtest  # noqa: PLC0415
    from serve.cli import register as register_serve  # noqa: PLC0415
    from verl.dashboard.cli import register as register_dashboard  # noqa: PLC0415
    from verl.tracking.cli import register as register_tracking  # noqa: PLC0415

    for register in (register_tracking, register_dashboard, register_eval, register_serve, register_loadtest):
        register(app)


def main() -> None:
    register_subcommands()
    app(prog_name="verl")


if __name__ == "__main__":
    sys.exit(main())

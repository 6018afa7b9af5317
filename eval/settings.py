"""What ``verl eval`` is asked for: ``EvalSettings``, declared once — each field is also its command-line option
(``verl.utils.cli.option``), so the flag, the Python API and their default cannot disagree.

Light on purpose (dataclasses and typer): ``verl --help`` imports it; the flag checks import the config when run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from verl.errors import ConfigError
from verl.utils.cli import option

DEFAULT_SELECT = "eval/accuracy:max"


def joined_specs(evaluators: list[str] | str | None) -> str | None:
    """``-e a -e b,c`` as ``a,b,c``: every ``-e`` counts (a repeated option used to keep only the last)."""
    return ",".join(evaluators) if isinstance(evaluators, list) else evaluators or None


def tool_names(tools: str | list[str] | None) -> list[str] | None:
    """``--tools calculator,lookup`` as a list of names."""
    if isinstance(tools, str):
        return [t.strip() for t in tools.split(",") if t.strip()] or None
    return tools


@dataclass
class EvalSettings:
    """What the user asked for; ``None`` means "as the run did" (or the built-in default without a run)."""

    data: list[str] | None = option(None, "--data", help="Parquet prompt file(s) or builtin:TASK/SPLIT; default: "
                                    "the run's validation files.")
    evaluators: str | list[str] | None = option(
        None, "--evaluators", "-e", parse=joined_specs, cli_type=list[str] | None,
        help="Comma-separated specs (or -e again): reward,kl,diversity,accuracy,length,tools; on request judge(...), "
             "mismatch, code (rows the code reward ran in the sandbox: pass@k; instead of accuracy); options in "
             "parentheses, e.g. diversity(ngrams=1;2;3, tokenize=chars); your own as "
             "file.py:Class or module:Class. Default: all built-ins.")
    n: int | None = option(None, "--n", help="Samples per prompt (pass@k / maj@k when > 1).")
    temperature: float | None = option(None, "--temperature", help="0 = greedy (the run's validation default).")
    top_p: float | None = option(None, "--top-p")
    top_k: int | None = option(None, "--top-k")
    max_new_tokens: int | None = option(None, "--max-new-tokens")
    seed: int | None = option(None, "--seed", help="Sampling and bootstrap seed (default: the run's).")
    batch_size: int | None = option(None, "--batch-size", help="Prompts per generate() call.")
    max_prompt_length: int | None = option(
        None, "--max-prompt-length", help="Longest prompt in tokens after the chat template (default: the run's "
        "data.max_prompt_length, else 64); longer ones are dropped and counted in the notes.")
    max_samples: int | None = option(None, "--max-samples", help="Evaluate the first N prompts.")
    reference: str | None = option(None, "--reference", help="Reference model for kl (default: the run's "
                                   "model.path).")
    # Multi-turn (agent) rollouts: None = as the run did (rollout.multi_turn); tools or a tool config turn them on.
    tools: list[str] | None = option(None, "--tools", parse=tool_names, cli_type=str | None,
                                     help="Multi-turn (agent) rollouts with these built-in tools, comma-separated "
                                          "(calculator); default: as the run did (rollout.multi_turn).")
    tool_config: str | None = option(None, "--tool-config", help="Multi-turn rollouts with the tools of this YAML "
                                     "file (verl's tool config).")
    max_turns: int | None = option(None, "--max-turns", help="Assistant turns per trajectory (default: the run's "
                                   "max_assistant_turns).")
    select: str = option(DEFAULT_SELECT, "--select", help="Best checkpoint of a run dir by METRIC:max|min.")
    n_bootstrap: int = option(1000, "--bootstrap", help="Bootstrap replicates for CIs without a closed form.")
    engine: str = option("hf", "--engine", help="Rollout engine (hf; vllm when installed).")
    device: str = option("auto", "--device", help="auto, cpu or cuda.")
    num_threads: int | None = option(None, "--threads", help="torch threads (default: the run's).")
    force: bool = option(False, "--force", help="Recompute even when results for the same weights and settings "
                         "exist.")
    quiet: bool = option(False, "--quiet", "-q", help="No progress or summary lines.")
    # Refuse to evaluate prompts that overlap the run's training data (eval/contamination.py) instead of reporting it.
    strict: bool = option(False, "--strict", help="Refuse when evaluation prompts overlap the run's training data "
                          "(exactly or by a 13-gram) instead of reporting it.")
    executor: str = option("local", "--executor", help="A run dir's checkpoints: local (one after another) or ray "
                           "(spread over --workers Ray workers).")
    workers: int = option(1, "--workers", help="With --executor ray: how many workers (one CPU each; RAY_ADDRESS "
                          "joins a cluster).")
    # Every metric per group of prompts (a dataset column, dotted for a dict column: extra_info.kind); eval/groups.py.
    group_by: str | None = option(None, "--group-by", help="Also report every metric per group of prompts: a "
                                  "column of the data, dotted inside a dict column (extra_info.kind, data_source); "
                                  "unset: extra_info.kind when every row has it; none: off.")
    # lm-evaluation-harness tasks instead of verl's own generation and evaluators (eval/lm_eval_tasks.py).
    lm_eval_tasks: list[str] | None = option(None, "--lm-eval-task", help="Run this lm-evaluation-harness task (a "
                                             "name it knows, or a task YAML file; repeatable) on the checkpoint "
                                             "with lm-eval's hf model; results as verl eval's, pairable by "
                                             "verl compare.")
    lm_eval_include: list[str] | None = option(None, "--lm-eval-include", help="A folder of lm-eval task YAMLs "
                                               "(lm-eval's --include_path; repeatable).")
    lm_eval_args: list[str] | None = option(None, "--lm-eval-arg", help="KEY=VALUE for lm-eval: num_fewshot, "
                                            "apply_chat_template, fewshot_as_multiturn, system_instruction, limit, "
                                            "gen_kwargs, bootstrap_iters, batch_size, seed, model_args "
                                            "(repeatable).")
    # Inspect tasks instead of verl's own generation (eval/inspect_tasks.py).
    inspect_tasks: list[str] | None = option(None, "--inspect-task", help="Run this Inspect task (FILE.py@task; "
                                             "repeatable) against our service on the checkpoint (or --service).")
    inspect_grader: str | None = option(None, "--inspect-grader", help="The model a model-graded scorer uses "
                                        "(Inspect's grader role; served beside the checkpoint, temperature 0).")
    inspect_args: list[str] | None = option(None, "--inspect-arg", help="KEY=VALUE for Inspect: epochs, "
                                            "epochs_reducer, limit, temperature, top_p, max_tokens, seed, "
                                            "max_connections, model (with --service).")
    service: str | None = option(None, "--service", help="--inspect-task against this running service (its URL) "
                                 "instead of one started on the checkpoint.")
    sandbox_url: str | None = option(None, "--sandbox-url", help="Where the code reward runs programs: a "
                                     "SandboxFusion /run_code URL (verl sandbox serve), or local (in this "
                                     "process); default: the run's reward.sandbox.url.")
    dtype: str | None = None
    kl_micro_batch_size: int = 32

    def __post_init__(self) -> None:
        check_flags({name: getattr(self, name) for name in FLAG_RULES})
        if self.executor not in ("local", "ray"):
            raise ConfigError(f"--executor '{self.executor}' must be local or ray")
        if self.workers < 1:
            raise ConfigError(f"--workers {self.workers} must be at least 1")


# Each eval flag obeys the rule of the config key it stands for (verl/config.py), so `--top-p 5` fails exactly as
# `rollout.val_kwargs.top_p=5` does: flag -> (section, field, the flag's spelling).
FLAG_RULES: dict[str, tuple[str, str, str]] = {
    "n": ("ValidationSampling", "n", "--n"),
    "temperature": ("ValidationSampling", "temperature", "--temperature"),
    "top_p": ("ValidationSampling", "top_p", "--top-p"),
    "top_k": ("ValidationSampling", "top_k", "--top-k"),
    "max_new_tokens": ("DataConfig", "max_response_length", "--max-new-tokens"),
    "batch_size": ("DataConfig", "val_batch_size", "--batch-size"),
    "max_samples": ("DataConfig", "val_max_samples", "--max-samples"),
    "max_prompt_length": ("DataConfig", "max_prompt_length", "--max-prompt-length"),
    "num_threads": ("TrainerConfig", "num_threads", "--threads"),
}


def check_flags(values: dict[str, Any]) -> None:
    """Validate the given (non-None) flag values against their config keys' constraints; one line per problem."""
    from pydantic import TypeAdapter, ValidationError  # noqa: PLC0415  (not at `verl --help`)

    import verl.config as config_module  # noqa: PLC0415

    problems = []
    for name, value in values.items():
        if value is None:
            continue
        section, key, flag = FLAG_RULES[name]
        info = getattr(config_module, section).model_fields[key]
        try:
            TypeAdapter(Annotated[(info.annotation, *info.metadata)]).validate_python(value)
        except ValidationError as exc:
            reason = exc.errors()[0]["msg"].lower()
            problems.append(f"{flag} {value!r}: {reason} (the same rule as the config key {key})")
    if problems:
        raise ConfigError("; ".join(problems))

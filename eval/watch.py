"""``verl eval --ckpt RUN --watch``: evaluate a run's checkpoints as they land, while it trains.

Run it beside the trainer (another terminal, one torch thread: the other core). Each complete checkpoint
(``checkpoints/global_step_N`` with its ``meta.json``) is evaluated once, exactly as ``verl eval --ckpt RUN`` would
(the same settings, resolved from the run's ``config.yaml``, the same results directory), so a later ``verl eval``
of the run reuses these results, and one with ``--force`` recomputes the same numbers. The watch ends when the
run's log says it finished and its last checkpoint is evaluated; then it writes the run's summary and
``best.json`` as ``verl eval --ckpt RUN`` does. With it the trainer's own validation can be sparse or off
(``trainer.test_freq``) without losing the curve.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from eval.pairwise import PairEvaluation, check_settings, evaluate_reward_model, rm_config_of
from eval.runner import (
    EvalSettings,
    Evaluation,
    evaluate_on_ray,
    evaluate_run_dir,
    load_run_config,
    resolve_settings,
    resolve_target,
    results_root,
    start_ray,
    tokenizer_source_for,
)
from serve.settings import is_reward_model
from verl.errors import CheckpointError, ConfigError, VerlError
from verl.tracking.follow import LogFollower
from verl.trainer.checkpoint import list_checkpoints

POLL_S = 2.0


def _say(console: Any, settings: EvalSettings, text: str) -> None:
    if console is not None and not settings.quiet:
        console.print(text, highlight=False, soft_wrap=True)


def wait_for_run(run_dir: Path, timeout_s: float, poll_s: float) -> None:
    """A watch may start before the trainer: wait for the run's ``config.yaml``."""
    deadline = time.monotonic() + timeout_s
    while not (run_dir / "config.yaml").is_file():
        if time.monotonic() > deadline:
            raise ConfigError(f"'{run_dir}' is not a run directory and none appeared within {timeout_s:g} s; start "
                              "the training run (its trainer.output_dir/project/experiment) or fix --ckpt")
        time.sleep(poll_s)


def watch_run(run_dir: str | Path, settings: EvalSettings, out: str | Path | None = None, console: Any = None,
              poll_s: float = POLL_S, start_timeout_s: float = 600.0, idle_timeout_s: float = 1800.0) -> dict:
    """Evaluate ``run_dir``'s checkpoints as they appear until the run finishes; returns the run summary."""
    run_dir = Path(run_dir)
    if any((run_dir / name).is_file() for name in ("config.json", "adapter_config.json")):
        raise ConfigError(f"--watch follows a run directory, and '{run_dir}' is a checkpoint; give its run "
                          f"(--ckpt {run_dir.parent.parent if run_dir.parent.name == 'checkpoints' else 'RUN'}) "
                          "or drop --watch")
    _say(console, settings, f"watching {run_dir}: each checkpoint is evaluated as it lands (Ctrl-C stops)")
    wait_for_run(run_dir, start_timeout_s, poll_s)
    run_cfg, raw, notes = load_run_config(run_dir)
    resolved = resolve_settings(settings, run_cfg, settings.reference)
    resolved.notes.extend(notes)
    out_dir = Path(out) if out is not None else results_root(run_dir, resolved, run_cfg)
    follower = LogFollower(run_dir / "verl_logs.jsonl")
    evaluation: Evaluation | PairEvaluation | None = None
    done: set[int] = set()
    finished, last_activity = False, time.monotonic()
    ray_started = False
    try:
        while True:
            rows, _ = follower.poll()
            for _start, _end, row in rows:
                if row.get("scope") == "train" and row.get("status") in ("started", "resumed"):
                    finished = False
                elif row.get("scope") == "train" and row.get("status") == "finished":
                    finished = True
            if rows:
                last_activity = time.monotonic()
            # Listed after reading the log: the trainer writes its last checkpoint before "finished".
            new = [(step, path) for step, path in list_checkpoints(run_dir) if step not in done]
            if new and evaluation is None and is_reward_model(str(new[0][1])):  # a `verl rm` run: scored on pairs
                check_settings(settings, str(run_dir))
                evaluation = PairEvaluation(settings, *rm_config_of(run_dir), console)
                out_dir = Path(out) if out is not None else evaluation.results_root(run_dir)
            if new and settings.executor == "ray":
                ray_started = start_ray(settings.workers) or ray_started
                evaluate_on_ray(new, settings, resolved, run_cfg, raw, tokenizer_source_for(str(new[0][1]), run_cfg),
                                 out_dir, run_dir, console)
                done.update(step for step, _ in new)
            for step, path in new if settings.executor != "ray" else []:
                if evaluation is None:
                    evaluation = Evaluation(settings, resolved, run_cfg, raw, tokenizer_source_for(str(path), run_cfg),
                                            console)
                try:
                    evaluation.evaluate(str(path), out_dir / path.name, path.name, step, run_dir)
                except (CheckpointError, OSError):
                    if path.exists():
                        raise
                    # trainer.max_ckpt_to_keep removed it while it was read: nothing left to evaluate.
                    _say(console, settings, f"{path.name}: removed by the trainer before it was evaluated; skipped")
                done.add(step)
            if new:
                last_activity = time.monotonic()
            if finished and not new:
                break
            if time.monotonic() - last_activity > idle_timeout_s:
                raise VerlError(f"'{run_dir}' wrote no log rows and no checkpoints for {idle_timeout_s:g} s and never "
                                "logged that it finished (did the trainer die?); `verl eval --ckpt RUN` evaluates the "
                                "checkpoints it left")
            time.sleep(poll_s)
    finally:
        if ray_started:
            import ray  # noqa: PLC0415

            ray.shutdown()
    if not done:
        raise CheckpointError(f"run '{run_dir}' finished without a checkpoint (trainer.save_freq); nothing to evaluate")
    _say(console, settings, f"{run_dir.name} finished; {len(done)} checkpoint(s) evaluated while it ran")
    # Every checkpoint's results exist now: the run summary and best.json, as `verl eval --ckpt RUN` writes them.
    if isinstance(evaluation, PairEvaluation):
        return evaluate_reward_model(resolve_target(run_dir), settings, out, console)
    return evaluate_run_dir(resolve_target(run_dir), dataclasses.replace(settings, executor="local"), resolved, run_cfg,
                         raw, out, console)


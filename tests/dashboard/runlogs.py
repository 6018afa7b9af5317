"""Writing run logs for dashboard tests with the trainer's own RunLogger (same rows, same format)."""

from __future__ import annotations

from pathlib import Path

from verl.utils.log import RunLogger


def reward(run: int, step: int) -> float:
    return round(0.1 * step + 0.05 * run, 4)


def write_steps(log_path: Path, run: int, first: int, last: int, total: int, finish: bool = False) -> None:
    """Steps ``first..last`` of a run: samples, rollout/ppo/throughput rows, eval every 5 steps."""
    logger = RunLogger(log_path)
    if first == 1:
        logger.event("train", step=0, status="started")
    for step in range(first, last + 1):
        logger.set_step(step)
        logger.event("sample", step=step, split="train", prompt=f"What is {step}+{run}?",
                     response=f"<answer run{run} step{step}>", ground_truth=str(step + run), score=1.0)
        env = {"env/CalculatorEnv/reward_mean": 0.2 + 0.01 * step, "env/CalculatorEnv/length_mean": 20.0,
               "env/CalculatorEnv/turns_mean": 1.5, "env/CalculatorEnv/error_rate": 0.0,
               "env/CalculatorEnv/step_seconds_mean": 0.01} if run == 0 else {}  # a run on an environment
        logger.info("rollout", reward_mean=reward(run, step), response_length_mean=5.0 + step,
                    response_length_clip_ratio=0.0, **env)
        logger.info("ppo", kl_div=0.001 * step * (run + 1), policy_loss=-0.1, entropy=0.3)
        logger.info("throughput", tokens_per_second=1000.0 + step)
        if run == 0:  # as verl-suite logs it: verl's and TRL's names
            logger.info("rollout_corr", k3_kl=1e-4 * step)
            logger.info("sampling", **{"sampling_logp_difference/mean": 0.01 * step})
        else:  # a run with verl's debug metric alone: the panel's other tag stands in
            logger.info("training", rollout_probs_diff_mean=0.002 * step)
        logger.info("train", progress=step / total)
        logger.flush(step)
        if step % 5 == 0:
            tasks = {"humaneval/pass@1": 0.02 * step, "clean/accuracy": 0.4} if run == 0 else {}  # trainer.eval_tasks
            logger.info("eval", accuracy=0.5 + 0.01 * step, **tasks)
            logger.flush(step)
    if finish:
        logger.event("alert", level="WARNING", step=last, rule="kl_far_above_target", message="KL <b>high</b>")
        logger.event("train", step=last, status="finished", reason="completed")
    logger.close()

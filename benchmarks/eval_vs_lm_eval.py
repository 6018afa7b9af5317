"""`verl eval` vs lm-evaluation-harness (hf backend): samples/s on the same checkpoint and the same prompts.

    python benchmarks/eval_vs_lm_eval.py                       # builtin:tiny-arith, 256 val prompts, greedy
    python benchmarks/eval_vs_lm_eval.py --ckpt builtin:smollm2-135m-instruct --data builtin:word_problems/val \
        --prompts 64 --max-new-tokens 32 --max-prompt-length 96 --repeats 3 --cli-repeats 2

Both tools get the identical prompt text (our chat-templated prompt, tokenized the same way: checked), greedy
decoding, at most ``max_new_tokens`` tokens, the same batch size, fp32 on CPU with one torch thread. Scoring:
our ``accuracy`` evaluator (strict ``>> N`` and lm-eval's flexible extraction) vs a custom lm-eval task with
the same two filters (``regex`` strict-match and flexible-extract) and ``exact_match``; the accuracies must
agree, which is printed as a check.

``verl eval`` runs with its default settings, bootstrap CIs included (1000 resamples; ``--bootstrap 0`` is the
option to leave them out); lm-eval computes its default standard errors.

Two measurements, each the median over repeats, run side by side (alternating) in one process/session:

1. warm, in-process: the model is loaded once per tool; the timed call is one whole evaluation of the prompts
   (``Evaluation.evaluate`` with only the accuracy evaluator, including writing results/samples/report, vs
   ``lm_eval.simple_evaluate`` with a pre-built ``HFLM``);
2. cold, command line: ``verl eval ...`` vs ``lm_eval ...`` as subprocesses (interpreter start, imports, model
   load included) — what a user waits for;
3. the same task file through ``verl eval --lm-eval-task`` (lm-eval run inside verl eval): its metrics must equal
   lm-eval's own to the last digit (printed as a check), and its cold time beside the ``lm_eval`` command's.

Prints a table and writes ``results.json`` into ``--out``. CPU timings on a shared machine are noisy: compare
the ratio, and rerun when the machine is idle.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TASK_YAML = """task: verl_task
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{text}}}}"
doc_to_target: "{{{{target}}}}"
target_delimiter: ""
generation_kwargs:
  until: ["</s>"]
  do_sample: false
  max_gen_toks: {max_new_tokens}
filter_list:
  - name: strict-match
    filter:
      - function: regex
        regex_pattern: "{strict}"
      - function: take_first
  - name: flexible-extract
    filter:
      - function: regex
        group_select: -1
        regex_pattern: "(-?[$0-9.,]{{2,}})|(-?[0-9]+)"
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: false
    regexes_to_ignore: [",", "\\\\$", "(?s).*#### ", "\\\\.$"]
metadata:
  version: 1.0
"""


# The strict answer format of each built-in task (the same as our reward's strict match), as an lm-eval regex.
STRICT_PATTERNS = {"arithmetic": ">> (\\\\-?[0-9\\\\.\\\\,]+)", "word_problems": "#### (\\\\-?[0-9\\\\.\\\\,]+)"}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt", default="builtin:tiny-arith", help="checkpoint dir or builtin:NAME")
    parser.add_argument("--data", default="builtin:arithmetic/val", help="a built-in task's split")
    parser.add_argument("--prompts", type=int, default=256, help="prompts taken from --data")
    parser.add_argument("--max-prompt-length", type=int, default=None, help="verl eval's --max-prompt-length")
    parser.add_argument("--bootstrap", type=int, default=1000, help="verl eval's --bootstrap (its default: 1000)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5, help="warm in-process repeats per tool")
    parser.add_argument("--cli-repeats", type=int, default=3, help="cold command-line repeats per tool (0 skips)")
    parser.add_argument("--out", type=Path, default=None, help="where results.json goes (default: a temp dir)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    work = prepare_environment(args)
    from eval.runner import EvalSettings, Evaluation, resolve_settings
    from verl.config import DataConfig
    from verl.data.dataset import RLHFDataset
    from verl.models.loader import load_causal_lm, load_tokenizer, resolve_model_path

    model_dir = resolve_model_path(args.ckpt)
    tokenizer = load_tokenizer(model_dir)
    task = args.data.removeprefix("builtin:").split("/")[0]
    if task not in STRICT_PATTERNS:
        raise SystemExit(f"--data {args.data}: use a built-in task ({', '.join(STRICT_PATTERNS)})")
    data_config = DataConfig(**({"max_prompt_length": args.max_prompt_length} if args.max_prompt_length else {}))
    dataset = RLHFDataset([args.data], tokenizer, data_config, "--data")
    count = min(args.prompts, len(dataset))
    task_dir = write_lm_eval_task(args, dataset, count, STRICT_PATTERNS[task], work)

    # ---- tool 1: verl eval, warm
    settings = EvalSettings(data=[args.data], evaluators="accuracy", n=1, temperature=0.0,
                            max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, max_samples=count,
                            num_threads=1, force=True, quiet=True, n_bootstrap=args.bootstrap,
                            max_prompt_length=args.max_prompt_length)
    evaluation = Evaluation(settings, resolve_settings(settings, None, None), None, None, model_dir)

    def run_verl(i: int) -> tuple[float, dict]:
        start = time.perf_counter()
        results = evaluation.evaluate(model_dir, work / f"verl_eval_{i}", "bench")
        return time.perf_counter() - start, results

    # ---- tool 2: lm-eval, warm (model built once, like ours)
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    lm = HFLM(pretrained=load_causal_lm(model_dir), tokenizer=tokenizer, batch_size=args.batch_size, device="cpu",
              dtype="float32")
    manager = TaskManager(include_path=str(task_dir))
    check_tokenization(lm, dataset, count)

    def run_lm_eval(i: int) -> tuple[float, dict]:
        start = time.perf_counter()
        out = lm_eval.simple_evaluate(model=lm, tasks=["verl_task"], task_manager=manager, log_samples=True,
                                      verbosity="ERROR")
        return time.perf_counter() - start, out

    verl_times, lm_times, verl_results, lm_results = alternate_warm_runs(run_verl, run_lm_eval, args.repeats)
    ours, theirs = accuracies_and_agreement(verl_results, lm_results, work / f"verl_eval_{args.repeats - 1}", count)
    verl_cmd, lm_cmd = command_lines(args, model_dir, count, task_dir, work)
    task_cmd = [str(Path(sys.executable).with_name("verl")), "eval", "--ckpt", model_dir, "--lm-eval-task",
                str(task_dir / "verl_task.yaml"), "--lm-eval-arg", f"batch_size={args.batch_size}", "--threads", "1",
                "--quiet", "--out", str(work / "verl_lm_eval_task")]
    cli = time_command_lines({"verl": verl_cmd, "lm_eval": lm_cmd, "verl_lm_eval_task": task_cmd}, args.cli_repeats)
    report = summarise(args, count, verl_times, lm_times, cli, ours, theirs, verl_results, " ".join(verl_cmd),
                       " ".join(lm_cmd))
    if cli["verl_lm_eval_task"]:
        report["lm_eval_task"] = lm_eval_task_check(work / "verl_lm_eval_task", lm_results, cli, count, task_cmd)
    (work / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"results: {work / 'results.json'}")
    print_table(report)


def prepare_environment(args: argparse.Namespace) -> Path:
    """Offline, quiet, one torch thread; returns the work dir (``--out`` or a temp dir)."""
    os.environ.setdefault("VERL_CACHE_DIR", str(REPO / ".cache"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    work = Path(args.out or tempfile.mkdtemp(prefix="eval-vs-lm-eval-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_DATASETS_CACHE", str(work / "hf_datasets"))
    import torch

    torch.set_num_threads(1)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    return work


def write_lm_eval_task(args: argparse.Namespace, dataset, count: int, strict_pattern: str, work: Path) -> Path:
    """The prompts written for lm-eval exactly as our dataset feeds them to the model, and its task YAML."""
    data_file = work / "prompts.jsonl"
    with data_file.open("w") as fh:
        for i in range(count):
            fh.write(json.dumps({"text": dataset.rows[i]["__prompt_text__"],
                                 "target": str(dataset.ground_truth(i))}) + "\n")
    task_dir = work / "tasks"
    task_dir.mkdir(exist_ok=True)
    (task_dir / "verl_task.yaml").write_text(TASK_YAML.format(data=data_file, max_new_tokens=args.max_new_tokens,
                                                              strict=strict_pattern))
    return task_dir


def alternate_warm_runs(run_verl, run_lm_eval, repeats: int) -> tuple[list[float], list[float], dict, dict]:
    """One warm-up each (first-call costs are not the steady state), then alternating repeats, so drifting load on
    the shared machine hits both alike. Returns both tools' times and their last results."""
    run_verl(-1)
    run_lm_eval(-1)
    verl_times, lm_times = [], []
    for i in range(repeats):
        t, verl_results = run_verl(i)
        verl_times.append(t)
        t, lm_results = run_lm_eval(i)
        lm_times.append(t)
    return verl_times, lm_times, verl_results, lm_results


def accuracies_and_agreement(verl_results: dict, lm_results: dict, verl_dir: Path, count: int) -> tuple[dict, dict]:
    """Both tools' strict and flexible accuracy, and (stronger than equal accuracies) how many generated texts
    are identical, prompt by prompt."""
    ours = {"strict": verl_results["metrics"]["eval/accuracy"]["value"],
            "flexible": verl_results["metrics"]["eval/accuracy_flexible"]["value"]}
    scores = lm_results["results"]["verl_task"]
    theirs = {"strict": scores["exact_match,strict-match"], "flexible": scores["exact_match,flexible-extract"]}
    our_texts = [json.loads(line)["response"] for line in (verl_dir / "samples.jsonl").read_text().splitlines()]
    their_texts = {}
    for sample in lm_results["samples"]["verl_task"]:
        if sample.get("filter") == "strict-match":
            their_texts[sample["doc_id"]] = sample["resps"][0][0]
    ours["identical_responses"] = sum(our_texts[i].strip() == their_texts.get(i, "").strip() for i in range(count))
    return ours, theirs


def lm_eval_task_check(out: Path, lm_results: dict, cli: dict, count: int, task_cmd: list[str]) -> dict:
    """3. The same task file through ``verl eval --lm-eval-task`` (lm-eval inside verl eval, its hf backend): its
    metrics must be lm-eval's to the last digit; and its cold wall time beside ``lm_eval``'s."""
    ours = json.loads((out / "results.json").read_text())["metrics"]
    theirs = lm_results["results"]["verl_task"]
    values = {f: (ours[f"eval/lm_eval/verl_task/exact_match/{f}"]["value"], theirs[f"exact_match,{f}"])
              for f in ("strict-match", "flexible-extract")}
    rate = count / statistics.median(cli["verl_lm_eval_task"])
    return {"exact_match": values, "identical": all(a == b for a, b in values.values()),
            "seconds": cli["verl_lm_eval_task"], "samples_per_s": rate,
            "ratio_to_lm_eval_cli": rate / (count / statistics.median(cli["lm_eval"])), "command": " ".join(task_cmd)}


def command_lines(args: argparse.Namespace, model_dir: str, count: int, task_dir: Path, work: Path
                  ) -> tuple[list[str], list[str]]:
    """The same evaluation as each tool's command line (cold: a new process, the model loaded from disk)."""
    verl_bin = Path(sys.executable).with_name("verl")
    lm_bin = Path(sys.executable).with_name("lm_eval")
    verl_cmd = [str(verl_bin), "eval", "--ckpt", model_dir, "--data", args.data, "--evaluators",
                "accuracy", "--temperature", "0", "--max-new-tokens", str(args.max_new_tokens), "--batch-size",
                str(args.batch_size), "--max-samples", str(count), "--threads", "1", "--force", "--quiet",
                "--bootstrap", str(args.bootstrap), "--out", str(work / "verl_eval_cli")]
    if args.max_prompt_length:
        verl_cmd += ["--max-prompt-length", str(args.max_prompt_length)]
    lm_cmd = [str(lm_bin), "--model", "hf", "--model_args", f"pretrained={model_dir},dtype=float32",
              "--tasks", "verl_task", "--include_path", str(task_dir), "--batch_size", str(args.batch_size),
              "--device", "cpu", "--verbosity", "ERROR"]
    return verl_cmd, lm_cmd


def time_command_lines(commands: dict[str, list[str]], repeats: int) -> dict[str, list[float]]:
    """Wall time of each command, alternating, ``repeats`` times, one thread each."""
    times: dict[str, list[float]] = {name: [] for name in commands}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    for _ in range(repeats):
        for name, cmd in commands.items():
            start = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
            if proc.returncode != 0:
                raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
            times[name].append(time.perf_counter() - start)
    return times


def check_tokenization(lm, dataset, count: int) -> None:
    """Both tools must feed the model the same token ids, or the comparison is not like for like."""
    for i in range(min(count, 16)):
        theirs = lm.tok_encode(dataset.rows[i]["__prompt_text__"])
        if list(theirs) != list(dataset.prompt_ids[i]):
            raise SystemExit(f"prompt {i}: lm-eval tokenizes to {theirs}, verl to {dataset.prompt_ids[i]}")


def summarise(args, count, verl_times, lm_times, cli, ours, theirs, verl_results, verl_cmd, lm_cmd) -> dict:
    def rate(times: list[float]) -> float:
        return count / statistics.median(times)

    report = {
        "checkpoint": args.ckpt, "data": args.data, "bootstrap": args.bootstrap, "prompts": count,
        "batch_size": args.batch_size,
        "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "cli_repeats": args.cli_repeats,
        "warm": {"verl_eval_seconds": verl_times, "lm_eval_seconds": lm_times,
                 "verl_eval_samples_per_s": rate(verl_times), "lm_eval_samples_per_s": rate(lm_times),
                 "ratio": rate(verl_times) / rate(lm_times),
                 "verl_generation_only_samples_per_s": verl_results["timing"]["samples_per_second"]},
        "accuracy": {"verl_eval": ours, "lm_eval": theirs,
                     "agree": all(abs(ours[k] - theirs[k]) < 1e-9 for k in theirs)},
        "commands": {"verl": verl_cmd, "lm_eval": lm_cmd},
        "machine": {"cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]},
    }
    if cli["verl"]:
        report["cold_cli"] = {"verl_eval_seconds": cli["verl"], "lm_eval_seconds": cli["lm_eval"],
                              "verl_eval_samples_per_s": rate(cli["verl"]),
                              "lm_eval_samples_per_s": rate(cli["lm_eval"]),
                              "ratio": rate(cli["verl"]) / rate(cli["lm_eval"])}
    return report


def print_table(report: dict) -> None:
    w = report["warm"]
    print("\n=== summary")
    print(f"{report['prompts']} prompts, batch {report['batch_size']}, greedy, max_new_tokens "
          f"{report['max_new_tokens']}, 1 thread, checkpoint {report['checkpoint']}, data {report['data']}, "
          f"verl eval bootstrap {report['bootstrap']}")
    print(f"{'measurement':<34}{'verl eval':>12}{'lm-eval':>12}{'ratio':>8}")
    print(f"{'warm, samples/s (median of ' + str(report['repeats']) + ')':<34}{w['verl_eval_samples_per_s']:>12.1f}"
          f"{w['lm_eval_samples_per_s']:>12.1f}{w['ratio']:>8.2f}")
    if "cold_cli" in report:
        c = report["cold_cli"]
        print(f"{'cold CLI, samples/s (median of ' + str(report['cli_repeats']) + ')':<34}"
              f"{c['verl_eval_samples_per_s']:>12.1f}{c['lm_eval_samples_per_s']:>12.1f}{c['ratio']:>8.2f}")
    if "lm_eval_task" in report:
        t = report["lm_eval_task"]
        print(f"{'cold CLI, verl eval --lm-eval-task':<34}{t['samples_per_s']:>12.1f}"
              f"{report['cold_cli']['lm_eval_samples_per_s']:>12.1f}{t['ratio_to_lm_eval_cli']:>8.2f}  "
              f"metrics {'identical to' if t['identical'] else 'DIFFER from'} lm-eval's")
    print(f"{'verl eval generation + scoring only':<34}{w['verl_generation_only_samples_per_s']:>12.1f}")
    a = report["accuracy"]
    print(f"identical responses: {a['verl_eval']['identical_responses']}/{report['prompts']}")
    print(f"accuracy strict {a['verl_eval']['strict']:.4f} vs {a['lm_eval']['strict']:.4f}, flexible "
          f"{a['verl_eval']['flexible']:.4f} vs {a['lm_eval']['flexible']:.4f}: "
          f"{'agree' if a['agree'] else 'DISAGREE'}")
    print(f"load average (1 min) at the end: {report['machine']['load_avg_1m']:.2f} on {report['machine']['cpus']} "
          "CPUs")


if __name__ == "__main__":
    main()

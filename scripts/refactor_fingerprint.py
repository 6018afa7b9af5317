"""Per-step metrics of fixed-seed runs (GRPO local, PPO with critic local, GRPO on Ray, one-step off-policy, DAPO's
filter_groups, bypass mode, the tiny agent, SFT and a reward model) and the sha256 of `verl eval`'s results.json and
samples.jsonl for the GRPO run's last checkpoint, for a before/after check of a refactor that must not change
numbers:

    python scripts/refactor_fingerprint.py /tmp/before.json     # on the old code
    python scripts/refactor_fingerprint.py /tmp/after.json      # on the new code, then compare the two files
                                                                # (timings, keys ending in "seconds", differ)
"""
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from verl.config import load_config
from verl.trainer.factory import build_trainer
from verl.utils.log import read_jsonl


def eval_hashes(run_dir: Path) -> dict[str, str]:
    """sha256 of the eval outputs for the run's newest checkpoint (every built-in evaluator, fixed seed)."""
    ckpt = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    out = Path(sys.argv[1] + ".eval")  # kept for a look at what differs
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "verl.cli", "eval", "--ckpt", str(ckpt), "--max-samples", "16",
                    "--bootstrap", "200", "--threads", "1", "--out", str(out), "--quiet"], check=True)
    hashes = {}
    for name in ("results.json", "samples.jsonl"):
        text = (out / name).read_text().replace(str(run_dir.parent.parent.resolve()), "<tmp>")  # the temp dir differs
        # Paths and timings are not numbers a refactor must keep.
        data = [json.loads(line) for line in text.splitlines()] if name.endswith("jsonl") else json.loads(text)
        hashes[f"eval/{name}"] = hashlib.sha256(json.dumps(strip_volatile(data), sort_keys=True).encode()).hexdigest()
    return hashes


VOLATILE = ("seconds", "per_second", "time", "path", "dir", "ckpt", "created", "version")


def strip_volatile(data):
    if isinstance(data, dict):
        return {k: strip_volatile(v) for k, v in data.items() if not any(w in k for w in VOLATILE)}
    if isinstance(data, list):
        return [strip_volatile(v) for v in data]
    return data


def run(name, cfg_file, extra, with_eval=False):
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(cfg_file, ["trainer.total_steps=3", "data.train_batch_size=4", "actor.ppo_mini_batch_size=2",
                                     "rollout.n=4", "trainer.test_freq=3", "data.val_max_samples=16",
                                     "trainer.logger=[jsonl]", f"trainer.output_dir={tmp}",
                                     f"trainer.experiment_name={name}", "trainer.num_threads=1", *extra])
        t = build_trainer(cfg, quiet=True)
        try:
            t.fit()
        finally:
            t.shutdown()
        rows = read_jsonl(Path(tmp) / "verl" / cfg.trainer.experiment_name / "verl_logs.jsonl")
        keep = {}
        for r in rows:
            if r.get("scope") in ("ppo", "rollout", "critic", "eval") and "step" in r:
                for k, v in r.items():
                    if isinstance(v, float) and not k.endswith("seconds"):
                        keep[f"{name}/{r['scope']}/{r['step']}/{k}"] = v
        if with_eval:
            keep.update(eval_hashes(Path(tmp) / "verl" / cfg.trainer.experiment_name))
        return keep


def cli_run(name, command, args):
    """A `verl sft` / `verl rm` run of a few steps in a subprocess: its train and eval rows."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "verl.cli", command, *args, f"trainer.output_dir={tmp}",
                        f"trainer.experiment_name={name}", "trainer.num_threads=1", "--quiet"], check=True)
        [log] = Path(tmp).rglob("verl_logs.jsonl")
        return {f"{name}/{r['step']}/{k}": v for r in read_jsonl(log) if "step" in r for k, v in r.items()
                if isinstance(v, float) and not k.endswith(("seconds", "per_second")) and "time" not in k}


def main() -> None:
    out = {}
    out.update(run("grpo", None, [], with_eval=True))
    out.update(run("ppo", "configs/ppo_tiny.yaml", []))
    out.update(run("grpo_ray", None, ["trainer.executor=ray", "trainer.n_workers=1"]))
    out.update(run("off_policy", None, ["trainer.one_step_off_policy=true"]))
    out.update(run("filter_groups", None, ["algorithm.filter_groups.enable=true"]))
    out.update(run("bypass_ppo_clip", None, ["algorithm.rollout_correction.preset=bypass_ppo_clip"]))
    out.update(run("bypass_pg_is", None, ["algorithm.rollout_correction.preset=bypass_pg_is"]))
    out.update(run("agent", "configs/agent_tiny.yaml", ["data.max_response_length=48"]))
    out.update(cli_run("sft", "sft", ["trainer.total_steps=3", "data.batch_size=8", "trainer.test_freq=3",
                                      "data.val_max_samples=8"]))
    out.update(cli_run("rm", "rm", ["trainer.total_steps=3", "data.batch_size=8", "trainer.test_freq=3",
                                    "data.train_files=[builtin:arithmetic/pairs_train]",
                                    "data.val_files=[builtin:arithmetic/pairs_val]"]))
    Path(sys.argv[1]).write_text(json.dumps(out, indent=0, sort_keys=True))
    print(len(out), "values")


if __name__ == "__main__":  # the one-step off-policy run spawns a process that imports this file
    main()

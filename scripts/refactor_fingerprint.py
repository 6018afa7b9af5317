"""Per-step metrics of fixed-seed runs (GRPO local, PPO with critic local, GRPO on Ray), for a before/after check
of a refactor that must not change numbers:

    python scripts/refactor_fingerprint.py /tmp/before.json     # on the old code
    python scripts/refactor_fingerprint.py /tmp/after.json      # on the new code, then compare the two files
                                                                # (timings, keys ending in "seconds", differ)
"""
import json
import sys
import tempfile
from pathlib import Path

from verl.config import load_config
from verl.trainer.factory import build_trainer
from verl.utils.log import read_jsonl


def run(name, cfg_file, extra):
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(cfg_file, ["trainer.total_steps=3", "data.train_batch_size=4", "actor.ppo_mini_batch_size=2",
                                     "rollout.n=4", "trainer.test_freq=3", "data.val_max_samples=16",
                                     "trainer.logger=[jsonl]", f"trainer.output_dir={tmp}", "trainer.num_threads=1",
                                     *extra])
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
        return keep

out = {}
out.update(run("grpo", None, []))
out.update(run("ppo", "configs/ppo_tiny.yaml", []))
out.update(run("grpo_ray", None, ["trainer.executor=ray", "trainer.n_workers=1"]))
Path(sys.argv[1]).write_text(json.dumps(out, indent=0, sort_keys=True))
print(len(out), "values")

"""Peak memory of GRPO steps: full fine-tuning vs LoRA, on the tiny (~1M) and small (~25M) built-in models.

Each configuration runs 3 training steps in a fresh subprocess. Reported per configuration:

- model-state bytes counted exactly from the live objects: trainable parameters, gradients, AdamW moments,
  and the reference copy (none with LoRA: the reference is the base with adapters disabled);
- peak RSS of the process (``ru_maxrss``; includes torch's own ~0.3 GB, so differences are what matter);
- on a GPU: ``torch.cuda.max_memory_allocated``.

    python benchmarks/lora_memory.py
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

CONFIGS = {"full": {}, "lora-r16": {"model": {"lora": {"rank": 16, "alpha": 32}}, "actor": {"optim": {"lr": 1e-3}}}}
MODELS = {"tiny (1.1M)": "builtin:tiny-arith", "small (25M)": "builtin:small-arith-base"}


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def worker(model_path: str, variant: str, out: Path) -> None:
    os.environ.setdefault("VERL_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".cache"))
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    from verl.trainer.local import LocalPPOTrainer

    with tempfile.TemporaryDirectory() as tmp:
        config = {
            "model": {"path": model_path},
            "data": {"train_batch_size": 8},
            "actor": {"ppo_mini_batch_size": 8},
            "trainer": {"total_steps": 3, "test_freq": 0, "val_before_train": False, "save_freq": 0,
                        "logger": ["jsonl"], "output_dir": tmp, "experiment_name": "m", "num_samples_to_log": 0},
        }
        for section, values in CONFIGS[variant].items():
            for key, value in values.items():
                if isinstance(value, dict):
                    config.setdefault(section, {}).setdefault(key, {}).update(value)
                else:
                    config.setdefault(section, {})[key] = value
        trainer = LocalPPOTrainer(config, quiet=True)
        trainer.fit()
        model = trainer.model
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer_state = [t for state in trainer.actor.optimizer.state.values() for t in state.values()
                           if torch.is_tensor(t) and t.dim() > 0]
        reference = trainer.reference
        shares_base = reference is None or reference.adapters_disabled
        ref_bytes = 0 if shares_base else tensor_bytes(reference.model.parameters())
        result = {"params": sum(p.numel() for p in model.parameters()), "trainable": sum(p.numel() for p in trainable),
                  "weights_mb": tensor_bytes(model.parameters()) / 2**20, "grads_mb": tensor_bytes(trainable) / 2**20,
                  "adam_mb": tensor_bytes(optimizer_state) / 2**20, "reference_mb": ref_bytes / 2**20,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
        result["model_state_mb"] = sum(result[k] for k in ("weights_mb", "grads_mb", "adam_mb", "reference_mb"))
        if torch.cuda.is_available():
            result["cuda_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
    out.write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "VARIANT"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[1], args.out)
        return
    print("| model | variant | trainable params | weights MB | grads MB | AdamW MB | reference MB | "
          "model state MB | peak RSS MB |")
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for label, path in MODELS.items():
            for variant in CONFIGS:
                out = Path(tmp) / f"{variant}.json"
                subprocess.run([sys.executable, __file__, "--worker", path, variant, "--out", str(out)], check=True)
                r = json.loads(out.read_text())
                print(f"| {label} | {variant} | {r['trainable']:,} of {r['params']:,} | {r['weights_mb']:.1f} | "
                      f"{r['grads_mb']:.1f} | {r['adam_mb']:.1f} | {r['reference_mb']:.1f} | "
                      f"{r['model_state_mb']:.1f} | {r['peak_rss_mb']:.0f} |", flush=True)


if __name__ == "__main__":
    main()

"""``verl export``: a run's chosen checkpoint -> a self-contained Hugging Face model directory.

    verl export --run outputs/verl/grpo-a --select best --metric eval/accuracy:max --to exports/grpo-a
    verl export --ckpt outputs/verl/grpo-a/checkpoints/global_step_40 --to exports/step40

The export holds everything a server needs and nothing a trainer needs: ``config.json``, ``model.safetensors``
(LoRA adapters merged into the base weights), the tokenizer with its chat template, ``generation_config.json``,
and ``export.json`` (where it came from: run, step, how it was selected, the metric values at that step, the
run config's hash, versions, time). The directory is assembled under a temporary name and renamed when
complete, so a crash or a failed check leaves nothing half-written; an existing target is replaced only with
``force``. Before the rename the export is reloaded from disk and its logits compared with the in-memory model,
which catches a broken merge (a known failure mode of LoRA exports) before anyone serves it.

How ``--select best`` decides, first match wins:

1. ``<run>/eval/best.json`` written by ``verl eval`` (its ``checkpoint``/``label``), when its metric is the one asked
   for (or none was asked for);
2. the ``eval`` rows of the run's ``verl_logs.jsonl`` (e.g. field ``accuracy`` for ``eval/accuracy``), best value
   among steps whose checkpoint still exists (ties: the earlier step);
3. ``checkpoints/best.json`` + the ``best`` pointer written by the trainer's best-checkpoint callback;
4. the metrics saved in each checkpoint's ``meta.json``.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import transformers
import yaml
from peft import PeftConfig, PeftModel
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, GenerationConfig

from serve import __version__
from serve.lineage import EXPORT_FILE
from serve.settings import is_reward_model
from verl.data.exports import DATA_LINEAGE_FILE
from verl.errors import CheckpointError, ConfigError, ModelError, VerlError
from verl.models.loader import DTYPES, missing_dir_error, resolve_model_path
from verl.trainer.checkpoint import META, STEP_DIR, checkpoint_root, list_checkpoints, read_pointer
from verl.trainer.rm import VALIDATION_METRIC
from verl.utils.fs import atomic_dir, atomic_write_json
from verl.utils.log import read_jsonl

SCHEMA = "verl-suite/export/v1"
DEFAULT_METRIC = "eval/accuracy:max"
REWARD_MODEL_METRIC = f"{VALIDATION_METRIC}:max"  # a `verl rm` run's checkpoints: by what it validates on
# Files copied from a checkpoint only if the tokenizer did not write them itself (tokenizer.save_pretrained does).
ADAPTER_CONFIG = "adapter_config.json"


@dataclass
class Selection:
    """Which checkpoint to export and why."""

    checkpoint: Path
    step: int | None
    selected_by: str
    run_dir: Path | None = None
    metric: dict[str, Any] | None = None  # {"name", "mode", "value", "source"}
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- selection


def parse_metric(spec: str) -> tuple[str, str]:
    """``eval/accuracy:max`` -> ("eval/accuracy", "max"); a bare name gets the ``eval/`` scope."""
    name, _, mode = spec.partition(":")
    name, mode = name.strip(), (mode.strip() or "max")
    if mode not in ("max", "min"):
        raise ConfigError(f"--metric '{spec}': the part after ':' must be max or min")
    if not name:
        raise ConfigError(f"--metric '{spec}': give a metric name such as eval/accuracy:max")
    return (name if "/" in name else f"eval/{name}"), mode


def find_run_dir(ckpt: Path) -> Path | None:
    """``<run>/checkpoints/global_step_N`` -> ``<run>``; None for a checkpoint outside a run layout."""
    if STEP_DIR.match(ckpt.name) and ckpt.parent.name == "checkpoints":
        return ckpt.parent.parent
    return None


def step_of(ckpt: Path) -> int | None:
    match = STEP_DIR.match(ckpt.name)
    if match:
        return int(match.group(1))
    meta = ckpt / META
    if meta.is_file():
        try:
            return int(json.loads(meta.read_text()).get("step"))
        except (ValueError, TypeError):
            return None
    return None


def select_checkpoint(run_dir: str | Path, select: str = "best", metric: str | None = None,
                      logs: str | Path | None = None) -> Selection:
    """Resolve ``select`` (best | latest | global_step_N) in ``run_dir``; see the module docstring for 'best'."""
    run = Path(run_dir).expanduser()
    if not run.is_dir():
        raise CheckpointError(f"run directory '{run}' does not exist")
    checkpoints = list_checkpoints(run)
    if not checkpoints:
        raise CheckpointError(f"run '{run}' has no complete checkpoints (checkpoints/global_step_N with {META}); "
                              "train with trainer.save_freq > 0, or export a model dir with --ckpt")
    by_step = {step: path for step, path in checkpoints}
    if select == "latest":
        path = read_pointer(run, "latest") or checkpoints[-1][1]
        return Selection(path, step_of(path), "latest", run)
    if STEP_DIR.match(select):
        step = int(STEP_DIR.match(select).group(1))
        if step not in by_step:
            raise CheckpointError(f"run '{run}' has no checkpoint {select}; it has "
                                  f"{', '.join(p.name for _, p in checkpoints)}")
        return Selection(by_step[step], step, select, run)
    if select != "best":
        raise ConfigError(f"--select '{select}' must be best, latest or global_step_N")
    if metric is None and is_reward_model(str(checkpoints[-1][1])):
        metric = REWARD_MODEL_METRIC  # a `verl rm` run: its checkpoints are ranked by held-out pairwise accuracy
    return _select_best(run, by_step, metric, logs)


def model_class(ckpt: Path) -> Any:
    """The transformers Auto class that loads ``ckpt`` whole: a reward model keeps its score head."""
    return AutoModelForSequenceClassification if is_reward_model(str(ckpt)) else AutoModelForCausalLM


def _select_best(run: Path, by_step: dict[int, Path], metric: str | None, logs: str | Path | None) -> Selection:
    name, mode = parse_metric(metric or DEFAULT_METRIC)
    notes: list[str] = []
    found = (_best_from_eval_file(run, by_step, name, mode, explicit=metric is not None, notes=notes)
             or _best_from_logs(run, by_step, name, mode, logs, notes)
             or _best_from_trainer_marker(run, name, mode)
             or _best_from_meta(by_step, name, mode))
    if found is None:
        raise CheckpointError(
            f"cannot pick the best checkpoint of '{run}': no values of {name} found in eval/best.json, "
            f"verl_logs.jsonl eval rows, checkpoints/best.json or meta.json. Run `verl eval --ckpt {run}` first, "
            "pass another --metric, or use --select latest / global_step_N"
        )
    path, step, value, source = found
    return Selection(path, step, "best", run, {"name": name, "mode": mode, "value": value, "source": source}, notes)


def _best_from_eval_file(run: Path, by_step: dict[int, Path], name: str, mode: str, explicit: bool,
                         notes: list[str]) -> tuple[Path, int | None, float | None, str] | None:
    best_file = run / "eval" / "best.json"
    if not best_file.is_file():
        return None
    try:
        best = json.loads(best_file.read_text())
    except ValueError:
        notes.append(f"{best_file} is not valid JSON; ignored")
        return None
    if explicit and (best.get("metric"), best.get("mode", mode)) != (name, mode):
        notes.append(f"{best_file} ranks by {best.get('metric')}:{best.get('mode')}, not {name}:{mode}; "
                     "used the training logs instead")
        return None
    candidates = []
    if best.get("checkpoint"):
        raw = Path(best["checkpoint"]).expanduser()
        candidates += [raw] if raw.is_absolute() else [run / raw, best_file.parent / raw, Path.cwd() / raw]
    if best.get("label"):
        candidates.append(checkpoint_root(run) / str(best["label"]))
    if isinstance(best.get("step"), int) and best["step"] in by_step:
        candidates.append(by_step[best["step"]])
    for candidate in candidates:
        if (candidate / "config.json").is_file() or (candidate / ADAPTER_CONFIG).is_file():
            value = best.get("value")
            return candidate, step_of(candidate), float(value) if value is not None else None, str(best_file)
    notes.append(f"{best_file} names a checkpoint that no longer exists ({best.get('checkpoint')}); "
                 "used the training logs instead")
    return None


def log_path(run: Path, logs: str | Path | None = None) -> Path | None:
    """The run's ``verl_logs.jsonl``: ``logs`` if given, else in the run dir, else where config.yaml's log_dir says."""
    if logs is not None:
        path = Path(logs).expanduser()
        path = path / "verl_logs.jsonl" if path.is_dir() else path
        if not path.is_file():
            raise CheckpointError(f"--logs '{logs}' is not a verl_logs.jsonl file or a directory holding one")
        return path
    if (run / "verl_logs.jsonl").is_file():
        return run / "verl_logs.jsonl"
    config = run / "config.yaml"
    if config.is_file():
        try:
            log_dir = ((yaml.safe_load(config.read_text()) or {}).get("trainer") or {}).get("log_dir")
        except yaml.YAMLError:
            log_dir = None
        if log_dir and (Path(log_dir) / "verl_logs.jsonl").is_file():
            return Path(log_dir) / "verl_logs.jsonl"
    return None


def eval_metrics_by_step(path: Path) -> dict[int, dict[str, float]]:
    """``{step: {"eval/accuracy": 0.8, ...}}`` from the ``eval`` rows of a ``verl_logs.jsonl`` (last row wins)."""
    out: dict[int, dict[str, float]] = {}
    for row in read_jsonl(path):
        if row.get("scope") != "eval" or not isinstance(row.get("step"), int):
            continue
        values = out.setdefault(row["step"], {})
        for key, value in row.items():
            if key in ("timestamp", "level", "scope", "step") or isinstance(value, bool):
                continue
            if isinstance(value, (int, float)) and math.isfinite(value):
                values[f"eval/{key}"] = float(value)
    return out


def _pick(scored: list[tuple[float, int]], mode: str) -> tuple[float, int]:
    sign = 1.0 if mode == "max" else -1.0
    return max(scored, key=lambda item: (sign * item[0], -item[1]))  # ties: the earlier step


def _best_from_logs(run: Path, by_step: dict[int, Path], name: str, mode: str, logs: str | Path | None,
                    notes: list[str]) -> tuple[Path, int, float, str] | None:
    path = log_path(run, logs)
    if path is None:
        return None
    per_step = eval_metrics_by_step(path)
    scored = [(values[name], step) for step, values in per_step.items() if name in values and step in by_step]
    if not scored:
        missing = [s for s, v in per_step.items() if name in v and s not in by_step]
        if missing:
            notes.append(f"{name} was logged at steps {missing[:5]} but none of them has a checkpoint")
        return None
    logged_best = _pick([(values[name], step) for step, values in per_step.items() if name in values], mode)
    value, step = _pick(scored, mode)
    if logged_best[1] != step:
        notes.append(f"the best logged step ({logged_best[1]}, {name}={logged_best[0]:.4g}) has no checkpoint "
                     f"(retention?); exported the best one that does: step {step}")
    return by_step[step], step, value, str(path)


def _best_from_trainer_marker(run: Path, name: str, mode: str) -> tuple[Path, int | None, float | None, str] | None:
    marker = checkpoint_root(run) / "best.json"
    pointer = read_pointer(run, "best")
    if pointer is None or not marker.is_file():
        return None
    try:
        info = json.loads(marker.read_text())
    except ValueError:
        return None
    if info.get("metric") != name or info.get("mode", "max") != mode:
        return None
    value = info.get("value")
    return pointer, step_of(pointer), float(value) if value is not None else None, str(marker)


def _best_from_meta(by_step: dict[int, Path], name: str, mode: str) -> tuple[Path, int, float, str] | None:
    scored = []
    for step, path in by_step.items():
        try:
            metrics = json.loads((path / META).read_text()).get("metrics") or {}
        except ValueError:
            continue
        value = metrics.get(name)
        if isinstance(value, (int, float)) and math.isfinite(value):
            scored.append((float(value), step))
    if not scored:
        return None
    value, step = _pick(scored, mode)
    return by_step[step], step, value, str(by_step[step] / META)


# ---------------------------------------------------------------- loading and writing


def load_for_export(ckpt: Path, base: str | None = None, dtype: str = "auto") -> tuple[Any, Any, dict]:
    """Load a checkpoint as a plain HF model (LoRA merged) and its tokenizer; returns (model, tokenizer, lora_info)."""
    torch_dtype = "auto" if dtype == "auto" else DTYPES[dtype]
    lora: dict[str, Any] = {"merged": False}
    try:
        if (ckpt / ADAPTER_CONFIG).is_file():
            peft_config = PeftConfig.from_pretrained(str(ckpt))
            base_path = resolve_model_path(base or peft_config.base_model_name_or_path or "")
            base_model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch_dtype, use_safetensors=True)
            peft_model = PeftModel.from_pretrained(base_model, str(ckpt))
            # merge_and_unload folds the adapters into the base weights in place; no second copy of the model.
            model = peft_model.merge_and_unload()
            lora = {"merged": True, "base_model": base_path, "rank": getattr(peft_config, "r", None),
                    "alpha": getattr(peft_config, "lora_alpha", None),
                    "target_modules": sorted(peft_config.target_modules)
                    if isinstance(peft_config.target_modules, (set, list)) else peft_config.target_modules}
        else:
            if not (ckpt / "config.json").is_file():
                raise ModelError(f"'{ckpt}' is not a model checkpoint (no config.json or {ADAPTER_CONFIG})")
            model = model_class(ckpt).from_pretrained(str(ckpt), dtype=torch_dtype, use_safetensors=True)
    except (OSError, ValueError) as exc:
        is_lora = (ckpt / ADAPTER_CONFIG).is_file()
        hint = " (for a LoRA checkpoint whose base moved, pass --base PATH)" if is_lora else ""
        raise ModelError(f"cannot load '{ckpt}' for export: {exc}{hint}") from None
    except SafetensorError as exc:
        raise ModelError(f"the weights in '{ckpt}' are damaged ({exc}); the file was cut short or overwritten: "
                         "export another checkpoint (--select global_step_N) or copy this one again") from None
    tokenizer_dir = ckpt if (ckpt / "tokenizer_config.json").is_file() else Path(lora.get("base_model") or ckpt)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot load a tokenizer from '{tokenizer_dir}' for export: {exc}") from None
    return model.eval(), tokenizer, lora


def config_hash(run_dir: Path | None, ckpt: Path) -> tuple[str | None, str | None]:
    """sha256 of the run's ``config.yaml`` (the training config), else of the checkpoint's ``config.json``."""
    for path in ([run_dir / "config.yaml"] if run_dir else []) + [ckpt / "config.json", ckpt / ADAPTER_CONFIG]:
        if path.is_file():
            return hashlib.sha256(path.read_bytes()).hexdigest(), str(path)
    return None, None


def _verify(model: Any, export_dir: Path, tokenizer: Any) -> float:
    """Reload the written model and compare logits with the in-memory one; returns the max abs difference."""
    reloaded = model_class(export_dir).from_pretrained(str(export_dir), dtype="auto", use_safetensors=True).eval()
    text = "1 + 2 = 3. The quick brown fox."
    ids = tokenizer(text, return_tensors="pt")["input_ids"][:, :32]
    if ids.numel() == 0:
        ids = torch.tensor([[tokenizer.bos_token_id or 0]])
    device = next(model.parameters()).device
    with torch.inference_mode():
        a = model(input_ids=ids.to(device)).logits.float().cpu()
        b = reloaded(input_ids=ids).logits.float().cpu()
    diff = float((a - b).abs().max())
    scale = float(a.abs().max()) or 1.0
    if not math.isfinite(diff) or diff > 1e-3 * max(1.0, scale):
        raise VerlError(f"export check failed: the written model's logits differ from the source by {diff:.3g}; "
                        "nothing was exported")
    return diff


def export_model(target: str | Path, selection: Selection, force: bool = False, base: str | None = None,
                 dtype: str = "auto", verify: bool = True) -> Path:
    """Write the export for ``selection`` to ``target`` atomically; returns the target path."""
    target = Path(target).expanduser()
    if target.exists() and not target.is_dir():
        raise VerlError(f"--to '{target}' is a file, not a directory; give a new directory path for the export")
    if target.exists() and not force:
        raise VerlError(f"'{target}' already exists; pass --force to replace it (the old export is kept until "
                        "the new one is complete)")
    if target.exists() and not (target / EXPORT_FILE).is_file() and any(target.iterdir()):
        raise VerlError(f"'{target}' exists and is not a verl export (no {EXPORT_FILE}); refusing to replace it "
                        "even with --force: choose another --to")
    ckpt = selection.checkpoint
    started = time.time()
    model, tokenizer, lora = load_for_export(ckpt, base=base, dtype=dtype)
    if getattr(tokenizer, "chat_template", None) is None:
        selection.notes.append("the tokenizer has no chat template: /v1/chat/completions will refuse requests")
    _complete_generation_config(model, tokenizer)
    run_dir = selection.run_dir or find_run_dir(ckpt)
    digest, hashed = config_hash(run_dir, ckpt)
    metrics_at_step: dict[str, float] = {}
    if run_dir is not None and selection.step is not None:
        logs = log_path(run_dir)
        if logs is not None:
            metrics_at_step = eval_metrics_by_step(logs).get(selection.step, {})
    if not metrics_at_step and (ckpt / META).is_file():
        try:
            saved = json.loads((ckpt / META).read_text()).get("metrics") or {}
            metrics_at_step = {k: v for k, v in saved.items() if isinstance(v, (int, float))}
        except ValueError:
            pass
    with atomic_dir(target, overwrite=force) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if run_dir is not None and (run_dir / "config.yaml").is_file():
            shutil.copyfile(run_dir / "config.yaml", tmp / "training_config.yaml")
        leftovers = sorted(p.name for p in tmp.glob("*.bin")) + sorted(p.name for p in tmp.glob("*.pt"))
        if leftovers:
            raise VerlError(f"export wrote non-safetensors weights {leftovers}; refusing to publish it")
        max_diff = _verify(model, tmp, tokenizer) if verify else None
        info = {
            "schema": SCHEMA,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "source": {"run": str(run_dir.resolve()) if run_dir else None, "checkpoint": str(ckpt.resolve()),
                       "step": selection.step, "selected_by": selection.selected_by,
                       "selection_metric": selection.metric},
            "metrics": metrics_at_step,
            "data": _data_lineage(run_dir),
            "config_hash": {"sha256": digest, "file": hashed},
            "lora": lora,
            "model": {"architecture": (model.config.architectures or [type(model).__name__])[0],
                      "parameters": sum(p.numel() for p in model.parameters()),
                      "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
                      "chat_template": getattr(tokenizer, "chat_template", None) is not None},
            "verify": {"max_abs_logit_diff": max_diff} if verify else None,
            "notes": selection.notes,
            "versions": {"verl_suite": __version__, "transformers": transformers.__version__,
                         "torch": torch.__version__},
            "seconds": round(time.time() - started, 2),
        }
        atomic_write_json(tmp / EXPORT_FILE, info)
    return target


def _data_lineage(run_dir: Path | None) -> dict | None:
    """The records a run trained on (``verl data from-records`` exports), as the run kept them; None otherwise."""
    path = run_dir / DATA_LINEAGE_FILE if run_dir is not None else None
    if path is None or not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError:
        return None


def _complete_generation_config(model: Any, tokenizer: Any) -> None:
    """Make sure generation stops at the tokenizer's eos and pads with its pad token, whatever training left (a
    reward model does not generate: it gets none)."""
    if not hasattr(model, "generation_config"):
        return
    config = model.generation_config or GenerationConfig()
    if config.eos_token_id is None and tokenizer.eos_token_id is not None:
        config.eos_token_id = tokenizer.eos_token_id
    if config.pad_token_id is None:
        config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if config.bos_token_id is None and tokenizer.bos_token_id is not None:
        config.bos_token_id = tokenizer.bos_token_id
    model.generation_config = config


def run_export(to: str | Path, run: str | Path | None = None, ckpt: str | Path | None = None, select: str = "best",
               metric: str | None = None, force: bool = False, base: str | None = None, dtype: str = "auto",
               logs: str | Path | None = None, verify: bool = True) -> tuple[Path, Selection]:
    """The CLI's entry point: exactly one of ``run`` / ``ckpt``."""
    if (run is None) == (ckpt is None):
        raise ConfigError("give exactly one of --run RUN_DIR (with --select) or --ckpt CHECKPOINT_DIR")
    if ckpt is not None:
        path = Path(ckpt).expanduser()
        if str(ckpt).startswith("builtin:"):  # a built-in model (e.g. the real smollm2-135m-instruct) as it ships

            path = Path(resolve_model_path(str(ckpt)))
        if not path.exists():
            raise missing_dir_error(str(ckpt), "--ckpt")
        if not path.is_dir():
            raise CheckpointError(f"--ckpt '{path}' is not a directory")
        selection = Selection(path, step_of(path), "ckpt", find_run_dir(path))
    else:
        selection = select_checkpoint(run, select, metric, logs)
    return export_model(to, selection, force=force, base=base, dtype=dtype, verify=verify), selection

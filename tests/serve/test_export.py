"""``verl export``: checkpoint selection (best/latest/step), self-contained output, LoRA merge, atomic writes."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from serve.export import run_export, select_checkpoint
from verl.errors import CheckpointError, VerlError
from verl.models.tiny import TinySpec, build_char_tokenizer, build_tiny_model
from verl.trainer.checkpoint import save_checkpoint

pytestmark = pytest.mark.e2e  # a real process, server, cluster or trainer run: `make test-fast` skips it

# A few thousand parameters: every export here takes well under a second.
SPEC = TinySpec(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                intermediate_size=64, max_position_embeddings=64)
ACCURACY = {1: 0.2, 2: 0.7, 3: 0.5}


def _eval_row(step: int, **fields) -> str:
    return json.dumps({"timestamp": "2026-01-01T00:00:00", "level": "INFO", "scope": "eval", "step": step,
                       **fields}) + "\n"


def make_run(root: Path, accuracy: dict[int, float] = ACCURACY, logs: bool = True, meta_metrics: bool = True) -> Path:
    """A run dir as the trainer writes it: checkpoints whose lm_head differs per step, logs, config.yaml."""
    run = root / "run"
    tokenizer = build_char_tokenizer(model_max_length=64)
    model = build_tiny_model(tokenizer, SPEC, seed=0)
    rows = []
    for step, acc in accuracy.items():
        with torch.no_grad():
            model.lm_head.weight.add_(0.01 * step)  # each checkpoint is recognisably different
        metrics = {"eval/accuracy": acc} if meta_metrics else {}
        save_checkpoint(run, step, model, tokenizer, {"step": step}, metrics)
        rows.append(_eval_row(step, accuracy=acc, length=10.0 + step))
        rows.append(json.dumps({"scope": "rollout", "step": step, "reward_mean": 1.0}) + "\n")
    (run / "config.yaml").write_text("trainer:\n  project_name: test\n  experiment_name: run\n")
    if logs:
        (run / "verl_logs.jsonl").write_text("".join(rows))
    return run


def lm_head(path: Path) -> torch.Tensor:
    return load_file(str(path / "model.safetensors"))["lm_head.weight"]


def test_select_best_latest_and_named_step(tmp_path):
    run = make_run(tmp_path)
    best = select_checkpoint(run, "best")
    assert best.step == 2 and best.metric["value"] == 0.7 and best.metric["source"].endswith("verl_logs.jsonl")
    assert select_checkpoint(run, "best", "eval/accuracy:min").step == 1
    assert select_checkpoint(run, "best", "length:min").step == 1  # a bare name means the eval scope
    assert select_checkpoint(run, "latest").step == 3
    assert select_checkpoint(run, "global_step_1").checkpoint.name == "global_step_1"
    with pytest.raises(CheckpointError, match="no checkpoint global_step_9; it has global_step_1"):
        select_checkpoint(run, "global_step_9")
    with pytest.raises(VerlError, match="must be best, latest or global_step_N"):
        select_checkpoint(run, "newest")


def test_eval_best_json_wins_when_present(tmp_path):
    run = make_run(tmp_path)
    (run / "eval").mkdir()
    best = {"label": "global_step_3", "step": 3, "checkpoint": str(run / "checkpoints" / "global_step_3"),
            "metric": "eval/accuracy", "mode": "max", "value": 0.9}
    (run / "eval" / "best.json").write_text(json.dumps(best))
    chosen = select_checkpoint(run, "best")
    assert chosen.step == 3 and chosen.metric["value"] == 0.9 and chosen.metric["source"].endswith("best.json")
    # A moved run: the absolute path is stale but the label still names the checkpoint.
    (run / "eval" / "best.json").write_text(json.dumps({**best, "checkpoint": "/elsewhere/global_step_3"}))
    assert select_checkpoint(run, "best").step == 3
    # Asked for another metric than the evaluator ranked by: the training logs decide, and we say so.
    other = select_checkpoint(run, "best", "eval/length:max")
    assert other.step == 3 and other.metric["source"].endswith("verl_logs.jsonl")
    assert any("ranks by eval/accuracy" in note for note in other.notes)


def test_best_skips_deleted_checkpoints_and_falls_back_to_meta(tmp_path):
    run = make_run(tmp_path)
    shutil.rmtree(run / "checkpoints" / "global_step_2")
    chosen = select_checkpoint(run, "best")
    assert chosen.step == 3 and any("has no checkpoint" in note for note in chosen.notes)
    (run / "verl_logs.jsonl").unlink()
    from_meta = select_checkpoint(run, "best")
    assert from_meta.step == 3 and from_meta.metric["source"].endswith("meta.json")


def test_best_without_metrics_says_what_to_do(tmp_path):
    run = make_run(tmp_path, logs=False, meta_metrics=False)
    with pytest.raises(CheckpointError, match="verl eval --ckpt"):
        select_checkpoint(run, "best")
    with pytest.raises(CheckpointError, match="does not exist"):
        select_checkpoint(tmp_path / "nope", "best")
    with pytest.raises(VerlError, match="exactly one of --run"):
        run_export(tmp_path / "x", run=run, ckpt=run)


def test_export_is_a_self_contained_servable_dir(tmp_path):
    run = make_run(tmp_path)
    out, selection = run_export(tmp_path / "exports" / "best", run=run, select="best")
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
            "generation_config.json", "export.json", "training_config.yaml"} <= names
    assert not names & {"trainer_state.pt", "meta.json", "adapter_config.json", "pytorch_model.bin"}
    assert torch.equal(lm_head(out), lm_head(run / "checkpoints" / "global_step_2"))
    info = json.loads((out / "export.json").read_text())
    assert info["source"]["step"] == 2 and info["source"]["selected_by"] == "best"
    assert info["source"]["selection_metric"]["value"] == 0.7
    assert info["metrics"] == {"eval/accuracy": 0.7, "eval/length": 12.0}
    assert info["config_hash"]["sha256"] == hashlib.sha256((run / "config.yaml").read_bytes()).hexdigest()
    assert info["lora"] == {"merged": False} and info["verify"]["max_abs_logit_diff"] == 0.0
    # It loads with plain transformers (safetensors only) and chats with its own template.
    from verl.models.loader import load_causal_lm, load_tokenizer

    model, tokenizer = load_causal_lm(str(out)), load_tokenizer(str(out))
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "1+1"}], add_generation_prompt=True)
    assert ids["input_ids"][-1] == tokenizer.convert_tokens_to_ids("<|assistant|>")


def test_export_refuses_to_overwrite_without_force(tmp_path):
    run = make_run(tmp_path)
    target = tmp_path / "exp"
    run_export(target, run=run, select="global_step_1")
    with pytest.raises(VerlError, match="already exists; pass --force"):
        run_export(target, run=run, select="latest")
    assert json.loads((target / "export.json").read_text())["source"]["step"] == 1
    run_export(target, run=run, select="latest", force=True)
    assert json.loads((target / "export.json").read_text())["source"]["step"] == 3
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("mine")
    with pytest.raises(VerlError, match="not a verl export"):
        run_export(precious, run=run, select="latest", force=True)
    assert (precious / "notes.txt").read_text() == "mine"


def test_a_failed_export_leaves_nothing_behind(tmp_path, monkeypatch):
    import serve.export as export

    run = make_run(tmp_path)
    target = tmp_path / "exp"
    run_export(target, run=run, select="global_step_1")

    def broken(*args, **kwargs):
        raise VerlError("export check failed: simulated")

    monkeypatch.setattr(export, "_verify", broken)
    with pytest.raises(VerlError, match="simulated"):
        run_export(target, run=run, select="latest", force=True)
    with pytest.raises(VerlError, match="simulated"):
        run_export(tmp_path / "fresh", run=run, select="latest")
    assert json.loads((target / "export.json").read_text())["source"]["step"] == 1  # the old export is intact
    assert not (tmp_path / "fresh").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp", "run"]  # no temp dirs left


def test_lora_checkpoint_is_exported_merged(tmp_path):
    from verl.config import LoraConfig
    from verl.models.lora import apply_lora

    tokenizer = build_char_tokenizer(model_max_length=64)
    base_dir = tmp_path / "base"
    build_tiny_model(tokenizer, SPEC, seed=0).save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    model = apply_lora(AutoModelForCausalLM.from_pretrained(base_dir), LoraConfig(rank=4, alpha=8))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:  # B starts at zero (a no-op adapter); make it matter
                param.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(len(name)))
    run = tmp_path / "run"
    ckpt = save_checkpoint(run, 5, model, tokenizer, {"step": 5}, {"eval/accuracy": 0.4})
    assert (ckpt / "adapter_config.json").is_file() and not (ckpt / "model.safetensors").exists()

    out, _ = run_export(tmp_path / "merged", ckpt=ckpt)
    assert not (out / "adapter_config.json").exists() and (out / "model.safetensors").is_file()
    info = json.loads((out / "export.json").read_text())
    assert info["lora"]["merged"] is True and info["lora"]["rank"] == 4 and info["source"]["step"] == 5
    assert info["source"]["run"] == str(run.resolve())
    merged = AutoModelForCausalLM.from_pretrained(out, use_safetensors=True).eval()
    ids = torch.tensor([tokenizer("12+30=")["input_ids"]])
    with torch.inference_mode():
        expected = model.eval()(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(base_dir).eval()(input_ids=ids).logits
        got = merged(input_ids=ids).logits
    assert torch.allclose(got, expected, atol=1e-5)
    assert not torch.allclose(got, base, atol=1e-3)  # the adapter really changed the model


def test_cli_export_and_its_errors(tmp_path):
    run = make_run(tmp_path)
    verl = str(Path(sys.executable).parent / "verl")
    target = tmp_path / "cli-export"
    ok = subprocess.run([verl, "export", "--run", str(run), "--select", "best", "--to", str(target)],
                        capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert "global_step_2" in ok.stderr and "eval/accuracy:max = 0.7" in ok.stderr
    again = subprocess.run([verl, "export", "--run", str(run), "--to", str(target)], capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 1 and "already exists" in again.stderr and "Traceback" not in again.stderr


def test_a_builtin_model_exports_by_name(tmp_path):
    # `verl export --ckpt builtin:NAME` (e.g. the real smollm2-135m-instruct) resolves the name like model.path does.
    out, selection = run_export(ckpt="builtin:tiny-arith", to=tmp_path / "exp")
    assert (out / "model.safetensors").is_file() and (out / "export.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.hidden_size == 128 and selection.selected_by == "ckpt"


def test_checkpoint_and_export_files_all_follow_the_umask(tmp_path):
    # safetensors writes model.safetensors 0600; a service running as another user could not read it.
    import os
    import stat

    old = os.umask(0o022)
    try:
        out, _ = run_export(ckpt="builtin:tiny-arith", to=tmp_path / "exp")
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir() if p.is_file()}
    assert modes["model.safetensors"] == 0o644 and set(modes.values()) == {0o644}, modes

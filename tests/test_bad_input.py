"""Bad input on the command line gets one line naming the path or flag and the fix — never a traceback — and
damaged files are recognised instead of loaded (issue 16 items 7-10). Every case runs the real CLI on a real run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

pytestmark = pytest.mark.e2e  # a real process, server, cluster or trainer run: `make test-fast` skips it

REPO = Path(__file__).resolve().parents[1]
TINY = ["trainer.total_steps=2", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=2",
        "trainer.save_freq=1", "trainer.test_freq=2", "data.val_max_samples=8", "trainer.logger=[jsonl]",
        "trainer.num_threads=1"]


def cli(*args: str):
    from verl.cli import app, register_subcommands

    if not any(c.name == "eval" for c in app.registered_commands):
        register_subcommands()
    return CliRunner().invoke(app, list(args))


def one_line_error(result, *needles: str) -> str:
    """The command failed with exit 1 and a single 'error:' line that contains every needle."""
    text = result.output
    assert result.exit_code == 1, text + repr(result.exception)
    assert "Traceback" not in text and not isinstance(result.exception, (IndexError, OSError, ValueError)), text
    lines = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, text
    # rich may wrap a long line in a narrow terminal: compare with the wrapping undone
    flat = " ".join(text.split())
    for needle in needles:
        assert needle in flat, (needle, text)
    return flat


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bad-input")
    result = cli("train", *TINY, f"trainer.output_dir={root}", "trainer.experiment_name=r", "--quiet")
    assert result.exit_code == 0, result.output
    return root / "verl" / "r"


def truncated_copy(checkpoint: Path, to: Path) -> Path:
    import shutil

    shutil.copytree(checkpoint, to)
    weights = to / "model.safetensors"
    with weights.open("r+b") as handle:
        handle.truncate(weights.stat().st_size // 2)
    return to


def test_messages_print_verbatim_brackets_included(tmp_path):
    """rich's markup would read ``[console,jsonl,tensorboard]`` as a style tag and drop it: the console prints
    messages as they are, and an install hint names a command that works from a checkout."""
    from verl.models.gguf import INSTALL_SMOLLM2

    flat = one_line_error(cli("train", "trainer.logger=[console,nosuch]", f"trainer.output_dir={tmp_path}"),
                          "unknown tracker(s) ['nosuch']", "(e.g. trainer.logger=[console,jsonl,tensorboard])")
    assert "'nosuch'" in flat
    assert INSTALL_SMOLLM2.startswith("make install-real-model") and "'.[real-model]'" in INSTALL_SMOLLM2


def test_a_config_that_is_not_utf8_is_named(tmp_path):
    bad = tmp_path / "grpo.yaml"
    bad.write_bytes(b"\xff\xfe\x00binary")
    one_line_error(cli("train", "--config", str(bad)), str(bad), "not UTF-8")


def test_output_paths_that_are_files_are_named_before_any_work(run, tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    ckpt = str(run / "checkpoints" / "global_step_2")
    one_line_error(cli("train", *TINY, f"trainer.output_dir={a_file}"), "trainer.output_dir", str(a_file),
                   "is a file")
    one_line_error(cli("train", *TINY, f"trainer.output_dir={a_file / 'sub'}"), f"is inside '{a_file}'")
    one_line_error(cli("eval", "--ckpt", ckpt, "--out", str(a_file)), "--out", str(a_file), "is a file")
    one_line_error(cli("compare", str(run), str(run), "--out", str(a_file)), "--out", "is a file")
    one_line_error(cli("export", "--ckpt", ckpt, "--to", str(a_file), "--force"), "--to", "is a file")
    one_line_error(cli("loadtest", "--out", str(a_file)), "--out", "is a file")
    assert a_file.read_text() == "x"
    # Where nothing can be created at all (/proc refuses new entries, even to root): one line, no traceback.
    one_line_error(cli("export", "--ckpt", ckpt, "--to", "/proc/verl-export"), "cannot write '/proc/verl-export'")
    one_line_error(cli("export", "--ckpt", ckpt, "--to", "/proc/verl/export"), "'/proc/verl' cannot be created")


@pytest.mark.parametrize(("flags", "needles"), [
    (["--max-new-tokens", "-5"], ["--max-new-tokens -5", "greater than or equal to 1"]),
    (["--top-p", "5"], ["--top-p 5.0", "less than or equal to 1"]),
    (["--max-samples", "0"], ["--max-samples 0"]),
    (["--batch-size", "0"], ["--batch-size 0"]),
    (["--n", "0", "--temperature", "-1"], ["--n 0", "--temperature -1.0"]),
])
def test_eval_flags_follow_the_config_rules(run, flags, needles):
    one_line_error(cli("eval", "--ckpt", str(run / "checkpoints" / "global_step_2"), *flags), *needles)


def test_compare_and_loadtest_flags_are_checked(run):
    one_line_error(cli("compare", str(run), str(run), "--max-samples", "0"), "--max-samples 0")
    one_line_error(cli("loadtest", "--max-tokens", "0"), "--max-tokens must be >= 1")


def test_truncated_weights_are_one_line_in_eval_and_export(run, tmp_path):
    damaged = truncated_copy(run / "checkpoints" / "global_step_2", tmp_path / "damaged")
    one_line_error(cli("eval", "--ckpt", str(damaged), "--max-samples", "4"), str(damaged), "damaged")
    one_line_error(cli("export", "--ckpt", str(damaged), "--to", str(tmp_path / "export")), str(damaged), "damaged")
    assert not (tmp_path / "export").exists()


def test_resume_skips_a_damaged_latest_checkpoint_with_a_warning(tmp_path):
    from verl.trainer.checkpoint import checkpoint_problem
    from verl.utils.log import read_jsonl

    common = [*TINY, f"trainer.output_dir={tmp_path}", "trainer.experiment_name=d", "--quiet"]
    assert cli("train", *common).exit_code == 0
    run_dir = tmp_path / "verl" / "d"
    step2 = run_dir / "checkpoints" / "global_step_2"
    meta = json.loads((step2 / "meta.json").read_text())
    assert meta["files"]["model.safetensors"]["bytes"] == (step2 / "model.safetensors").stat().st_size
    assert checkpoint_problem(step2) is None

    weights = step2 / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # same size, one byte flipped: only the hash can tell
    weights.write_bytes(bytes(data))
    os.utime(step2 / "meta.json")  # a new mtime: no cached verdict
    assert "SHA-256" in checkpoint_problem(step2)

    result = cli("train", *[a for a in common if not a.startswith("trainer.total_steps")], "trainer.total_steps=3",
                 "trainer.resume=auto")
    assert result.exit_code == 0, result.output
    flat = " ".join(result.output.split())
    assert f"skipping damaged checkpoint {step2}" in flat and "resuming from global_step_1" in flat
    resumed = [r for r in read_jsonl(run_dir / "verl_logs.jsonl") if r.get("status") == "resumed"]
    assert resumed[-1]["step"] == 1 and resumed[-1]["checkpoint"].endswith("global_step_1")
    assert checkpoint_problem(step2) is None  # step 2 was trained again and rewritten whole

    result = cli("train", *common[:-1], f"trainer.resume={step2.parent / 'global_step_1'}", "--quiet",
                 "trainer.total_steps=3")
    assert result.exit_code == 0, result.output


def test_an_explicitly_named_damaged_checkpoint_is_refused(tmp_path, run):
    damaged = truncated_copy(run / "checkpoints" / "global_step_1", tmp_path / "global_step_1")
    one_line_error(cli("train", *TINY, f"trainer.output_dir={tmp_path}", f"trainer.resume={damaged}"),
                   "is damaged", "model.safetensors has")


def test_a_killed_eval_gets_its_report_back_on_the_next_run(run, tmp_path):
    ckpt = str(run / "checkpoints" / "global_step_2")
    out = tmp_path / "ev"
    assert cli("eval", "--ckpt", ckpt, "--max-samples", "4", "--out", str(out), "--quiet").exit_code == 0
    results = (out / "results.json").read_bytes()
    (out / "report.html").unlink()
    (out / "length_hist.png").unlink()
    (out / ".length_hist.png.x1y2.tmp").write_bytes(b"")  # what a kill during savefig leaves
    result = cli("eval", "--ckpt", ckpt, "--max-samples", "4", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert "rewrote the missing report" in result.output
    assert (out / "report.html").stat().st_size > 0 and (out / "length_hist.png").stat().st_size > 0
    assert not list(out.glob(".*.tmp")) and (out / "results.json").read_bytes() == results


def test_a_prompt_file_that_is_not_utf8_fails_locust_at_once(tmp_path):
    from loadtest.prompts import load_prompts
    from verl.errors import DataError

    bad = tmp_path / "prompts.jsonl"
    bad.write_bytes(b'{"prompt": "1+1"}\n{"prompt": "a\xff"}\n')
    with pytest.raises(DataError, match="line 2: not UTF-8"):
        load_prompts(str(bad))
    # Locust (its own process: gevent) stops at init, before waiting for any service
    result = subprocess.run([sys.executable, "-m", "locust", "-f", "loadtest/", "--headless", "-H",
                             "http://127.0.0.1:9", "--prompt-file", str(bad)],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "line 2: not UTF-8" in result.stderr


@pytest.mark.timeout(240)
def test_a_load_test_whose_requests_all_fail_stops_at_once_with_the_first_error(tmp_path):
    """Every request is refused (max_tokens over the server's limit): Locust stops after 10 failures instead of
    running its 2 x 60 s, and `verl loadtest` exits 1 quoting the server's message."""
    result = subprocess.run(
        [sys.executable, "-m", "verl.cli", "loadtest", "--out", str(tmp_path / "lt"), "--step-users", "1,2",
         "--step-time", "60", "--step-settle", "1", "--locust-arg=--max-tokens=100000"],
        cwd=REPO, capture_output=True, text=True, timeout=200)
    flat = " ".join(result.stderr.split())
    assert result.returncode == 1, result.stderr[-3000:]
    assert "the load test stopped early: the first 10 requests all failed" in flat
    assert "this server allows at most" in flat
    locust_log = (tmp_path / "lt" / "locust.log").read_text()
    assert "loadtest aborted:" in locust_log

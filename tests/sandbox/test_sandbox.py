"""The sandbox in this process and over SandboxFusion's HTTP API, the code reward on hand-checked rows, and
verl's sandbox_fusion keys training the tiny model through `verl sandbox serve`."""

from __future__ import annotations

import base64
import json
import shlex
import subprocess
import sys

import httpx
import pytest

from tests.conftest import REPO
from tests.ports import serve
from tests.readme import readme_block
from tests.trainer_utils import TINY, rows, run_cli
from verl.config import load_config
from verl.errors import DataError
from verl.rewards.code import code, extract_program, parse_tests
from verl.sandbox import Limits, RunCodeRequest, Sandbox
from verl.sandbox.client import configure

pytestmark = pytest.mark.usefixtures("bubblewrap")


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return Sandbox(Limits(wall_seconds=3, cpu_seconds=3, memory_mb=512, output_bytes=4096), max_concurrent=2)


@pytest.fixture(autouse=True, scope="module")
def local_runner():
    configure(None, max_concurrent=2, memory_limit_mb=512)  # the code reward's runner: this process's sandbox


def run(sandbox: Sandbox, code: str, **kw):
    return sandbox.run(RunCodeRequest(code=code, **kw))


def test_a_program_runs_with_its_stdin_and_files_and_answers_in_sandboxfusion_shape(sandbox):
    files = {"data/numbers.txt": base64.b64encode(b"3 4\n").decode()}
    reply = run(sandbox, "import sys\na, b = map(int, open('data/numbers.txt').read().split())\n"
                         "print(a * b, input().upper())\nprint('warn', file=sys.stderr)", stdin="abc\n", files=files)
    assert reply.status == "Success" and reply.message == ""
    result = reply.run_result
    assert (result.status, result.return_code, result.stdout, result.stderr) == ("Finished", 0, "12 ABC\n", "warn\n")
    assert run(sandbox, "echo $((6 * 7))", language="bash").run_result.stdout == "42\n"


def test_a_failing_program_is_failed_with_its_exit_code_and_stderr(sandbox):
    reply = run(sandbox, "import sys\nprint('partial')\nsys.exit(3)")
    assert (reply.status, reply.run_result.status, reply.run_result.return_code) == ("Failed", "Finished", 3)
    reply = run(sandbox, "raise ValueError('nope')")
    assert reply.run_result.return_code == 1 and "ValueError: nope" in reply.run_result.stderr


def test_limits_stop_a_run_with_the_status_and_message_saying_which(sandbox):
    slept = run(sandbox, "import time\ntime.sleep(60)", run_timeout=1)
    assert (slept.status, slept.run_result.status, slept.run_result.return_code) == (
        "Failed", "TimeLimitExceeded", None)
    assert slept.message == "exceeded: wall time limit of 1 s"
    big = run(sandbox, "x = bytearray(50 * 1024**3)")
    assert big.status == "Failed" and big.message == "exceeded: memory limit of 512 MB"
    loud = run(sandbox, "print('y' * 10**6)")
    assert loud.status == "Failed" and loud.run_result.stdout == "y" * 4096
    assert loud.message == "exceeded: output limit of 4096 bytes (output cut there)"


def test_what_is_not_run_is_a_sandbox_error_naming_it(sandbox):
    assert run(sandbox, "int main(){}", language="cpp").message.startswith("language 'cpp' is not run here")
    assert run(sandbox, "print(1)", files={"../x": "eA=="}).message == (
        "files: '../x' must be a relative path inside the working directory")
    assert run(sandbox, "print(1)", fetch_files=["out.txt"]).status == "SandboxError"


def test_code_reward_scores_the_fraction_of_tests_passed_in_each_row_form():
    square = "Here it is:\n```python\ndef sq(x):\n    return x * x\n```\nDone."
    assert extract_program(square) == "def sq(x):\n    return x * x\n"
    calls = {"inputs": [[2], [3], [-1]], "outputs": [4, 10, 1], "fn_name": "sq"}
    assert code("code", square, calls) == {"score": 2 / 3, "acc": 0.0}
    assert code("apps", square, json.dumps({**calls, "outputs": [[4], [9], [1]]})) == {"score": 1.0, "acc": 1.0}
    doubler = "n = int(input())\nprint(n * 2)"
    assert code("code", doubler, {"inputs": ["2\n", "5\n"], "outputs": ["4\n", "11"]})["score"] == 0.5
    assert code("code", square, ["assert sq(2) == 4", "assert sq(3) == 9", "assert sq(1) == 5", "assert sq(0) == 0"]
                )["score"] == 0.75


@pytest.mark.parametrize("program", [
    "import os\nos._exit(0)",  # exits before any test runs
    "print('0 1')\nprint('0 0 1')\ndef f(x): return 0",  # prints verdicts of its own
    "import builtins, os\nwrite = os.write\nos.write = lambda fd, b: write(fd, b.replace(b' 0\\n', b' 1\\n'))\n"
    "builtins.print = lambda *a, **k: None\ndef f(x): return 0",  # rebinds the ways out
    "class Same:\n    def __eq__(self, other): return True\ndef f(x): return Same()",  # equal to everything
    "def f(x):\n    while True: pass",  # never returns
])
def test_a_program_that_games_the_harness_passes_nothing(program):
    assert code("code", program, {"inputs": [[2]], "outputs": [4], "fn_name": "f"}, timeout=2)["score"] == 0.0


def test_a_sandbox_that_gives_no_verdict_is_no_score_not_a_failed_test():
    """A served sandbox that is gone (after its retries) or a sandbox error is SandboxUnavailable, naming the fix:
    never 0, which a run would train on and `verl eval` would report as the model's."""
    from tests.ports import free_port
    from verl.rewards.code import SandboxUnavailable

    square = "```python\ndef sq(x):\n    return x * x\n```"
    calls = {"inputs": [[2]], "outputs": [4], "fn_name": "sq"}
    try:
        configure(f"http://127.0.0.1:{free_port()}/run_code")  # nothing listens there
        with pytest.raises(SandboxUnavailable, match="no answer after 3 tries.*--sandbox-url local"):
            code("code", square, calls)
        with pytest.raises(SandboxUnavailable):  # the stdin/stdout form too
            code("code", "print(4)", {"inputs": ["\n"], "outputs": ["4"]})
    finally:
        configure(None, max_concurrent=2, memory_limit_mb=512)
    assert code("code", square, calls) == {"score": 1.0, "acc": 1.0}


def test_unreadable_ground_truth_is_a_data_error_saying_what_is_expected():
    with pytest.raises(DataError, match="ground_truth is text that is not JSON"):
        parse_tests("print(4)")
    with pytest.raises(DataError, match="2 inputs but 1 outputs"):
        parse_tests({"inputs": [1, 2], "outputs": [1]})


def test_verl_sandbox_fusion_keys_are_ours():
    config = load_config(None, ["reward_model.sandbox_fusion.url=http://127.0.0.1:9/run_code",
                                "reward_model.sandbox_fusion.max_concurrent=8",
                                "reward_model.sandbox_fusion.memory_limit_mb=256"])
    assert config.reward.sandbox.model_dump() == {"url": "http://127.0.0.1:9/run_code", "max_concurrent": 8,
                                                  "memory_limit_mb": 256}


@pytest.fixture(scope="module")
def server():
    process, url = serve("-m", "verl.cli", "sandbox", "serve", "--max-concurrent", "2", "--run-timeout", "5")
    yield url
    process.kill()


@pytest.mark.e2e
def test_served_sandbox_answers_verls_request_as_sandboxfusion_does(server):
    """The body verl's sandbox_fusion client posts (verl/utils/reward_score/sandbox_fusion/utils.py), as it is."""
    body = {"compile_timeout": 10, "run_timeout": 10, "code": "print(int(input()) + 1)", "stdin": "41",
            "language": "python", "files": {}, "fetch_files": []}
    reply = httpx.post(server + "/run_code", json=body, timeout=30).json()
    assert reply["status"] == "Success" and reply["run_result"]["stdout"] == "42\n"
    assert set(reply["run_result"]) == {"status", "execution_time", "return_code", "stdout", "stderr"}
    refused = httpx.post(server + "/run_code", json={**body, "timeout": 3}, timeout=30)
    assert refused.status_code == 422 and "timeout" in refused.text
    assert httpx.get(server + "/health").json()["isolation"] == "bubblewrap"


@pytest.mark.e2e
def test_the_readmes_code_lines_train_through_the_served_sandbox_verls_way(server, tmp_path):
    """README "Code": its `verl train` line as written (its sandbox URL pointed at this test's server), shortened to
    2 tiny steps, after a dry run: every sample is one harness run in the server."""
    lines = readme_block("## Code: a sandbox").replace("\\\n", " ").splitlines()
    assert lines[0] == "verl sandbox serve --port 8080 &"
    words = [w.replace("http://127.0.0.1:8080", server) for w in shlex.split(lines[1])]
    assert words[:2] == ["verl", "train"] and f"reward_model.sandbox_fusion.url={server}/run_code" in words
    args = [*words[2:], f"trainer.output_dir={tmp_path}", "trainer.total_steps=2", *TINY, "trainer.test_freq=0",
            "data.max_response_length=48", "reward_model.sandbox_fusion.max_concurrent=2", "trainer.save_freq=2"]
    dry = run_cli(["train", "--dry-run", *args])
    assert dry.returncode == 0 and "reward_model.sandbox_fusion.url -> reward.sandbox.url" in dry.stderr, dry.stderr
    before = httpx.get(server + "/health").json()["runs"]
    result = run_cli(["train", *args])
    assert result.returncode == 0, result.stderr[-3000:]
    after = httpx.get(server + "/health").json()["runs"]
    ran = sum(after.values()) - sum(before.values())
    assert ran == 2 * 4 * 2, (before, after)  # steps x prompts x samples: each sample's tests in one run
    steps = rows(next(tmp_path.rglob("verl_logs.jsonl")), "rollout")
    assert [r["num_responses"] for r in steps] == [8, 8] and all(0.0 <= r["score_mean"] <= 1.0 for r in steps)

    # The checkpoint's config names the served sandbox. One that no longer answers is no score, said with the fix;
    # `--sandbox-url local` scores in the evaluating process instead.
    from tests.ports import free_port

    checkpoint = str(next(tmp_path.rglob("global_step_2")))
    common = ["eval", "--ckpt", checkpoint, "-e", "code", "--max-samples", "4", "--max-new-tokens", "48"]
    gone = run_cli([*common, "--sandbox-url", f"http://127.0.0.1:{free_port()}/run_code", "--out",
                    str(tmp_path / "gone")])
    assert gone.returncode != 0 and "SandboxUnavailable" in gone.stderr and "--sandbox-url local" in gone.stderr
    assert not (tmp_path / "gone" / "results.json").exists()
    local = run_cli([*common, "--sandbox-url", "local", "--out", str(tmp_path / "local")])
    assert local.returncode == 0, local.stderr[-2000:]
    assert json.loads((tmp_path / "local" / "results.json").read_text())["metrics"]["eval/tests_passed"]["n"] == 4


@pytest.mark.e2e
def test_throughput_benchmark_runs_both_sides_and_prints_their_ratio():
    """A smoke of benchmarks/sandbox_throughput.py (RESULTS.md holds the real run): every run of both sides must
    succeed, and the summary gives the ratio of the medians."""
    out = subprocess.run([sys.executable, "benchmarks/sandbox_throughput.py", "--runs", "4", "--repeats", "1"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    summary = out.stdout.split("=== summary", 1)[1]
    assert "isolation: bubblewrap" in summary and "the price of isolation" in summary


@pytest.mark.e2e
def test_verl_eval_code_on_humaneval_reports_pass_at_k_per_problem(tmp_path):
    """`verl eval -e code` on builtin:humaneval: every sample scored in the sandbox, pass@k with CIs per problem."""
    result = run_cli(["eval", "--ckpt", "builtin:tiny-arith", "--data", "builtin:humaneval", "--evaluators",
                      "code", "--max-samples", "3", "--n", "2", "--max-prompt-length", "512", "--out", str(tmp_path)])
    assert result.returncode == 0, result.stderr[-2000:]
    metrics = json.loads((tmp_path / "results.json").read_text())["metrics"]
    assert {"eval/pass@1", "eval/pass@2", "eval/solved", "eval/tests_passed"} <= set(metrics)
    assert {"se", "ci_low", "ci_high"} <= set(metrics["eval/pass@1"]) and metrics["eval/pass@1"]["evaluator"] == "code"
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 6 and {s["index"] for s in samples} == {0, 1, 2}

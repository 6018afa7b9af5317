"""Response checks, SSE parsing, prompt files and the step plan of the load-test users (no Locust run)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from loadtest.checks import BadResponse, SSEReader, check_chat_stream, check_completion, check_generate, error_message
from loadtest.prompts import load_prompts
from loadtest.shapes import StepPlan, doubling_levels, parse_levels
from verl.errors import DataError


def completion_body(text="33", usage=(17, 3, 20), **changes) -> str:
    body = {"id": "cmpl-1", "object": "text_completion", "model": "m",
            "choices": [{"index": 0, "text": text, "finish_reason": "stop"}],
            "usage": dict(zip(("prompt_tokens", "completion_tokens", "total_tokens"), usage, strict=True))}
    body.update(changes)
    return json.dumps(body)


def test_generate_and_completion_checks():
    ok = check_generate(json.dumps({"response": "33", "finish_reason": "stop", "prompt_tokens": 17,
                                    "completion_tokens": 3}))
    assert (ok.text, ok.prompt_tokens, ok.completion_tokens) == ("33", 17, 3)
    with pytest.raises(BadResponse, match="'response' is empty"):
        check_generate(json.dumps({"response": "  ", "finish_reason": "stop", "prompt_tokens": 1,
                                   "completion_tokens": 1}))
    with pytest.raises(BadResponse, match="'completion_tokens' must be an integer >= 1"):
        check_generate(json.dumps({"response": "x", "finish_reason": "length", "prompt_tokens": 1,
                                   "completion_tokens": 0}))
    with pytest.raises(BadResponse, match="not JSON"):
        check_generate(b"<html>oops</html>")

    assert check_completion(completion_body()).completion_tokens == 3
    with pytest.raises(BadResponse, match=r"total_tokens 21 != prompt_tokens 17 \+ completion_tokens 3"):
        check_completion(completion_body(usage=(17, 3, 21)))
    with pytest.raises(BadResponse, match="exactly one choice"):
        check_completion(completion_body(choices=[]))
    with pytest.raises(BadResponse, match="'usage' missing"):
        check_completion(json.dumps({**json.loads(completion_body()), "usage": None}))
    with pytest.raises(BadResponse, match="'object' must be 'text_completion'"):
        check_completion(completion_body(object="chat.completion"))


def test_error_message_uses_openai_shape():
    body = json.dumps({"error": {"message": "the server is at capacity", "type": "rate_limit_error"}})
    assert error_message(429, body.encode()) == "HTTP 429: the server is at capacity"
    assert error_message(502, b"Bad Gateway") == "HTTP 502: Bad Gateway"
    assert error_message(500, None) == "HTTP 500"
    # No response at all: the client's exception says why (a reset, a refused connection, a timeout).
    assert error_message(0, b"", ConnectionResetError(104, "reset")) == \
        "HTTP 0: no response: ConnectionResetError(104, 'reset')"
    assert error_message(0, None) == "HTTP 0: no response"


def chunk(content=None, finish=None, role=None, usage=None) -> str:
    if usage is not None:
        return json.dumps({"object": "chat.completion.chunk", "choices": [], "usage": usage})
    delta = {k: v for k, v in (("role", role), ("content", content)) if v is not None}
    return json.dumps({"object": "chat.completion.chunk",
                       "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


USAGE = {"prompt_tokens": 17, "completion_tokens": 3, "total_tokens": 20}


def stream(*payloads: tuple[float, str]) -> list[tuple[float, str]]:
    return list(payloads)


def test_chat_stream_timings_by_hand():
    # Preamble at 5 ms (no token), "3" at 40 ms (first token), "3" at 52 ms, finish (EOS token) at 61 ms.
    events = stream((0.005, chunk("", role="assistant")), (0.040, chunk("3")), (0.052, chunk("3")),
                    (0.061, chunk(finish="stop")), (0.062, chunk(usage=USAGE)), (0.063, "[DONE]"))
    result = check_chat_stream(events)
    assert result.text == "33" and result.completion_tokens == 3
    assert result.ttft_s == 0.040 and result.end_s == 0.063
    assert result.itl_s == pytest.approx([0.012, 0.009])
    assert result.mean_itl_s == pytest.approx(0.0105)


@pytest.mark.parametrize("events, message", [
    ([], "before any event"),
    ([(0.1, chunk("3")), (0.2, chunk(finish="stop")), (0.3, chunk(usage=USAGE))], r"did not end with 'data: \[DONE\]'"),
    ([(0.1, chunk("3")), (0.2, json.dumps({"error": {"message": "timed out"}})), (0.3, "[DONE]")],
     "error in stream: timed out"),
    ([(0.1, chunk("", role="assistant")), (0.2, chunk(finish="stop")), (0.3, chunk(usage=USAGE)), (0.4, "[DONE]")],
     "streamed content' is empty"),
    ([(0.1, chunk("3")), (0.2, chunk(finish="stop")), (0.4, "[DONE]")], "no usage chunk"),
    ([(0.1, chunk("3")), (0.2, chunk("3")), (0.3, chunk(usage=USAGE)), (0.4, "[DONE]")], "no chunk finished"),
    ([(0.1, chunk("3")), (0.15, chunk("4")), (0.2, chunk("5")), (0.21, chunk("6", finish="length")),
      (0.3, chunk(usage=USAGE)), (0.4, "[DONE]")], "completion_tokens 3 is below the 4 chunks"),
])
def test_chat_stream_failures(events, message):
    with pytest.raises(BadResponse, match=message):
        check_chat_stream(events)


def test_sse_reader_handles_split_and_crlf():
    reader = SSEReader()
    euro = "data: {\"t\": \"€\"}\n\n".encode()
    # One event split inside the multi-byte character, then two events in one read, one with CRLF endings.
    assert reader.feed(euro[:12]) == []
    assert reader.feed(euro[12:]) == ['{"t": "€"}']
    assert reader.feed(b"data: 1\r\n\r\ndata: [DONE]\n\n: comment\n\ndata: par") == ["1", "[DONE]"]
    assert reader.leftover == b"data: par"


def test_prompt_files(tmp_path):
    builtin = load_prompts("builtin:arithmetic/val", limit=5)
    assert len(builtin) == 5 and all(p.chat for p in builtin)
    assert builtin[0].messages[0]["role"] == "user" and builtin[0].text.startswith("What is")

    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(json.dumps({"q": "Hello?"}) + "\n\n" + json.dumps(
        {"q": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]}) + "\n")
    plain, chat = load_prompts(str(jsonl), column="q")
    assert (plain.chat, plain.text, plain.messages) == (False, "Hello?", ({"role": "user", "content": "Hello?"},))
    assert chat.chat and chat.text == "Be brief.\n2+2?" and len(chat.messages) == 2

    with pytest.raises(DataError, match=r"p\.jsonl, line 1: no 'prompt' field"):
        load_prompts(str(jsonl))
    jsonl.write_text('{"prompt": [{"role": "user"}]}\n')
    with pytest.raises(DataError, match=r"row 0, column 'prompt': a chat prompt must be a list"):
        load_prompts(str(jsonl))
    jsonl.write_text("{not json\n")
    with pytest.raises(DataError, match=r"line 1: not valid JSON"):
        load_prompts(str(jsonl))
    with pytest.raises(DataError, match="does not exist"):
        load_prompts(str(tmp_path / "missing.parquet"))
    with pytest.raises(DataError, match="has no column 'question'"):
        load_prompts("builtin:arithmetic/val", column="question")


def test_step_plan():
    assert doubling_levels(1) == [1]
    assert doubling_levels(8) == [1, 2, 4, 8]
    assert doubling_levels(12) == [1, 2, 4, 8, 12]
    assert parse_levels(" 1, 3,5 ") == [1, 3, 5]
    with pytest.raises(ValueError, match="comma-separated integers"):
        parse_levels("1,two")
    with pytest.raises(ValueError, match="every level >= 1"):
        parse_levels("0,1")
    options = SimpleNamespace(step_users="", max_users=4, step_time=20, step_settle=5)
    plan = StepPlan.from_options(options)
    assert plan.levels == (1, 2, 4) and plan.window_s == 15 and plan.duration_s == 60
    assert [plan.users_at(t) for t in (0, 19.9, 20, 45, 59.9, 60)] == [1, 1, 2, 4, 4, None]
    assert StepPlan.from_options(SimpleNamespace(step_users="3,6", max_users=99, step_time=2.5,
                                                 step_settle=2)).window_s == 1  # never below 1 s
    with pytest.raises(ValueError, match="--step-settle"):
        StepPlan((1,), 10, 10)


def test_step_defaults_agree_in_help_conf_docs_and_verl_loadtest():
    """--max-users / --step-time: the locustfile's defaults (what --help and the web UI show), locust.conf, the docs
    table and `verl loadtest` name the same numbers."""
    import json
    import re
    import subprocess
    import sys

    from loadtest.run import LOCUST_CONF
    from loadtest.settings import LoadTestConfig

    # Importing locust monkey-patches this process (gevent): read the locustfile's defaults in a child process.
    probe = ("import json; from loadtest.locustfile import add_arguments; d = {}\n"
             "class R:\n    def add_argument(self, name, **kw): d[name.lstrip('-')] = kw.get('default')\n"
             "add_arguments(R()); print(json.dumps(d))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                         cwd=LOCUST_CONF.parent.parent)
    defaults = json.loads(out.stdout.strip().splitlines()[-1])
    conf = dict(re.findall(r"^([\w-]+) = (.+)$", LOCUST_CONF.read_text(), flags=re.M))
    docs = (LOCUST_CONF.parent.parent / "docs" / "loadtest.md").read_text()
    row = re.search(r"\| `--max-users` / `--step-users` \| (\d+) / - \|", docs)
    step_row = re.search(r"\| `--step-time` / `--step-settle` \| (\d+) / 5 s \|", docs)
    assert defaults["max-users"] == int(conf["max-users"]) == int(row.group(1)) == LoadTestConfig(out_dir=".").max_users
    assert defaults["step-time"] == float(conf["step-time"]) == float(step_row.group(1)) \
        == LoadTestConfig(out_dir=".").step_time_s


def test_the_first_level_starts_its_clock_when_its_users_run():
    """Workers of a distributed run start their users seconds after the master's test_start: the step shape holds
    the first level's clock at 0 until users run (or FIRST_USERS_WAIT_S passed), so its percentile window is full."""
    import subprocess
    import sys

    from loadtest.run import LOCUST_CONF

    # Importing locust monkey-patches this process (gevent): drive the real StepShape in a child process.
    probe = (
        "import time, types\n"
        "import loadtest.locustfile as lf\n"
        "lf.STATE['ready'] = True\n"
        "options = types.SimpleNamespace(load_shape='steps', step_users='2,4', step_time=20, step_settle=5,\n"
        "                                max_users=None)\n"
        "runner = types.SimpleNamespace(user_count=0, environment=types.SimpleNamespace(parsed_options=options))\n"
        "shape = lf.StepShape(); shape.runner = runner\n"
        "shape.start_time -= 15\n"  # 15 s have passed, but no user runs yet: the clock stays at 0
        "held = (shape.tick(), round(shape.get_run_time()))\n"
        "runner.user_count = 2; shape.start_time -= 15\n"  # users run; 15 s later the clock says so
        "ran = (shape.tick(), round(shape.get_run_time()))\n"
        "runner.user_count = 0; lf.STATE.pop('first_users_running')\n"
        "lf.STATE['first_users_wait_from'] = time.monotonic() - lf.FIRST_USERS_WAIT_S - 1\n"
        "print(held, ran, shape.waiting_for_first_users())\n")  # past the longest wait: it gives up holding
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                          cwd=LOCUST_CONF.parent.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "((2, 2.0), 0) ((2, 2.0), 15) False"

"""Tools for agents: the Hermes call parser, the calculator (ast, never eval), the registry and its YAML config,
and the runner that turns every failure (unknown tool, bad JSON, schema, timeout, exception, dead process) into an
error result instead of an exception."""

from __future__ import annotations

import dataclasses
import textwrap
import threading
import time

import pytest

from verl.errors import ConfigError, DataError
from verl.tools.calculator import CalculatorError, calculator
from verl.tools.calls import format_assistant_turn, format_tool_call, parse_tool_calls
from verl.tools.registry import BUILTIN_TOOLS, build_tool_set, load_tool_config, tools_for_row
from verl.tools.runner import ToolRunner


def test_hermes_calls_parse_and_round_trip():
    text = ('I will compute.<tool_call>\n{"name": "calculator", "arguments": {"expression": "37*412"}}\n'
            '</tool_call><tool_call>{"name": "lookup", "arguments": "{\\"word\\": \\"cat\\"}"}</tool_call>')
    turn = parse_tool_calls(text)
    assert turn.content == "I will compute."
    assert [(c.name, c.arguments, c.valid) for c in turn.calls] == [
        ("calculator", {"expression": "37*412"}, True), ("lookup", {"word": "cat"}, True)]
    assert parse_tool_calls(format_tool_call("calculator", {"expression": "1+1"})).calls[0].arguments == {
        "expression": "1+1"}
    written = format_assistant_turn("ok", [("a", {"x": 1}), ("b", {})])
    assert [c.name for c in parse_tool_calls(written).calls] == ["a", "b"]
    assert parse_tool_calls("no calls here, 42").has_calls is False


@pytest.mark.parametrize(("block", "message"), [
    ("{bad", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ('{"arguments": {}}', "no 'name'"),
    ('{"name": "f", "arguments": "{oops"}', "arguments of 'f' are not valid JSON"),
    ('{"name": "f", "arguments": [1]}', "must be a JSON object"),
])
def test_malformed_calls_are_kept_with_their_error(block, message):
    (call,) = parse_tool_calls(f"<tool_call>{block}</tool_call>").calls
    assert not call.valid and message in call.error


def test_an_unclosed_call_at_the_end_still_parses():
    (call,) = parse_tool_calls('<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}').calls
    assert call.valid and call.arguments == {"expression": "2*3"}


@pytest.mark.parametrize(("expression", "value"), [
    ("37*412", "15244"), ("7/2", "3.5"), ("2**10", "1024"), ("-(3+4)*2", "-14"), ("17//5", "3"), ("17%5", "2"),
    ("1e3", "1000"), ("0.1+0.2", "0.3"), (" 6 * 7 ", "42"), ("10/4*2", "5"),
])
def test_calculator_values(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize(("expression", "message"), [
    ("__import__('os').system('echo hi')", "not arithmetic on numbers"),
    ("x + 1", "not arithmetic on numbers"),
    ("'a' * 3", "not arithmetic on numbers"),
    ("(1).real", "not arithmetic on numbers"),
    ("2 < 3", "not arithmetic on numbers"),
    ("1/0", "division by zero"),
    ("2**100", "exponent 100 is larger than 64"),
    ("9**64 * 9**64", "larger than"),
    ("1 +", "cannot parse"),
    ("1" * 201, "longer than 200"),
])
def test_calculator_refuses_everything_but_arithmetic(expression, message):
    with pytest.raises(CalculatorError, match=message):
        calculator(expression)


# ---------------------------------------------------------------------------------------------- registry

USER_TOOLS = '''
import os
import time

def whoami(seconds):
    time.sleep(seconds)
    return os.getpid()

def lookup(word, dictionary="en"):
    return {"word": word, "dictionary": dictionary, "length": len(word)}

def slow(seconds):
    time.sleep(seconds)
    return "done"

def broken(x):
    raise RuntimeError("the database is down")
'''


def schema(name: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": name, "parameters": {
        "type": "object", "properties": properties, "required": required, "additionalProperties": False}}}


@pytest.fixture
def user_tools(tmp_path):
    (tmp_path / "my_tools.py").write_text(USER_TOOLS)
    config = tmp_path / "tools.yaml"
    config.write_text(textwrap.dedent(f"""
        tools:
          - name: calculator
          - function: {tmp_path}/my_tools.py:lookup
            tool_schema: {schema("lookup", {"word": {"type": "string"}}, ["word"])}
          - function: {tmp_path}/my_tools.py:slow
            timeout_s: 0.5
            tool_schema: {schema("slow", {"seconds": {"type": "number"}}, ["seconds"])}
          - function: {tmp_path}/my_tools.py:broken
            tool_schema: {schema("broken", {"x": {"type": "integer"}}, ["x"])}
          - function: {tmp_path}/my_tools.py:whoami
            tool_schema: {schema("whoami", {"seconds": {"type": "number"}}, ["seconds"])}
    """))
    return config


def test_tool_config_as_verl_writes_it(user_tools):
    tools = build_tool_set([], str(user_tools))
    assert tools.names() == ["calculator", "lookup", "slow", "broken", "whoami"]
    assert tools.tools["calculator"] is BUILTIN_TOOLS["calculator"] and tools.tools["calculator"].pure
    assert not tools.tools["lookup"].pure and tools.tools["slow"].timeout_s == 0.5
    assert [s["function"]["name"] for s in tools.schemas(["slow", "lookup"])] == ["slow", "lookup"]


@pytest.mark.parametrize(("yaml_text", "message"), [
    ("tools: []", "non-empty list under 'tools:'"),
    ("tools: [{name: abacus}]", r"tools\[0\]: 'abacus' is not a built-in tool"),
    ("tools: [{function: 'math:sqrt', tool_schema: {type: function}}]", r"tools\[0\]\.tool_schema: expected"),
    ("tools: [{function: 'math:nope', tool_schema: {type: function, function: {name: x}}}]", "has no 'nope'"),
    ("tools: [{function: 'math:sqrt', tool_schema: {type: function, function: {name: x, parameters: {type: 7}}}}]",
     "not a valid JSON Schema"),
    ("tools: [{function: 'math:sqrt', timeout_s: 0, tool_schema: {type: function, function: {name: x}}}]",
     "timeout_s must be a positive"),
])
def test_bad_tool_configs_name_the_entry(tmp_path, yaml_text, message):
    path = tmp_path / "tools.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError, match=message):
        load_tool_config(str(path))


def test_unknown_builtin_names_the_fix():
    with pytest.raises(ConfigError, match="unknown tool 'abacus'.*built-in: calculator"):
        build_tool_set(["abacus"])


def test_a_rows_tools_come_from_tools_kwargs_or_a_tools_column(user_tools):
    tools = build_tool_set([], str(user_tools))
    assert tools_for_row({}, tools, "r") == (tools.names(), {})
    row = {"extra_info": {"tools_kwargs": {"lookup": {"create_kwargs": {"dictionary": "fr"}}}}}
    assert tools_for_row(row, tools, "r") == (["lookup"], {"lookup": {"dictionary": "fr"}})
    assert tools_for_row({"tools": '[{"type": "function", "function": {"name": "slow"}}]'}, tools, "r")[0] == ["slow"]
    with pytest.raises(DataError, match="r: tools \\['sql'\\] are not configured"):
        tools_for_row({"tools": ["sql"]}, tools, "r")


# ---------------------------------------------------------------------------------------------- runner


@pytest.fixture
def runner(user_tools):
    runner = ToolRunner(build_tool_set([], str(user_tools)), max_response_chars=64, processes=2)
    yield runner
    runner.shutdown()


def call(text: str):
    return parse_tool_calls(f"<tool_call>{text}</tool_call>").calls[0]


def test_calls_that_work(runner):
    assert runner.run(call('{"name": "calculator", "arguments": {"expression": "37*412"}}')).content == "15244"
    # A user's tool runs in a tool process; hidden per-row arguments reach it, the model never sees them.
    result = runner.run(call('{"name": "lookup", "arguments": {"word": "cat"}}'), hidden_kwargs={"dictionary": "fr"})
    assert result.ok and result.content == '{"word": "cat", "dictionary": "fr", "length": 3}'


@pytest.mark.parametrize(("text", "allowed", "message"), [
    ('{"name": "abacus", "arguments": {}}', None, "unknown tool 'abacus'; available: calculator, lookup, slow"),
    ('{"name": "lookup", "arguments": {"word": "x"}}', ["calculator"], "unknown tool 'lookup'; available: calculator"),
    ("{not json", None, "not valid JSON"),
    ('{"name": "calculator", "arguments": {}}', None, "'expression' is a required property"),
    ('{"name": "calculator", "arguments": {"expression": 7}}', None, "expression: 7 is not of type 'string'"),
    ('{"name": "calculator", "arguments": {"expression": "1", "x": 1}}', None, "Additional properties"),
    ('{"name": "calculator", "arguments": {"expression": "open(1)"}}', None, "not arithmetic on numbers"),
    ('{"name": "broken", "arguments": {"x": 1}}', None, "RuntimeError: the database is down"),
])
def test_every_failure_is_an_error_result_for_the_model(runner, text, allowed, message):
    result = runner.run(call(text), allowed)
    assert not result.ok and message in result.error and result.content.startswith("error: ")


def test_a_tool_that_overruns_is_killed_and_the_next_call_works(runner):
    start = time.monotonic()
    result = runner.run(call('{"name": "slow", "arguments": {"seconds": 30}}'))
    assert not result.ok and "did not answer within 0.5 s" in result.error
    assert time.monotonic() - start < 10
    assert runner.run(call('{"name": "slow", "arguments": {"seconds": 0}}')).content == "done"


def test_a_pure_tool_that_overruns_gets_a_timeout_and_calls_start_no_threads(user_tools, monkeypatch):
    """Pure tools run on the runner's threads; one watchdog settles the calls that overrun (no thread per call:
    starting one made the agent loop wait for a GIL handoff at every call)."""
    tools = build_tool_set([], str(user_tools))
    tools.tools["slow"] = dataclasses.replace(tools.tools["slow"], pure=True, timeout_s=0.3)
    runner = ToolRunner(tools, processes=1, threads=2)
    try:
        start = time.monotonic()
        result = runner.run(call('{"name": "slow", "arguments": {"seconds": 2}}'))
        assert not result.ok and "did not answer within 0.3 s" in result.error
        assert time.monotonic() - start < 1.5
        starts = []
        original = threading.Thread.start
        monkeypatch.setattr(threading.Thread, "start", lambda thread: starts.append(thread) or original(thread))
        futures = [runner.submit(call('{"name": "calculator", "arguments": {"expression": "6*7"}}'))
                   for _ in range(50)]
        assert [f.result(timeout=10).content for f in futures] == ["42"] * 50
        assert len(starts) <= 1  # at most the pool's second thread; none per call
    finally:
        runner.shutdown()


def test_long_results_are_truncated(runner):
    result = runner.run(call('{"name": "calculator", "arguments": {"expression": "12345*67891"}}'))
    assert result.ok and result.content == "838114395"
    long = runner.run(call('{"name": "lookup", "arguments": {"word": "' + "a" * 100 + '"}}'))
    assert long.content.endswith("...(truncated)") and len(long.content) == 64 + len("...(truncated)")


def test_calls_in_flight_together_run_in_separate_tool_processes(runner):
    import os

    futures = [runner.submit(call('{"name": "whoami", "arguments": {"seconds": 1}}')) for _ in range(2)]
    pids = {int(f.result().content) for f in futures}
    assert len(pids) == 2 and os.getpid() not in pids  # concurrent, and never in the trainer's process

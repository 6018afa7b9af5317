"""Run tool calls safely: validate, execute with a timeout, and turn every failure into a message for the model.

``ToolRunner.submit(call, ...)`` returns a ``Future`` of a ``ToolResult`` at once, so the agent loop keeps decoding
the other trajectories while a tool runs. A result always arrives: an unknown tool, a malformed call (invalid
JSON), arguments that do not fit the tool's JSON schema, a timeout, an exception in the tool, or a tool process
that died all become ``ToolResult(content="error: ...", error=...)``, returned to the model as the tool's answer
and counted (``rollout/tool_error_rate``). Nothing a tool does can raise in the rollout.

Pure tools (``Tool.pure``: the calculator) run on a thread of this process; the others in tool processes
(``spawn``ed, so they share nothing with the trainer), one call at a time each. A process that overruns its
call's timeout is killed and replaced; a thread cannot be killed, which is why only bounded pure tools run on one.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import heapq
import itertools
import json
import multiprocessing
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from verl.tools.calls import ToolCall
from verl.tools.registry import Tool, ToolSet, load_function


@dataclass
class ToolResult:
    """What the model sees (``content``) and, when the call failed, why (``error``, also inside ``content``)."""

    content: str
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def failed(message: str) -> ToolResult:
    return ToolResult(f"error: {message}", message)


def as_text(value: Any) -> str:
    """A tool's return value as the text of its answer (JSON for structured values)."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except TypeError:
        return str(value)


class ToolRunner:
    """Validates and runs calls against a ``ToolSet``; results are truncated to ``max_response_chars``."""

    def __init__(self, tool_set: ToolSet, max_response_chars: int = 1024, processes: int = 2, threads: int = 8):
        self.tool_set = tool_set
        self.max_response_chars = max_response_chars
        self._threads = concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="verl-tool")
        self._processes = ToolProcessPool(processes)
        self._functions: dict[str, Any] = {}
        self._deadlines = Deadlines()
        self._validators: dict[str, Any] = {}  # tool name -> its compiled schema validator (building one costs ~1 ms)

    def submit(self, call: ToolCall, allowed: list[str] | None = None, hidden_kwargs: dict[str, Any] | None = None,
               problem: str | None | object = ...) -> concurrent.futures.Future[ToolResult]:
        """Start ``call``; ``allowed`` limits the tools (a row's), ``hidden_kwargs`` are added to its arguments.
        ``problem``: what ``check(call, allowed)`` returned, when the caller already asked (the agent loop does, to
        count valid calls; a schema check is ~50 us of the loop's thread per call)."""
        if problem is ...:
            problem = self.check(call, allowed)
        if problem is not None:
            done: concurrent.futures.Future[ToolResult] = concurrent.futures.Future()
            done.set_result(failed(problem))
            return done
        tool = self.tool_set.tools[call.name]
        kwargs = {**(call.arguments or {}), **(hidden_kwargs or {})}
        if tool.pure:
            return self._submit_inline(tool, kwargs)
        return self._threads.submit(self._run_in_process, tool, kwargs)

    def run(self, call: ToolCall, allowed: list[str] | None = None,
            hidden_kwargs: dict[str, Any] | None = None) -> ToolResult:
        return self.submit(call, allowed, hidden_kwargs).result()

    def shutdown(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        self._processes.shutdown()
        self._deadlines.shutdown()

    # ---------------------------------------------------------------- pieces

    def check(self, call: ToolCall, allowed: list[str] | None = None,
              brought: dict[str, dict[str, Any]] | None = None) -> str | None:
        """Why ``call`` cannot run (malformed, an unknown or not allowed tool, arguments outside the tool's JSON
        schema), or None for a valid call. ``brought``: schemas of the tools a row's environment brings, by name
        (an ``env:`` class's methods), which its calls may name too."""
        if call.error is not None:
            return call.error
        names = allowed if allowed is not None else self.tool_set.names()
        if brought and call.name in brought:
            parameters = brought[call.name]["function"].get("parameters") or {"type": "object", "properties": {}}
            key = json.dumps(parameters, sort_keys=True)  # two classes may name different tools alike
        else:
            tool = self.tool_set.tools.get(call.name)
            if tool is None or call.name not in names:
                available = [*names, *(brought or {})]
                return f"unknown tool '{call.name}'; available: {', '.join(available) or 'none'}"
            parameters, key = tool.parameters, tool.name
        validator = self._validators.get(key)
        if validator is None:
            from jsonschema import Draft202012Validator  # noqa: PLC0415  (only when tools run)

            validator = self._validators[key] = Draft202012Validator(parameters)
        problems = sorted(validator.iter_errors(call.arguments), key=lambda e: e.path)
        if problems:
            where = "/".join(str(p) for p in problems[0].path) or "arguments"
            return f"arguments of '{call.name}' do not fit its schema ({where}: {problems[0].message})"
        return None

    def _submit_inline(self, tool: Tool, kwargs: dict[str, Any]) -> concurrent.futures.Future[ToolResult]:
        """A pure tool on a pool thread; its result, or a timeout error when it overruns (the call itself cannot be
        stopped, which is why only bounded pure tools run here)."""
        function = self._functions.get(tool.target)
        if function is None:
            function = self._functions[tool.target] = load_function(tool.target)
        result: concurrent.futures.Future[ToolResult] = concurrent.futures.Future()

        def settle(value: ToolResult) -> None:
            with contextlib.suppress(concurrent.futures.InvalidStateError):  # the timeout or the answer came first
                result.set_result(value)

        def finished(call: concurrent.futures.Future) -> None:
            self._deadlines.cancel(deadline)
            error = call.exception()
            settle(failed(f"'{tool.name}' failed: {error}") if error is not None else self.answer(call.result()))

        deadline = self._deadlines.add(
            tool.timeout_s, lambda: settle(failed(f"'{tool.name}' did not answer within {tool.timeout_s:g} s")))
        # The tool runs in the caller's context: its log.info() lands in the run's rows (verl.utils.log).
        self._threads.submit(contextvars.copy_context().run, function, **kwargs).add_done_callback(finished)
        return result

    def _run_in_process(self, tool: Tool, kwargs: dict[str, Any]) -> ToolResult:
        status, value = self._processes.call(tool.target, kwargs, tool.timeout_s)
        if status == "ok":
            return self.answer(value)
        if status == "timeout":
            return failed(f"'{tool.name}' did not answer within {tool.timeout_s:g} s")
        return failed(f"'{tool.name}' failed: {value}")

    def answer(self, value: Any) -> ToolResult:
        """A tool's return value as its answer, truncated to ``max_response_chars``."""
        text = as_text(value)
        if len(text) > self.max_response_chars:
            text = text[: self.max_response_chars] + "...(truncated)"
        return ToolResult(text)


class Deadlines:
    """Actions due at deadlines, run by one watchdog thread (started on first use): the timeouts of calls on tool
    threads. A ``threading.Timer`` per call started a thread per call, and ``Thread.start`` waits until the new
    thread runs: a GIL handoff the agent loop sat in at every tool call (with a 200 ms tool, a rollout's 496 calls
    cost 0.21 s over an instant tool's; with this watchdog nothing measurable, ``benchmarks/agent_rollout.py``).
    Entries are ``[deadline, order, action]``; ``cancel`` clears the action, and the watchdog drops cleared entries
    when they reach the top of its heap."""

    def __init__(self) -> None:
        self._heap: list[list[Any]] = []
        self._order = itertools.count()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def add(self, seconds: float, action: Callable[[], None]) -> list[Any]:
        """Run ``action`` in ``seconds`` unless ``cancel``ed first; returns the entry to cancel."""
        entry = [time.monotonic() + seconds, next(self._order), action]
        with self._cv:
            heapq.heappush(self._heap, entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="verl-tool-deadlines", daemon=True)
                self._thread.start()
            elif self._heap[0] is entry:  # earlier than what the watchdog sleeps toward (with equal timeouts: never)
                self._cv.notify()
        return entry

    @staticmethod
    def cancel(entry: list[Any]) -> None:
        entry[2] = None

    def shutdown(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()

    def _watch(self) -> None:
        while True:
            due = []
            with self._cv:
                while not self._stopped:
                    now = time.monotonic()
                    while self._heap and (self._heap[0][2] is None or self._heap[0][0] <= now):
                        action = heapq.heappop(self._heap)[2]
                        if action is not None:
                            due.append(action)
                    if due:
                        break
                    self._cv.wait(self._heap[0][0] - now if self._heap else None)
                if self._stopped:
                    return
            for action in due:  # outside the lock: an action may take its time
                action()


# ---------------------------------------------------------------------------------------------- tool processes


def _tool_process_main(conn) -> None:
    """A tool process: receive (target, kwargs), answer ("ok", value) or ("error", message), until told to stop."""
    functions: dict[str, Any] = {}
    conn.send(("ready", None))  # started: a call's timeout counts from here, not from the spawn
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        target, kwargs = message
        try:
            function = functions.get(target) or functions.setdefault(target, load_function(target))
            value = function(**kwargs)
            try:
                conn.send(("ok", value))
            except Exception:  # a value that does not pickle goes back as text
                conn.send(("ok", as_text(value)))
        except BaseException as exc:  # noqa: BLE001
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


START_TIMEOUT_S = 60.0  # the longest a new tool process may take to start (spawn, imports) before its first call


class ToolProcessPool:
    """Up to ``size`` spawned tool processes, started on first use; one call at a time per process."""

    def __init__(self, size: int):
        self._context = multiprocessing.get_context("spawn")
        self._idle: list[tuple[Any, Any]] = []  # (process, connection)
        self._slots = threading.BoundedSemaphore(max(1, size))
        self._lock = threading.Lock()
        self._closed = False

    def call(self, target: str, kwargs: dict[str, Any], timeout: float) -> tuple[str, Any]:
        with self._slots:
            try:
                process, conn = self._take()
            except OSError as exc:
                return "error", str(exc)
            try:
                conn.send((target, kwargs))
                if not conn.poll(timeout):
                    self._kill(process)
                    return "timeout", None
                status, value = conn.recv()
            except (EOFError, OSError, BrokenPipeError) as exc:
                self._kill(process)
                return "error", f"the tool process died ({exc!r})"
            self._give_back(process, conn)
            return status, value

    def _take(self) -> tuple[Any, Any]:
        with self._lock:
            while self._idle:
                process, conn = self._idle.pop()
                if process.is_alive():
                    return process, conn
        parent, child = self._context.Pipe()
        process = self._context.Process(target=_tool_process_main, args=(child,), daemon=True, name="verl-tool-process")
        process.start()
        child.close()
        try:  # a busy machine can take seconds to spawn a Python process: a call's timeout starts after
            ready = parent.poll(START_TIMEOUT_S) and parent.recv()
        except (EOFError, OSError):  # it died on the way
            ready = None
        if not ready:
            self._kill(process)
            raise OSError(f"a tool process did not start (it died, or took over {START_TIMEOUT_S:g} s)")
        return process, parent

    def _give_back(self, process: Any, conn: Any) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append((process, conn))
                return
        self._kill(process)

    @staticmethod
    def _kill(process: Any) -> None:
        process.kill()
        process.join(5)

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for process, conn in idle:
            with contextlib.suppress(OSError):
                conn.send(None)
            process.join(2)
            if process.is_alive():
                self._kill(process)

"""``Sandbox``: runs one program under ``isolation.py``'s mechanism and answers in SandboxFusion's shape.

The request and response are SandboxFusion's ``POST /run_code`` bodies (``RunCodeRequest`` / ``RunCodeResponse``),
so the in-process sandbox, ``verl sandbox serve`` and a real SandboxFusion deployment are interchangeable for the
code reward. Statuses mean what they mean there: ``Success`` (ran, exit code 0), ``Failed`` (ran, but non-zero exit,
a limit hit or a time-out: ``run_result.status`` says ``Finished`` or ``TimeLimitExceeded``) and ``SandboxError``
(not run: a language we do not run, a bad file name). ``message`` says which limit stopped a run.
"""

from __future__ import annotations

import base64
import contextlib
import math
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path, PurePosixPath
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from verl.errors import VerlError
from verl.sandbox.isolation import (
    BUBBLEWRAP,
    WORKDIR,
    Limits,
    PidsCgroup,
    bwrap_argv,
    interpreter,
    mechanism,
    probe_failure,
    process_limit_holds,
    start,
)
from verl.utils.log import say_once

RunStatus = Literal["Success", "Failed", "SandboxError"]
CommandStatus = Literal["Finished", "Error", "TimeLimitExceeded"]


class RunCodeRequest(BaseModel):
    """SandboxFusion's request. ``memory_limit_MB`` -1 and ``run_timeout`` None mean the server's limits."""

    model_config = ConfigDict(extra="forbid")
    code: str
    language: str = "python"
    compile_timeout: float = 10.0  # accepted for compatibility: nothing we run is compiled
    run_timeout: float | None = Field(None, gt=0)
    memory_limit_MB: int = -1  # noqa: N815 - SandboxFusion's field name
    stdin: str | None = None
    files: dict[str, str] = Field(default_factory=dict, description="name -> base64 content, in the working dir")
    fetch_files: list[str] = Field(default_factory=list)


class CommandRunResult(BaseModel):
    status: CommandStatus
    execution_time: float | None = None
    return_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None


class RunCodeResponse(BaseModel):
    status: RunStatus
    message: str = ""
    compile_result: CommandRunResult | None = None
    run_result: CommandRunResult | None = None
    files: dict[str, str] = Field(default_factory=dict)


class SandboxUnavailable(VerlError):
    """Real isolation was required (``require_isolation``) and this machine cannot give it."""


def _python() -> list[str]:
    return [interpreter(), "-I", "main.py"]


def _bash() -> list[str]:
    return [shutil.which("bash") or "/bin/bash", "main.sh"]


# language -> (file the code is written to, the command that runs it in the working directory)
LANGUAGES = {"python": ("main.py", _python), "python3": ("main.py", _python), "bash": ("main.sh", _bash)}

_SIGNAL_LIMITS = {signal.SIGXCPU: "CPU time limit", signal.SIGXFSZ: "output limit"}


def sandbox_error(message: str) -> RunCodeResponse:
    return RunCodeResponse(status="SandboxError", message=message)


def _file_name(name: str) -> PurePosixPath | None:
    path = PurePosixPath(name)
    if path.is_absolute() or not path.parts or ".." in path.parts:
        return None
    return path


class Sandbox:
    """Runs programs, at most ``max_concurrent`` at once (each in namespaces of its own: runs cannot see each
    other). ``limits`` are the defaults a request's ``run_timeout`` / ``memory_limit_MB`` override.

    Without bubblewrap it runs with resource limits only, after a loud warning; ``require_isolation=True`` refuses
    instead (``SandboxUnavailable``).
    """

    def __init__(self, limits: Limits | None = None, max_concurrent: int = 4, require_isolation: bool = False):
        self.limits = limits or Limits()
        self.max_concurrent = max_concurrent
        self._slots = threading.BoundedSemaphore(max_concurrent)
        self.mechanism = mechanism()
        if self.mechanism != BUBBLEWRAP:
            why = probe_failure()
            if require_isolation:
                raise SandboxUnavailable(f"the code sandbox needs bubblewrap: {why}; install it "
                                         "(Debian/Ubuntu: apt-get install bubblewrap)")
            say_once(f"{why}: untrusted code runs with resource limits only (no namespaces: it can read your files "
                     "and use the network); install bubblewrap (apt-get install bubblewrap)", label="WARNING")
        elif not process_limit_holds():
            say_once("running as root without a writable pids cgroup: a sandboxed program's process count is not "
                     "limited (RLIMIT_NPROC does not bind root)", label="WARNING")

    def run(self, request: RunCodeRequest) -> RunCodeResponse:
        with self._slots:
            return self._run(request)

    def _limits_for(self, request: RunCodeRequest) -> Limits:
        limits = self.limits
        if request.run_timeout is not None:
            limits = replace(limits, wall_seconds=request.run_timeout, cpu_seconds=math.ceil(request.run_timeout))
        if request.memory_limit_MB > 0:
            limits = replace(limits, memory_mb=request.memory_limit_MB)
        return limits

    def _run(self, request: RunCodeRequest) -> RunCodeResponse:
        if request.language not in LANGUAGES:
            return sandbox_error(f"language '{request.language}' is not run here (this sandbox runs "
                                 f"{', '.join(sorted(LANGUAGES))})")
        if request.fetch_files:
            return sandbox_error("fetch_files is not supported by this sandbox (the working directory is a tmpfs "
                                 "that ends with the run); print what you need to stdout")
        main, command = LANGUAGES[request.language]
        files: dict[PurePosixPath, bytes] = {PurePosixPath(main): request.code.encode()}
        for name, content in request.files.items():
            path = _file_name(name)
            if path is None:
                return sandbox_error(f"files: '{name}' must be a relative path inside the working directory")
            try:
                files[path] = base64.b64decode(content, validate=True)
            except ValueError:
                return sandbox_error(f"files: '{name}' is not base64")
        limits = self._limits_for(request)
        with tempfile.TemporaryDirectory(prefix="verl-sandbox-") as tmp:
            return self._execute(Path(tmp), files, request.stdin or "", command(), limits)

    def _execute(self, tmp: Path, files: dict[PurePosixPath, bytes], stdin: str, program: list[str],
                 limits: Limits) -> RunCodeResponse:
        staged = tmp / "files"
        for path, content in files.items():
            (staged / path).parent.mkdir(parents=True, exist_ok=True)
            (staged / path).write_bytes(content)
        (tmp / "stdin").write_text(stdin)
        launch = limits.launch(program)
        opened: list[int] = []
        cgroup = None
        if self.mechanism == BUBBLEWRAP:
            argv = bwrap_argv(limits)
            for path in files:
                for parent in reversed(path.parents[:-1]):
                    argv += ["--dir", f"{WORKDIR}/{parent}"]
                fd = os.open(staged / path, os.O_RDONLY)
                opened.append(fd)
                argv += ["--file", str(fd), f"{WORKDIR}/{path}"]
            argv += ["--", *launch]
            cgroup = PidsCgroup.create(f"verl-sandbox-{os.getpid()}-{uuid.uuid4().hex[:8]}", limits.processes)
        with open(tmp / "stdin", "rb") as fin, open(tmp / "stdout", "wb") as fout, open(tmp / "stderr", "wb") as ferr:
            started = time.monotonic()
            try:
                if self.mechanism == BUBBLEWRAP:
                    proc = start(argv, cgroup, stdin=fin, stdout=fout, stderr=ferr, env={}, pass_fds=tuple(opened))
                else:
                    proc = subprocess.Popen(launch, stdin=fin, stdout=fout, stderr=ferr, cwd=staged,
                                            start_new_session=True, env={
                                                "PATH": "/usr/bin:/bin", "HOME": str(staged), "LANG": "C.UTF-8",
                                                "PYTHONDONTWRITEBYTECODE": "1"})
            except (OSError, subprocess.SubprocessError) as exc:
                return sandbox_error(f"could not start the sandbox: {exc}")
            finally:
                for fd in opened:
                    os.close(fd)
            # A timer kills the session at the wall limit; the wait blocks in waitpid (Popen.wait(timeout) polls
            # with sleeps of up to 50 ms, which was most of a trivial run's time).
            expired = threading.Event()
            timer = threading.Timer(limits.wall_seconds, lambda: (expired.set(), _kill_session(proc, wait=False)))
            timer.start()
            try:
                proc.wait()
            finally:
                timer.cancel()
                _kill_session(proc)
                if cgroup is not None:
                    cgroup.kill_all()
            timed_out = expired.is_set()
            elapsed = time.monotonic() - started
        return self._response(tmp, proc.returncode, timed_out, elapsed, limits)

    def _response(self, tmp: Path, code: int, timed_out: bool, elapsed: float, limits: Limits) -> RunCodeResponse:
        if self.mechanism == BUBBLEWRAP and code > 128:
            code = 128 - code  # bwrap reports a signal as 128 + its number; subprocess's convention is -number
        stdout, out_over = _read_capped(tmp / "stdout", limits.output_bytes)
        stderr, err_over = _read_capped(tmp / "stderr", limits.output_bytes)
        reasons = []
        if timed_out:
            reasons.append(f"wall time limit of {limits.wall_seconds:g} s")
        if code < 0 and -code in _SIGNAL_LIMITS:
            reasons.append(_SIGNAL_LIMITS[-code])
        elif code == -signal.SIGKILL and not timed_out:  # RLIMIT_CPU's hard limit, after a SIGXCPU it ignored
            reasons.append("CPU time limit (killed at the hard limit)")
        if out_over or err_over:
            reasons.append(f"output limit of {limits.output_bytes} bytes (output cut there)")
        if "MemoryError" in stderr[-2000:]:
            reasons.append(f"memory limit of {limits.memory_mb} MB")
        out_of_time = timed_out or code in (-signal.SIGXCPU, -signal.SIGKILL)
        status: CommandStatus = "TimeLimitExceeded" if out_of_time else "Finished"
        ok = status == "Finished" and code == 0 and not (out_over or err_over)
        result = CommandRunResult(status=status, execution_time=round(elapsed, 4),
                                  return_code=None if timed_out else code, stdout=stdout, stderr=stderr)
        message = "exceeded: " + "; ".join(dict.fromkeys(reasons)) if reasons else ""
        return RunCodeResponse(status="Success" if ok else "Failed", message=message, run_result=result)


def _kill_session(proc: subprocess.Popen, wait: bool = True) -> None:
    """SIGKILL the run's session (bwrap, or the program and what it started in rlimits mode)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    if wait:
        proc.wait()


def _read_capped(path: Path, limit: int) -> tuple[str, bool]:
    """The first ``limit`` bytes of ``path`` as text, and whether the program wrote more."""
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    return data[:limit].decode("utf-8", errors="replace"), len(data) > limit

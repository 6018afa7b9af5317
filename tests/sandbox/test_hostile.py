"""Hostile programs in the sandbox: each is contained, with its status, and the host is unaffected.

After every case the host is checked: a canary process the test started (whose pid the program is given) is alive,
no process of the run is left (the host's /proc holds no ``main.py`` of ours), host files the program tried to
write do not exist and those it tried to read are not in its output, the test process's secret environment variable
is nowhere in the output, and a trivial program still runs. Marked serial: fork bombs and memory hogs want the box
to themselves (their limits hold either way; a neighbour's timings would not).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO
from verl.sandbox import Limits, RunCodeRequest, Sandbox

pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.usefixtures("bubblewrap")]

SECRET = "verl-sandbox-canary-secret-7f3a"  # in the test process's environment, never the program's
HOST_FILE = REPO / "SANDBOX_ESCAPED.txt"  # what a program that can write the host's files would create


@dataclass
class Case:
    code: str
    status: str = "Failed"  # the expected top-level status
    run_status: str = "Finished"
    message: str = ""  # a substring of the message ("" when none is expected)
    output: str = ""  # a substring of stdout + stderr
    absent: tuple[str, ...] = ()  # what must not appear in stdout + stderr


CASES: dict[str, Case] = {
    # time
    "infinite loop": Case("while True:\n    pass", run_status="TimeLimitExceeded"),  # the CPU or the wall limit
    "ignores SIGXCPU": Case("import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass",
                            run_status="TimeLimitExceeded"),
    "sleep past the wall limit": Case("import time\ntime.sleep(600)", run_status="TimeLimitExceeded",
                                      message="wall time limit of 2 s"),
    "busy threads": Case("import threading\ndef spin():\n    while True: pass\n"
                         "for _ in range(8): threading.Thread(target=spin).start()\nspin()",
                         run_status="TimeLimitExceeded"),
    "ignores SIGTERM": Case("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(600)",
                            run_status="TimeLimitExceeded"),
    # processes
    "fork bomb": Case("import os\nwhile True:\n    os.fork()", output="BlockingIOError"),
    "subprocess bomb": Case("import subprocess, sys\nps = [subprocess.Popen([sys.executable, '-c', "
                            "'import time; time.sleep(600)']) for _ in range(500)]", output="BlockingIOError"),
    "thread bomb": Case("import threading, time\nfor _ in range(10000):\n"
                        "    threading.Thread(target=time.sleep, args=(600,)).start()", run_status="TimeLimitExceeded",
                        output="can't start new thread"),  # its first threads sleep on: the wall limit ends it
    "daemon outlives the run": Case("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
                                    "        time.sleep(600)\n    os._exit(0)\nprint('parent done')",
                                    status="Success", output="parent done"),
    "kills its parent": Case("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint('still here')",
                             status="Success", output="still here"),
    "kills every process it can": Case("import os, signal\ntry:\n    os.kill(-1, signal.SIGKILL)\n"
                                       "except ProcessLookupError:\n    pass\nprint('done')", status="Success",
                                       output="done"),  # all it can see is its own namespace
    "kills the host canary": Case("import os, signal\nos.kill(int(input()), signal.SIGKILL)",
                                  output="ProcessLookupError"),
    "sees the host's processes": Case("import os\npids = [p for p in os.listdir('/proc') if p.isdigit()]\n"
                                      "print(len(pids))\nassert len(pids) <= 3, pids", status="Success"),
    # memory
    "100 GB allocation": Case("x = bytearray(100 * 1024**3)", message="memory limit", output="MemoryError"),
    "growing list": Case("xs = []\nwhile True:\n    xs.append(bytearray(10 * 1024**2))", message="memory limit"),
    "huge mmap": Case("import mmap\nm = mmap.mmap(-1, 64 * 1024**3)", output="Cannot allocate memory"),
    # files
    "writes /usr": Case("open('/usr/evil', 'w').write('x')", output="Read-only file system"),
    "writes the interpreter": Case(f"open({sys.base_prefix + '/evil'!r}, 'w').write('x')",
                                   output="Read-only file system"),
    "writes the project's files": Case(f"import os\nos.makedirs({str(REPO)!r}, exist_ok=True)\n"
                                       f"open({str(HOST_FILE)!r}, 'w').write('x')\nprint('wrote')",
                                       status="Success", output="wrote"),  # into its own tmpfs root, not the host
    "reads /etc/shadow": Case("print(open('/etc/shadow').read())", output="No such file or directory"),
    "reads the project's files": Case(f"print(open({str(REPO / 'README.md')!r}).read())",
                                      output="No such file or directory", absent=("verl suite",)),
    "reads a home directory": Case("import os\nprint(os.listdir('/root'), os.listdir('/home'))",
                                   output="No such file or directory", absent=(".bashrc", ".cache", ".ssh")),
    "reads the host's environment": Case("import os\nprint(dict(os.environ))\nprint(open('/proc/1/environ').read())",
                                         status="Success", absent=(SECRET,)),
    "fills the workspace": Case("with open('fill', 'wb') as f:\n    while True:\n        f.write(b'x' * 2**20)",
                                output="Errno"),
    "fills /tmp with files": Case("i = 0\nwhile True:\n    open(f'/tmp/f{i}', 'wb').write(b'x' * 2**20)\n    i += 1",
                                  output="Errno"),
    "raw devices": Case("print(open('/dev/sda', 'rb').read(1))", output="No such file or directory"),
    "sets a host sysctl": Case("with open('/proc/sys/vm/swappiness', 'w') as f:\n    f.write('1')",
                               output="Permission denied"),
    "sets the core pattern": Case("with open('/proc/sys/kernel/core_pattern', 'w') as f:\n    f.write('|/bin/sh')",
                                  output="Permission denied"),  # as the host's root, code run on a crash
    # output
    "prints 1 GB": Case("import sys\nchunk = 'x' * 2**20\nfor _ in range(1024):\n    sys.stdout.write(chunk)",
                        message="output limit of 65536 bytes"),
    "floods stderr": Case("import sys\nwhile True:\n    sys.stderr.write('e' * 65536)", message="output limit"),
    # network
    "connects to the host's server": Case("import socket, sys\nsocket.create_connection(('127.0.0.1', int(input())), "
                                          "timeout=2)", output="Errno"),
    "resolves a name": Case("import socket\nsocket.create_connection(('pypi.org', 443), timeout=2)",
                            output="name resolution"),
    "connects out by address": Case("import socket\nsocket.create_connection(('1.1.1.1', 443), timeout=2)",
                                    output="Network is unreachable"),
    "listens on a port": Case("import socket\ns = socket.socket()\ns.bind(('0.0.0.0', 8765))\ns.listen()\n"
                              "print('listening')", status="Success", output="listening"),  # in its own netns
    # privileges
    "becomes root": Case("import os\nos.setuid(0)", output="Invalid argument"),  # no uid 0 in its namespace
    "keeps a capability": Case("caps = [l for l in open('/proc/self/status') if l.startswith('CapEff')]\n"
                               "assert caps == ['CapEff:\\t0000000000000000\\n'], caps\nprint('none')",
                               status="Success", output="none"),
    "raises its limits": Case("import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))",
                              output="ValueError"),
    "mounts a file system": Case("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                                 "assert libc.mount(b'none', b'/tmp', b'tmpfs', 0, None) != 0\n"
                                 "print('mount refused', ctypes.get_errno())", status="Success",
                                 output="mount refused"),
    "reboots the machine": Case("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                                "assert libc.reboot(0x4321FEDC) != 0\nprint('reboot refused')", status="Success",
                                output="reboot refused"),
    "chroot escape": Case("import os\nos.mkdir('jail')\nos.chroot('jail')", output="PermissionError"),
}


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return Sandbox(Limits(wall_seconds=2, cpu_seconds=2, memory_mb=256, processes=32, output_bytes=65536,
                          workspace_mb=16), max_concurrent=2, require_isolation=True)


@pytest.fixture(scope="module")
def host():
    """A canary process and a listening server on the host, and the secret in this process's environment."""
    canary = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    server = socket.create_server(("127.0.0.1", 0))
    os.environ["VERL_SANDBOX_SECRET"] = SECRET
    yield canary, server
    os.environ.pop("VERL_SANDBOX_SECRET", None)
    server.close()
    canary.kill()


def leftovers() -> list[int]:
    """Host processes still running a sandboxed program (``python -I main.py``) or the launcher."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"main.py" in argv and b"-I" in argv:
                found.append(int(entry.name))
    return found


@pytest.mark.budget(3)  # each case: most take 0.1 s, the time-outs 2 s
@pytest.mark.parametrize("name", list(CASES))
def test_hostile_program_is_contained(sandbox, host, name):
    canary, server = host
    case = CASES[name]
    port = server.getsockname()[1]
    stdin = str(port if "server" in name else canary.pid)
    reply = sandbox.run(RunCodeRequest(code=case.code, stdin=stdin + "\n"))
    result = reply.run_result
    text = (result.stdout or "") + (result.stderr or "")
    assert (reply.status, result.status) == (case.status, case.run_status), (reply.message, text[-1500:])
    assert case.message in reply.message, reply.message
    assert case.output in text, text[-1500:]
    for absent in (*case.absent, SECRET):
        assert absent not in text
    # the host, unaffected
    assert canary.poll() is None, "the canary was killed"
    assert leftovers() == [], "a process of the run outlived it"
    assert not HOST_FILE.exists() and not Path("/usr/evil").exists()
    assert not Path(sys.base_prefix, "evil").exists()
    again = sandbox.run(RunCodeRequest(code="print('ok')"))
    assert (again.status, again.run_result.stdout) == ("Success", "ok\n")


@pytest.mark.budget(10)
def test_concurrent_runs_cannot_see_each_other(sandbox):
    """One run writes a file in /tmp and its working directory and waits; the other, at the same time, finds
    neither, and sees no process but its own namespace's."""
    first = {}
    holder = threading.Thread(target=lambda: first.update(reply=sandbox.run(RunCodeRequest(
        code="import time\nopen('/tmp/mine', 'w').write('1')\nopen('mine', 'w').write('1')\ntime.sleep(1.5)\n"
             "print('held')"))))
    holder.start()
    try:
        import time

        time.sleep(0.5)
        looker = sandbox.run(RunCodeRequest(
            code="import os\nprint(sorted(os.listdir('/tmp')), sorted(os.listdir('.')))\n"
                 "print(sorted(p for p in os.listdir('/proc') if p.isdigit()))"))
    finally:
        holder.join()
    assert first["reply"].run_result.stdout == "held\n"
    tmp_listing, proc_listing = looker.run_result.stdout.splitlines()
    assert tmp_listing == "[] ['main.py']"
    assert len(eval(proc_listing)) <= 3  # its bwrap init, the program (and the listing's own /proc/self)

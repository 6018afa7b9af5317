"""How an untrusted program is isolated: bubblewrap namespaces, a pids cgroup, resource limits set inside.

The mechanism (``mechanism()``), strongest first:

- **bubblewrap** (Debian's ``bubblewrap``): new user, pid, network, IPC, UTS and cgroup namespaces, so the program
  sees no other process (not the host's, not a concurrent run's), has no network (a loopback that is down) and
  cannot signal anything outside; a file system of its own: the interpreter's prefix and ``/usr`` read-only, a
  size-capped tmpfs as its working directory and ``/tmp``, a fresh ``/proc`` and a minimal ``/dev`` — no ``/etc``,
  no home, no project files. When the program exits, the namespace's init exits and the kernel kills whatever it
  left running (a daemon does not outlive the run).
- **rlimits only** (no bubblewrap on the machine): a new session, a private temporary directory, a cleared
  environment and the same limits; no namespaces, so the program can read what the user can and use the network.
  It is announced loudly, and ``verl check-env`` says how to install bubblewrap.

The program never runs as the host's root. A non-root user starts bwrap as itself (unprivileged user namespaces).
Root starts it as ``nobody`` (``SANDBOX_HOST_UID``): the child first makes a private mount namespace in which the
interpreter's prefix is bound at a directory nobody can reach (a prefix under ``/root``, mode 0700, is not), then
drops its groups and uids and execs bwrap (``start``). Mapped to the host's root instead, a program's writes to
``/proc/sys`` (``kernel.core_pattern``: code run as root) and root's keyring would be open to it.

Limits are set by a launcher that runs inside the sandbox and then execs the program (``Limits.launch``: util-linux's
``prlimit``, else a few lines of Python): CPU seconds
(``RLIMIT_CPU``), address space (``RLIMIT_AS``: a 100 GB allocation fails with ``MemoryError``), file size
(``RLIMIT_FSIZE``: stdout and stderr are files, so printing 1 GB stops at the output limit) and processes
(``RLIMIT_NPROC``). Setting them after the user namespace exists matters: the kernel counts a user's processes per
user namespace, so the count starts at zero for each run, not at the user's total. Root is exempt from
``RLIMIT_NPROC`` (inside a user namespace too); as root, each run also gets a pids cgroup of its own
(``PidsCgroup``), which counts every process of the run, whoever it claims to be. Wall time is the caller's timer
(``runner.py``): the whole session is killed when it runs out.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BUBBLEWRAP = "bubblewrap"
RLIMITS = "rlimits"
WORKDIR = "/workspace"  # the program's working directory inside the sandbox (a tmpfs)
SANDBOX_UID = 65534  # "nobody", as the program sees itself
SANDBOX_HOST_UID = 65534  # who runs bwrap (and the program) on the host when this process is root

# Without util-linux's prlimit: runs inside the sandbox as `python -I -c LAUNCHER cpu_s as_bytes fsize_bytes nproc
# program args...`, sets the limits on itself, then execs the program, which inherits them (a second interpreter
# start per run: prlimit's exec costs a fraction of that).
LAUNCHER = (
    "import os, resource, sys\n"
    "cpu, mem, fsize, nproc = (int(v) for v in sys.argv[1:5])\n"
    "resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))\n"
    "resource.setrlimit(resource.RLIMIT_AS, (mem, mem))\n"
    "resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))\n"
    "resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))\n"
    "resource.setrlimit(resource.RLIMIT_CORE, (0, 0))\n"
    "os.execv(sys.argv[5], sys.argv[5:])\n"
)
PRLIMIT = shutil.which("prlimit", path="/usr/bin:/bin")  # under /usr: the sandbox mounts it


@dataclass(frozen=True)
class Limits:
    """What one run may use. ``output_bytes`` caps stdout and stderr each; ``workspace_mb`` the tmpfs holding the
    working directory (and, separately, ``/tmp``)."""

    wall_seconds: float = 10.0
    cpu_seconds: int = 10
    memory_mb: int = 1024
    processes: int = 64
    output_bytes: int = 1 << 20
    workspace_mb: int = 64

    def launch(self, program: list[str]) -> list[str]:
        """``program`` behind the command that sets these limits on it (prlimit, else ``LAUNCHER``)."""
        cpu, memory = max(1, self.cpu_seconds), self.memory_mb << 20
        fsize = self.output_bytes + 1  # a program that writes exactly the limit is not cut; one byte more is
        if PRLIMIT:
            return [PRLIMIT, f"--cpu={cpu}:{cpu + 1}", f"--as={memory}", f"--fsize={fsize}",
                    f"--nproc={self.processes}", "--core=0", "--", *program]
        return [interpreter(), "-I", "-c", LAUNCHER, str(cpu), str(memory), str(fsize), str(self.processes), *program]


def interpreter() -> str:
    """The base interpreter (not a venv's): its prefix is what the sandbox mounts."""
    for name in (f"python{sys.version_info.major}.{sys.version_info.minor}", "python3"):
        path = Path(sys.base_prefix) / "bin" / name
        if path.exists():
            return str(path)
    return sys.executable


def mechanism() -> str:
    """``bubblewrap`` when ``bwrap`` is installed and a probe run works here (user namespaces allowed), else
    ``rlimits``."""
    return RLIMITS if probe_failure() else BUBBLEWRAP


@functools.cache
def probe_failure() -> str:
    """Why bubblewrap cannot be used here ('' when it can): probed once per process, for ``mechanism``, the
    warning and ``verl check-env``."""
    if shutil.which("bwrap") is None:
        return "bubblewrap is not installed"
    try:
        probe = start(bwrap_argv(Limits(), workspace_mb=1) + [interpreter(), "-I", "-c", "print(1)"],
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = probe.communicate(timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"bwrap cannot start a sandbox here: {exc}"
    if probe.returncode == 0 and out.strip() == "1":
        return ""
    return f"bwrap cannot start a sandbox here: {err.strip()[:200]}"


def _read_only_system() -> list[str]:
    """Read-only mounts for the interpreter and the shared libraries it loads; merged-/usr systems get links."""
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "lib", "lib64", "sbin"):
        path = Path("/") / name
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            args += ["--ro-bind", str(path), str(path)]
    prefix = str(Path(sys.base_prefix).resolve())
    if not prefix.startswith("/usr/"):  # as root, bwrap (run as nobody) finds it where `start` bound it
        args += ["--ro-bind", str(_prefix_stage()) if os.geteuid() == 0 else prefix, prefix]
    return args


@functools.cache
def _prefix_stage() -> Path:
    """An empty directory anyone may enter, on which a root process's children bind the interpreter's prefix in
    their own mount namespace (made once per process, removed at its exit)."""
    stage = Path(tempfile.mkdtemp(prefix="verl-sandbox-prefix-"))
    stage.chmod(0o755)
    atexit.register(lambda: stage.rmdir() if stage.exists() else None)
    return stage


_CLONE_NEWNS, _MS_BIND, _MS_REC, _MS_PRIVATE = 0x00020000, 4096, 16384, 1 << 18


def _drop_root(cgroup: PidsCgroup | None) -> None:
    """In the child, before it execs bwrap (this process is root): join the run's cgroup, bind the interpreter's
    prefix where nobody can reach it in a mount namespace of the child's own, become nobody."""
    if cgroup is not None:
        cgroup.join()
    libc = ctypes.CDLL(None, use_errno=True)
    prefix = str(Path(sys.base_prefix).resolve()).encode()
    for call, args in (("unshare", (_CLONE_NEWNS,)), ("mount", (None, b"/", None, _MS_REC | _MS_PRIVATE, None)),
                       ("mount", (prefix, str(_prefix_stage()).encode(), None, _MS_BIND | _MS_REC, None))):
        if getattr(libc, call)(*args) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"{call}: {os.strerror(errno)}")
    os.setgroups([])
    os.setgid(SANDBOX_HOST_UID)
    os.setuid(SANDBOX_HOST_UID)


def start(argv: list[str], cgroup: PidsCgroup | None = None, **popen: Any) -> subprocess.Popen:
    """Start ``bwrap_argv(...) + program`` in a session of its own: as this user, or, from root, as nobody
    (``_drop_root``). ``popen``: Popen's other arguments (files, pass_fds)."""
    if os.geteuid() == 0:
        _prefix_stage()  # made here, not in the child (functools.cache is not for forked children)
        preexec = functools.partial(_drop_root, cgroup)
    else:
        preexec = cgroup.join if cgroup is not None else None
    return subprocess.Popen(argv, start_new_session=True, preexec_fn=preexec, cwd="/", **popen)


def bwrap_argv(limits: Limits, workspace_mb: int | None = None) -> list[str]:
    """The ``bwrap`` command line, up to the program: namespaces, mounts, environment. Files are added after it."""
    size = str((workspace_mb or limits.workspace_mb) << 20)
    return ["bwrap", "--unshare-all", "--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID),
            "--die-with-parent", "--new-session", "--cap-drop", "ALL",
            *_read_only_system(), "--proc", "/proc", "--dev", "/dev",
            "--size", size, "--tmpfs", "/tmp", "--size", size, "--tmpfs", WORKDIR, "--chdir", WORKDIR,
            "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", WORKDIR,
            "--setenv", "LANG", "C.UTF-8", "--setenv", "PYTHONDONTWRITEBYTECODE", "1"]


class PidsCgroup:
    """A pids cgroup for one run (cgroup v2 or v1's pids hierarchy), when this process may create one: the
    process-count limit that holds for root, whom ``RLIMIT_NPROC`` does not stop. ``create`` returns None where
    no writable pids hierarchy exists (then the run is limited by ``RLIMIT_NPROC`` only)."""

    def __init__(self, path: Path):
        self.path = path

    @staticmethod
    def _parent() -> Path | None:
        """This process's own cgroup in a hierarchy with the pids controller (v2, else v1's pids), or None."""
        root = Path("/sys/fs/cgroup")
        own = {}
        try:
            for line in Path("/proc/self/cgroup").read_text().splitlines():
                _, controllers, path = line.split(":", 2)
                own[controllers] = path
        except OSError:
            return None
        if (root / "cgroup.controllers").exists() and "pids" in (root / "cgroup.controllers").read_text():
            return root / own.get("", "/").lstrip("/")
        if (root / "pids").is_dir():
            return root / "pids" / own.get("pids", "/").lstrip("/")
        return None

    @classmethod
    def create(cls, name: str, max_pids: int) -> PidsCgroup | None:
        parent = _cgroup_parent()
        if parent is None:
            return None
        path = parent / name
        try:
            path.mkdir()
            (path / "pids.max").write_text(str(max_pids))
        except OSError:
            with contextlib.suppress(OSError):
                path.rmdir()
            return None
        return cls(path)

    def join(self) -> None:
        """Move the calling process in (from a child before it execs: everything it starts is counted)."""
        fd = os.open(self.path / "cgroup.procs", os.O_WRONLY)
        try:
            os.write(fd, str(os.getpid()).encode())
        finally:
            os.close(fd)

    def kill_all(self) -> None:
        """SIGKILL every process still in the cgroup, then remove it."""
        for _ in range(100):
            try:
                pids = [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
            except OSError:
                break
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.01)
        with contextlib.suppress(OSError):
            self.path.rmdir()


@functools.cache
def _cgroup_parent() -> Path | None:
    """Where this process may create run cgroups (probed once: a directory made and removed), or None."""
    if os.geteuid() != 0:
        return None  # RLIMIT_NPROC holds for other users
    parent = PidsCgroup._parent()
    if parent is None:
        return None
    probe = parent / f"verl-sandbox-probe-{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError:
        return None
    return parent


def process_limit_holds() -> bool:
    """Whether a run's process count is enforced: not root (``RLIMIT_NPROC``), or root with a pids cgroup."""
    return os.geteuid() != 0 or _cgroup_parent() is not None


def check():
    """``verl check-env``'s line (a ``Check``): bubblewrap with its process limit, or what is missing
    (docs/sandbox.md)."""
    from verl.utils.env_check import OK, WARN, Check  # noqa: PLC0415 - it imports torch; the sandbox needs none

    if mechanism() != "bubblewrap":
        return Check(WARN, "code sandbox", f"{probe_failure()}: untrusted code would run with resource limits only",
                     "apt-get install bubblewrap", required=False)
    if not process_limit_holds():
        return Check(WARN, "code sandbox", "bubblewrap, but root without a writable pids cgroup: a run's process "
                     "count is not limited", "run as a non-root user, or give this process a pids cgroup",
                     required=False)
    return Check(OK, "code sandbox", "bubblewrap (namespaces, no network, read-only system, limits)", required=False)

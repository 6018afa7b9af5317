"""verl's CPU kernels (``csrc/``), compiled on first use with torch's extension builder, one module for all.

- ``decode_attention`` (``csrc/decode_attention.cpp``, wrapped by ``verl.models.decode_attention``): softmax
  attention of one query position per row, the decode step;
- ``rms_norm``, ``add_rms_norm_``, ``rope_``, ``silu_mul_`` (``csrc/decoder_ops.cpp``, used by
  ``verl.models.fused_decoder``): a Llama-family decoder layer's small operations, one pass each.

Why hand-written and why built here: torch's CPU operators run these as many small passes with a dispatch each (or,
for attention, a GEMM per (row, head) block), which at a decode step's few rows is mostly overhead; vLLM's CPU
kernels exist but live inside vLLM's own paged cache and engine. The build needs g++ and the ``ninja`` package (a
dependency); it takes ~1 min of both cores once per machine (``make kernels`` runs it ahead of any test or run) and
is cached under ``$VERL_CACHE_DIR/torch_extensions``, in a directory named by Python, torch version and the CPU's
vector instructions (as torch reports them), so a cache shared by machines of different CPUs never loads a foreign
build. torch's builder rebuilds when a source changes. When the build fails, ``load_kernels()`` returns None (the
reason logged once, ``build_error()`` returns it) and every caller runs torch's own operators. One switch,
``VERL_CPU_KERNELS``: ``auto`` (default) as just said, ``0`` never builds or uses them, ``1`` makes a failed build an
error. A compiler is optional: it buys speed on CPU (see the README's speed table), never different results beyond
rounding. Without ``make kernels``, the build runs when a model is first loaded on CPU
(``verl.models.loader``), announced, before any training or benchmark clock starts.

    kernels = load_kernels()      # the extension module, or None
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shutil
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from verl.errors import ConfigError, ModelError
from verl.utils.env_check import FAIL, OK, WARN, Check
from verl.utils.fs import cache_dir

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = ("decode_attention.cpp", "decoder_ops.cpp", "bindings.cpp")
# Vector-instruction flags per torch's CPU capability: the build is for this machine's CPU.
ISA_FLAGS = {"AVX512": ["-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl", "-mfma", "-mavx2"],
             "AVX2": ["-mavx2", "-mfma"]}

_lock = threading.Lock()
_module: Any = None
_failed: str | None = None


SWITCH = "VERL_CPU_KERNELS"  # auto (default): build, else torch's operators; 0: never build; 1: the build must work


def switch() -> str:
    value = os.environ.get(SWITCH, "auto").strip().lower() or "auto"
    if value not in ("auto", "0", "1"):
        raise ConfigError(f"{SWITCH}={value!r}: use auto (build them when a C++ compiler is here, else torch's "
                          "operators), 0 (never) or 1 (required: fail when they cannot be built)")
    return value


def load_kernels() -> Any | None:
    """The compiled extension (built on the first call in a process tree; later processes load the build), or None
    when ``VERL_CPU_KERNELS=0`` or it cannot be built here (the reason is logged once, and ``build_error()`` returns
    it). With ``VERL_CPU_KERNELS=1`` a failed build is an error instead."""
    global _module, _failed
    if _module is not None or _failed is not None:
        return _module
    mode = switch()
    with _lock:
        if _module is not None or _failed is not None:
            return _module
        if mode == "0":
            _failed = f"turned off ({SWITCH}=0)"
            return None
        try:
            _module = _build()
        except Exception as error:  # noqa: BLE001  (any build failure means: use torch's operators)
            _failed = f"{type(error).__name__}: {str(error).strip().splitlines()[-1] if str(error).strip() else ''}"
            if mode == "1":
                raise ModelError(f"{SWITCH}=1 but verl's CPU kernels cannot be built: {_failed}; install a C++ "
                                 f"compiler, or set {SWITCH}=auto to run torch's operators instead") from None
            log.warning("verl's CPU kernels are unavailable, torch's operators run instead (%s)", _failed)
    return _module


def build_error() -> str | None:
    return _failed


def _where() -> tuple[Path, str]:
    """The build's directory and module name: one per Python, torch (its C++ ABI) and instruction set."""
    capability = torch.backends.cpu.get_cpu_capability()
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    tag = re.sub(r"[^A-Za-z0-9]+", "_", f"{python}_{torch.__version__}_{capability}").lower()
    return cache_dir() / "torch_extensions" / f"cpu_kernels_{tag}", f"verl_cpu_kernels_{tag}"


def status() -> Check:
    """The kernels' line in ``verl check-env``, without building anything."""
    mode = switch()
    if mode == "0":
        return Check(OK, "CPU kernels", f"off ({SWITCH}=0): torch's operators run", required=False)
    if _failed is not None:  # this process tried (``verl check-env --build-kernels``) and the build failed
        return Check(FAIL if mode == "1" else WARN, "CPU kernels", f"not built ({_failed}); torch's operators run",
                     "install a C++ compiler (apt-get install g++), or leave it: a compiler is optional",
                     required=mode == "1")
    directory, name = _where()
    if (directory / f"{name}.so").exists():
        return Check(OK, "CPU kernels", f"built ({directory})", required=False)
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return Check(FAIL if mode == "1" else WARN, "CPU kernels",
                     f"cannot be built: no C++ compiler ({compiler}) on PATH; torch's operators run (a compiler is "
                     "optional; it makes CPU decoding and updates faster)", "apt-get install g++", required=mode == "1")
    return Check(OK, "CPU kernels", "not built yet: built once at the first model load on CPU (~1 min; "
                 "`verl check-env --build-kernels` builds them now), then cached", required=False)


@contextlib.contextmanager
def build_lock(directory: Path) -> Iterator[None]:
    """One verl process at a time inside torch's builder for ``directory``, by an ``flock`` the kernel releases when
    its holder dies. torch's own guard is a ``lock`` file that a process killed inside the builder (SIGKILL, the OOM
    killer — even during the quick up-to-date check of an existing build) leaves behind, and every later load then
    waits on it forever, asleep; under this lock no other verl process is in the builder, so such a file is stale
    and is removed."""
    with (directory / "verl.flock").open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (directory / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def use_packaged_ninja() -> None:
    """Put the ``ninja`` package's binary first on this process's PATH (torch's builder runs ``ninja`` from PATH).

    Always that one, never a system ninja found first: ninja 1.11 (Debian's) and 1.12+ (the package) hash the build
    log's command lines differently, so two verl processes that found different ninjas each saw the other's build as
    changed and rebuilt every kernel (~1 min of both cores, every model load behind the lock waiting): three rebuilds
    in one README story's eight minutes, between a process started from an activated venv and one that was not."""
    import ninja  # noqa: PLC0415

    path = os.environ.get("PATH", "")
    if not path.startswith(ninja.BIN_DIR + os.pathsep):
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path


def _build() -> Any:
    from torch.utils import cpp_extension  # noqa: PLC0415  (slow import; only when a kernel is first needed)

    use_packaged_ninja()
    capability = torch.backends.cpu.get_cpu_capability()
    directory, name = _where()
    directory.mkdir(parents=True, exist_ok=True)
    built = (directory / f"{name}.so").exists()
    compiler = os.environ.get("CXX", "c++")
    if not built and shutil.which(compiler) is None:
        # Said here in one line: torch's builder would first print its own multi-line compiler warning.
        raise RuntimeError(f"no C++ compiler ({compiler}) on PATH")
    if not built:  # say why the first forward pauses
        print(f"verl: building the CPU kernels in {directory} (once per machine, ~1 min)", file=sys.stderr, flush=True)
    with warnings.catch_warnings(), build_lock(directory):  # torch's builder warns in paragraphs; failures raise
        warnings.simplefilter("ignore")
        return cpp_extension.load(name=name, sources=[str(CSRC / source) for source in SOURCES],
                                  # -fno-trapping-math: lets GCC vectorize floor() (the exp in softmax and SiLU);
                                  # nothing here reads floating-point exception flags.
                                  extra_cflags=["-O3", "-fopenmp-simd", "-fno-trapping-math",
                                                *ISA_FLAGS.get(capability, [])],
                                  extra_include_paths=[str(CSRC)], build_directory=str(directory), verbose=False)


def build_ahead() -> Any | None:
    """``load_kernels()`` for a caller that reports the outcome in its own line (``make kernels``,
    ``verl check-env --build-kernels``): the failure's warning is not logged a second time."""
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        return load_kernels()
    finally:
        log.setLevel(level)


def main() -> int:
    """``python -m verl.models.cpu_kernels`` (``make kernels``): build the kernels now, ahead of any model load, and
    say in one line whether they are built. Imports only torch, so an installer can run it while other packages are
    still being installed. Exit 1 only when ``VERL_CPU_KERNELS=1`` and they cannot be built."""
    try:
        module = build_ahead()
    except (ConfigError, ModelError) as error:
        print(f"verl: {error}", file=sys.stderr)
        return 1
    if module is None:
        print(f"verl: CPU kernels not built ({build_error()}); torch's operators run", file=sys.stderr)
    else:
        print(f"verl: CPU kernels built ({Path(module.__file__).parent})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

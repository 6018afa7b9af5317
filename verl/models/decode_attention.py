"""A CPU attention kernel for one query position per row (the decode step), built on first use.

torch's CPU ``scaled_dot_product_attention`` runs its flash kernel: a small GEMM per (row, head) block, which at one
query position is mostly call overhead, over every column of the cache, padding included. ``csrc/decode_attention.cpp``
reads each (row, K/V head) block's unmasked K and V rows once for all the query heads of its group. Measured with
cold caches (30 layers' caches in turn, one thread): SmolLM2's shape (16 rows, 9 query heads over 3 K/V heads,
head_dim 64, 97 columns) 0.114 vs 0.315 ms per layer; the tiny agent's (128 rows, 4 heads, head_dim 32, 110
columns) 0.84 vs 1.60 ms. No library offers it: vLLM's CPU kernels live inside vLLM's own paged cache and engine.

It is compiled on first use with torch's extension builder (g++ and the ``ninja`` package; ~20 s once per machine,
cached under ``$VERL_CACHE_DIR/torch_extensions``) for the CPU's vector instructions as torch reports them. When it
cannot be built or does not apply (grad enabled, not fp32, a float mask, head_dim other than 32 / 64 / 128),
``decode_attention`` returns None and the caller runs SDPA. ``VERL_DECODE_KERNEL=0`` turns it off.

    out = decode_attention(query, key, value, mask, scale)   # (B, 1, H, D) or None
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from verl.utils.fs import cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "decode_attention.cpp"
HEAD_DIMS = (32, 64, 128)  # the head sizes the kernel is compiled for (templates in the source)
# Vector-instruction flags per torch's CPU capability: the build is for this machine's CPU, and the capability is in
# the extension's name, so a cache directory shared by machines of different CPUs never loads a foreign build.
ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl", "-mfma", "-mavx2"],
    "AVX2": ["-mavx2", "-mfma"],
}

_lock = threading.Lock()
_module: Any = None
_failed: str | None = None


def enabled() -> bool:
    return os.environ.get("VERL_DECODE_KERNEL", "1") != "0"


def load_kernel() -> Any | None:
    """The compiled extension (built on the first call in a process tree; later processes load the build), or None
    when it cannot be built here (the reason is logged once, and ``build_error()`` returns it)."""
    global _module, _failed
    if _module is not None or _failed is not None:
        return _module
    with _lock:
        if _module is not None or _failed is not None:
            return _module
        try:
            _module = _build()
        except Exception as error:  # noqa: BLE001  (any build failure means: use SDPA)
            _failed = f"{type(error).__name__}: {str(error).strip().splitlines()[-1] if str(error).strip() else ''}"
            log.warning("decode attention kernel unavailable, using SDPA (%s)", _failed)
    return _module


def build_error() -> str | None:
    return _failed


def _build() -> Any:
    from torch.utils import cpp_extension  # noqa: PLC0415  (slow import; only when a decode runs)

    if shutil.which("ninja") is None:
        # torch's builder runs `ninja` from PATH; the `ninja` package ships the binary but only a venv's activation
        # puts it on PATH.
        import ninja  # noqa: PLC0415

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    capability = torch.backends.cpu.get_cpu_capability()
    # A build is for one Python, one torch (its C++ ABI) and one instruction set: all three name its directory.
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    tag = re.sub(r"[^A-Za-z0-9]+", "_", f"{python}_{torch.__version__}_{capability}").lower()
    directory = cache_dir() / "torch_extensions" / f"decode_attention_{tag}"
    directory.mkdir(parents=True, exist_ok=True)
    name = f"verl_decode_attention_{tag}"
    if not (directory / f"{name}.so").exists():  # say why the first decode step pauses
        print(f"verl: building the CPU decode-attention kernel in {directory} (once per machine, ~20 s)",
              file=sys.stderr, flush=True)
    return cpp_extension.load(name=name, sources=[str(SOURCE)],
                              extra_cflags=["-O3", "-fopenmp-simd", *ISA_FLAGS.get(capability, [])],
                              build_directory=str(directory), verbose=False)


def applies(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether the kernel computes this call: one query position, CPU, fp32, no autograd, a supported head size,
    a boolean (B or 1, 1, 1, T) mask or none."""
    if query.shape[2] != 1 or query.device.type != "cpu" or query.dtype != torch.float32:
        return False
    if key.dtype != torch.float32 or value.dtype != torch.float32 or query.shape[-1] not in HEAD_DIMS:
        return False
    if value.shape[-1] != query.shape[-1]:
        return False
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return False  # the kernel has no backward
    if query.stride(-1) != 1 or key.stride(-1) != 1 or value.stride(-1) != 1:
        return False
    return mask is None or (mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[1] == 1
                            and mask.shape[2] == 1 and mask.shape[0] in (1, query.shape[0])
                            and mask.shape[3] == key.shape[2])


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                     scale: float) -> torch.Tensor | None:
    """Softmax attention of one query position per row. Shapes: query (B, H, 1, D), key/value (B, Hkv, T, D) with
    H a multiple of Hkv (grouped heads read their K/V head), mask (B or 1, 1, 1, T) bool, True = attend. Returns
    (B, 1, H, D), or None when the kernel is off, unavailable or does not apply (the caller runs SDPA)."""
    if not enabled() or not applies(query, key, value, mask):
        return None
    kernel = load_kernel()
    if kernel is None:
        return None
    with torch.profiler.record_function("verl::decode_attention"):  # named in profiles (decode_profile.py)
        return kernel.decode_attention(query, key, value, mask, float(scale))

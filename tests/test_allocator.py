"""verl.utils.allocator: tensor-sized blocks come from the heap (no mmap per tensor) once tuned; opt-out works.
Each case runs in a fresh interpreter, since malloc settings are per process and the test process is tuned."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

PROBE = textwrap.dedent("""
    import ctypes
    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                    "fsmblks", "uordblks", "fordblks", "keepcost")]
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = Info
    from verl.utils.seeding import set_num_threads
    set_num_threads(1)  # what every computing process calls first
    import torch
    before = libc.mallinfo2().hblkhd
    x = torch.empty(8 * 1024 * 1024 // 4)  # an 8 MB activation-sized tensor
    print(libc.mallinfo2().hblkhd - before)
""")


def mapped_bytes_for_an_8mb_tensor(**env: str) -> int:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip().splitlines()[-1])


def test_tensor_sized_blocks_come_from_the_heap_and_the_opt_out_restores_mmap():
    assert mapped_bytes_for_an_8mb_tensor() == 0
    assert mapped_bytes_for_an_8mb_tensor(VERL_MALLOC_TUNING="0") >= 8 * 1024 * 1024



def test_a_rollout_engine_tunes_its_process_too(monkeypatch):
    """A rollout outside the trainer (a user's script, a benchmark) recycles blocks as the trainer does: the engine
    asks for the tuning when it is built. (A probe like the one above cannot show it after a model load: freeing
    the load's big blocks already raised glibc's moving mmap threshold; what differs is trimming, as the
    sampling step's temporaries are freed and taken again.)"""
    import verl.rollout.hf as hf
    from verl.models.loader import load_causal_lm, load_tokenizer

    calls = []
    monkeypatch.setattr(hf, "keep_freed_memory", lambda: calls.append(1) or True)
    hf.HFRollout(load_causal_lm("builtin:tiny-arith"), load_tokenizer("builtin:tiny-arith"))
    assert calls == [1]

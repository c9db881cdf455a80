"""glibc's malloc told to keep freed memory for the next step, in the processes of a CPU job.

Why: a CPU step of the README's job allocates and frees the same tens of MB of tensors every step (the learner's
activations, the decode loop's attention scores and caches). glibc serves blocks above its mmap threshold (128 KiB at
start, raised by what is freed, at most 32 MiB) with fresh mappings and gives the top of its heap back to the kernel
once more than its trim threshold is free, so the next step faults the same pages in again, each zeroed by the kernel.
Measured on the 2-core box (configs/tictactoe-tiny-gspo.toml from the recipe's SFT checkpoint, steps 50-100 of a
150-step job, /proc/PID/stat of each actor): ~7,400 minor faults a step in the rollout worker and ~11,200 in the
learner, 15 and 18 ms of system CPU a step; 13 and 2 faults, 5 and 2 ms, with these settings (the same as glibc's
MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_, which act only at a process's start). The cost: a process keeps up
to 1 GiB of freed heap instead of returning it (blocks of 32 MiB and more are still mapped and unmapped each time).

Called by the CPU engine (rlsys/engines/transformers_engine.py) and the learner on CPU; never on GPU jobs, whose
large host buffers (checkpoints, weight pushes) should go back to the system.
"""
from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit); above it mallopt refuses
TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds for this process; False where the C library is not glibc (or not
    Linux), which then keeps its defaults. Idempotent."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc only: musl's mallopt is a stub that does nothing  # noqa: B018
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1

"""rlsys/heap.py: after `keep_freed_memory`, glibc serves a 20 MiB block from its heap (not a fresh mapping) and
keeps it there once freed, so the next step's tensors reuse pages already faulted in."""
import subprocess
import sys

import pytest

from rlsys.heap import keep_freed_memory

# In a fresh process (mallopt is per process): malloc 20 MiB, touch it, free it; print the bytes glibc then holds in
# mappings while the block is live (mallinfo2's hblkhd) and the heap's size after the free (its arena).
PROBE = """
import ctypes, sys
from rlsys.heap import keep_freed_memory
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = (ctypes.c_void_p,)
if sys.argv[1] == "keep":
    assert keep_freed_memory()
block = libc.malloc(20 << 20)
ctypes.memset(block, 1, 20 << 20)
mapped = libc.mallinfo2().hblkhd
libc.free(block)
print(mapped, libc.mallinfo2().arena)
"""
MIB = 1 << 20


def probe(mode: str) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    mapped, heap = out.stdout.split()
    return int(mapped), int(heap)


def has_mallinfo2() -> bool:
    """glibc >= 2.33 on Linux (asked without changing this process's malloc)."""
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version, libc.mallinfo2  # noqa: B018
    except (OSError, AttributeError):
        return False
    return sys.platform.startswith("linux")


@pytest.mark.skipif(not has_mallinfo2(), reason="not glibc >= 2.33 on Linux")
def test_large_blocks_come_from_the_heap_and_stay_there():
    mapped, heap = probe("default")
    assert mapped >= 20 * MIB and heap < 20 * MIB  # glibc's defaults: mapped, and gone with the free
    mapped, heap = probe("keep")
    assert mapped < 20 * MIB and heap >= 20 * MIB  # from the heap, kept for the next block


def test_idempotent_and_true_on_glibc():
    first = keep_freed_memory()
    assert first == keep_freed_memory()
    if has_mallinfo2():  # glibc: mallopt takes both settings
        assert first

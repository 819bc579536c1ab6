"""glibc's allocator told to keep large freed blocks for reuse instead of handing them back.

A routed-experts workload moves a ~1.4 MB engine reply per turn through `serve`: read
from the socket, joined, handed to the decoder process, parsed there. glibc serves a
block that large with its own `mmap` (the threshold starts at 128 KiB and only rises
to sizes it has seen freed) and gives freed heap back to the OS once more than
M_TRIM_THRESHOLD (twice that threshold) is free at its top. Under many concurrent
replies that is a map, fault-in, zero and unmap of every buffer, and each `munmap`
takes the process's memory-map lock, on which every other thread's page fault waits.

Both thresholds fixed (mallopt(3): M_MMAP_THRESHOLD, M_TRIM_THRESHOLD) keep such
blocks in the heap, reused from one reply to the next. Either one alone is worse than
glibc's defaults: setting one stops glibc adapting the other. Measured on the 1.36 MB
workload (bench/README.md, "Large replies and the allocator"): +28% chats/s, -18% CPU
per turn, about the same peak resident memory. Not glibc (musl, macOS): nothing is changed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20
"""glibc's ceiling for M_MMAP_THRESHOLD on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX,
4 MiB x sizeof(long)): a block above it is always mapped on its own."""


def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018  (only glibc has it)
        libc.mallopt  # noqa: B018
    except (OSError, AttributeError):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    return libc


def retain_large_blocks(retain_mb: int) -> bool:
    """Serve blocks up to `MMAP_THRESHOLD_MAX` from the heap and keep up to `retain_mb`
    MiB of it free before trimming (at most 2047: mallopt takes an int). 0 leaves glibc's defaults; False where nothing
    was changed (0, not glibc, or glibc refused a value)."""
    if retain_mb <= 0:
        return False
    libc = _glibc()
    if libc is None:
        log.info("not glibc: malloc thresholds left as they are")
        return False
    ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1
    ok = libc.mallopt(M_TRIM_THRESHOLD, retain_mb << 20) == 1 and ok
    if not ok:
        log.warning("glibc refused a malloc threshold: large blocks may still be mapped one by one")
    return ok


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_serves(size: int) -> bool | None:
    """Whether a block of `size` bytes comes from the heap now rather than a mapping of
    its own (glibc's `mallinfo2` count of mapped blocks); None where it cannot be told
    (not glibc, or older than 2.33). How a test or an operator checks the setting took."""
    libc = _glibc()
    info = getattr(libc, "mallinfo2", None) if libc is not None else None
    if info is None:
        return None
    info.restype = _MallInfo2
    before = info().hblks
    block = bytearray(size)
    during = info().hblks
    del block
    return during == before

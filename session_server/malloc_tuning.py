"""glibc's allocator told to reuse the memory of large freed blocks instead of handing it back.

A routed-experts workload moves a ~1.4 MB engine reply per turn: through the reply
worker, which reads and parses it, and through `serve` when it reads the reply itself
(the first of its kind, a stream's frames) and parses it or hands it over. glibc adapts to
blocks that large: after the first one is freed, its mmap threshold rises to their
size and its trim threshold to twice that (~2.8 MB), so later replies come from the
heap, but every time more than ~2.8 MB is free at the top of a heap it is given back
(`brk`, or shrinking a thread's heap) and must be grown and faulted in again for the
next replies. Under many concurrent replies that is a steady grow-and-trim cycle.

Both thresholds fixed (mallopt(3): M_MMAP_THRESHOLD at `MMAP_THRESHOLD_MAX`,
M_TRIM_THRESHOLD at the setting) keep that memory for reuse. Setting only one is worse
than glibc's defaults: either one stops glibc adapting the other. The price is memory
held after a burst: each heap's top keeps up to the setting free (a thread's heap is
at most 64 MiB), measured in bench/README.md ("Large replies and the allocator")
with the throughput it buys. Not glibc (musl, macOS): nothing is changed.
"""

from __future__ import annotations

import ctypes
import functools
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20
"""The largest mmap threshold glibc would choose itself on 64-bit
(DEFAULT_MMAP_THRESHOLD_MAX, 4 MiB x sizeof(long)); a block above it is mapped on its own."""
MAX_RETAIN_MB = 2047
"""mallopt takes a C int: 2047 MiB is the largest that fits."""


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library this process runs on, when it is glibc (without running ldconfig)."""
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    return libc


def retain_large_blocks(retain_mb: int) -> bool:
    """Serve blocks up to `MMAP_THRESHOLD_MAX` from the heap and let the top of each heap
    keep up to `retain_mb` MiB free before it is trimmed. 0 leaves the allocator as the
    environment set it (GLIBC_TUNABLES, MALLOC_*_); any other value overrides those.
    True when both thresholds were set; the trim threshold is set only after the mmap
    one, so a refusal never leaves the worse half-tuned allocator."""
    if not 0 <= retain_mb <= MAX_RETAIN_MB:
        raise ValueError(f"malloc_retain_mb must be within 0..{MAX_RETAIN_MB}, not {retain_mb}")
    if retain_mb == 0:
        return False
    libc = _glibc()
    if libc is None:
        log.info("not glibc: malloc thresholds left as they are")
        return False
    if libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) != 1 or libc.mallopt(M_TRIM_THRESHOLD, retain_mb << 20) != 1:
        log.warning("glibc refused a malloc threshold: its adaptive defaults stay")
        return False
    log.info("malloc: blocks up to %d MiB from the heap, up to %d MiB kept free at a heap's top",
             MMAP_THRESHOLD_MAX >> 20, retain_mb)
    return True


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_serves(size: int) -> bool | None:
    """A probe for tests: whether a block of `size` bytes comes from the heap rather than
    a mapping of its own (glibc's `mallinfo2` count of mapped blocks; None before glibc
    2.33 or elsewhere). The count is the whole process's, and freeing a mapped probe
    block moves glibc's adaptive threshold: ask in a process of its own, about a size
    larger than any freed before."""
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

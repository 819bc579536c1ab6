"""glibc reuses the memory of large freed blocks in `serve` and its reply workers.

Each check runs in a fresh process (with no allocator settings in its environment), so
this test process's allocator is left alone.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from session_server.engines.reply_decoder import ReplyDecoder
from session_server.engines.reply_worker import CALL
from session_server.malloc_tuning import _glibc, heap_serves, retain_large_blocks
from session_server.offload import CpuOffload

pytestmark = pytest.mark.skipif(_glibc() is None or not hasattr(_glibc(), "mallinfo2"),
                                reason="needs glibc 2.33+ (mallinfo2)")

PROBE = """
import ctypes, sys
from session_server.malloc_tuning import _MallInfo2, _glibc, heap_serves, retain_large_blocks
info = _glibc().mallinfo2
info.restype = _MallInfo2
first = heap_serves(8 << 20)  # a fresh process maps a block this large on its own
took = retain_large_blocks(int(sys.argv[1]))
later = heap_serves(16 << 20)  # larger than any block freed so far
blocks = [bytearray(1 << 20) for _ in range(24)]  # 24 MiB at the top of the heap, then freed
del blocks
print(first, took, later, info().keepcost >> 20)  # MiB still free at the top, not trimmed
"""


def _probe(retain_mb: int) -> list[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    out = subprocess.run([sys.executable, "-c", PROBE, str(retain_mb)], capture_output=True, text=True,
                         check=True, env=env)
    return out.stdout.split()


def test_large_blocks_come_from_the_heap_and_its_top_keeps_what_the_setting_says() -> None:
    first, took, later, kept = _probe(256)
    assert (first, took, later) == ("False", "True", "True") and int(kept) >= 20
    first, took, later, kept = _probe(2)
    assert (first, took, later) == ("False", "True", "True") and int(kept) <= 2, "more than 2 MiB was kept"
    first, took, later, _ = _probe(0)
    assert (first, took, later) == ("False", "False", "False"), "0 must leave glibc adapting by itself"


def test_a_value_outside_what_mallopt_takes_is_refused() -> None:
    for bad in (-1, 2048, 4096):
        with pytest.raises(ValueError, match="0..2047"):
            retain_large_blocks(bad)


@pytest.mark.parametrize("retain_mb, from_heap", [(256, True), (0, False)])
def test_the_decoder_processes_follow_the_setting(retain_mb: int, from_heap: bool) -> None:
    async def ask() -> bool | None:
        threads = CpuOffload(1)
        decoder = ReplyDecoder(threads, processes=1, malloc_retain_mb=retain_mb)
        try:
            await decoder.start()
            worker = decoder._worker()
            assert worker is not None
            return bool(await worker.ask(CALL, (heap_serves, (16 << 20,), {})))
        finally:
            await decoder.aclose()
            threads.shutdown()

    assert asyncio.run(ask()) is from_heap

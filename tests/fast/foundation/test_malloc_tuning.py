"""glibc keeps large freed blocks in the heap in `serve` and its decoder processes.

Each check runs in a fresh process, so this test process's allocator is left alone.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from session_server.engines.reply_decoder import ReplyDecoder
from session_server.malloc_tuning import heap_serves
from session_server.offload import CpuOffload

pytestmark = pytest.mark.skipif(heap_serves(1 << 20) is None, reason="needs glibc 2.33+ (mallinfo2)")

PROBE = """
import sys
from session_server.malloc_tuning import heap_serves, retain_large_blocks
first = heap_serves(8 << 20)  # a fresh process maps a block this large on its own
took = retain_large_blocks(int(sys.argv[1]))
print(first, took, heap_serves(16 << 20))  # larger than any block freed so far
"""


def _probe(retain_mb: int) -> list[str]:
    out = subprocess.run([sys.executable, "-c", PROBE, str(retain_mb)], capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_retained_blocks_come_from_the_heap_and_zero_leaves_glibc_mapping_them() -> None:
    assert _probe(256) == ["False", "True", "True"]
    assert _probe(0) == ["False", "False", "False"]


@pytest.mark.parametrize("retain_mb, from_heap", [(256, True), (0, False)])
def test_the_decoder_processes_follow_the_setting(retain_mb: int, from_heap: bool) -> None:
    async def ask() -> bool | None:
        threads = CpuOffload(1)
        decoder = ReplyDecoder(threads, processes=1, malloc_retain_mb=retain_mb)
        try:
            await decoder.start()
            assert decoder._procs is not None
            return await asyncio.get_running_loop().run_in_executor(decoder._procs, heap_serves, 16 << 20)
        finally:
            decoder.shutdown()
            threads.shutdown()

    assert asyncio.run(ask()) is from_heap

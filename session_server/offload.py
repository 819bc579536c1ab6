"""CPU offload: the bounded worker threads where work proportional to a body or a context runs.

JSON parsing, validation, rendering and serialization all happen here so the
event loop stays free to answer `/health` and to move bytes. The thread count is bounded
(`--cpu-workers`, default `min(16, cpu_count)`); callers await its futures.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


INLINE_BYTES = 16 * 1024
"""Bodies below this are parsed/serialized on the event loop (tens of microseconds)."""


def default_cpu_workers() -> int:
    return max(1, min(16, os.cpu_count() or 1))


class CpuOffload:
    """A named, bounded ThreadPoolExecutor with an awaitable `run`."""

    def __init__(self, workers: int | None = None) -> None:
        self.workers = workers or default_cpu_workers()
        self._executor = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="tito-cpu")

    async def run(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """Run `fn` on a worker thread, carrying the caller's contextvars."""
        loop = asyncio.get_running_loop()
        ctx = contextvars.copy_context()
        call = functools.partial(ctx.run, fn, *args, **kwargs)
        return await loop.run_in_executor(self._executor, call)

    async def run_sized(self, size: int, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """Like `run`, but work on fewer than `INLINE_BYTES` runs on the loop: a thread
        hop (submit, wake-up, GIL hand-back) costs more than parsing a small body."""
        if size < INLINE_BYTES:
            return fn(*args, **kwargs)
        return await self.run(fn, *args, **kwargs)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
